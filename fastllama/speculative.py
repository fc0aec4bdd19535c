"""Speculative decoding: a cheap drafter proposes k tokens, the target checks all of them in one
forward, and the output is the target's own: in fp32, greedy decoding gives exactly plain greedy
decoding's tokens and sampling draws from exactly the target's distribution. (In bf16 a verify step
scores k + 1 tokens at once, which rounds differently from scoring them one by one: the logits agree
up to rounding, so a near-tie can resolve the other way.) Any batch size: each row accepts its own
number of tokens and moves on at its own position in the static caches.

A drafter is one object with one job: given the text so far, propose k tokens (and, when sampling,
its probabilities for them). Three are here: `DraftModel` (a smaller model sharing the target's
vocabulary, or the target quantized to int4), `PromptLookup` (the continuation of the latest
earlier occurrence of the last n-gram, no model), and `HeadDrafter`, a small head trained on the
target's own hidden states (`DraftHead`, EAGLE-style; scripts/train_draft_head.py trains one). A new
drafter subclasses `Drafter`; the loop in `speculative_generate` knows none of their details. A
drafter built with `alternatives=m` also offers its next m best tokens at each depth: the target
checks them in the same forward, the drafts as a tree (each alternative in place of the draft at its
depth; `draft_tree`), and keeps one where the draft fails. Use it through
`generate.generate(..., drafter=DraftModel(small_model))`.
"""

import dataclasses
import functools
import json
from pathlib import Path

import torch
import torch.nn as nn
from torch import Tensor

from . import cpu_decode, decode
from .checkpoint import read_safetensors, single, write_safetensors
from .errors import UserError
from .model import PREFILL_CHUNK, ModelArgs, Transformer, rows_at

SPECULATE_K = 5  # tokens drafted a round, unless the caller says otherwise


class Drafter:
    """Proposes draft tokens for speculative decoding. tokens (B, L) hold each row's text so far,
    right-padded; lengths (B,) how much of each row is text. A drafter that reads the target's
    hidden states (`reads_states`) gets those of the prompt in `start` and those of each verify step
    in `accepted`; it must then always propose, as the target's plain steps keep theirs to themselves."""

    reads_states = False
    alternatives = 0  # other tokens offered at each depth, besides the draft (tree drafting)

    def start(self, target: Transformer, tokens: Tensor, prompt_lengths: Tensor, cache_length: int,
              states: Tensor | None = None, steps: decode.Steps = decode.EAGER):
        """Called once per generate() call, after the target's prefill: tokens hold the prompts, and the
        first new token after each; states (B, T, dim), if read, the target's last layer at each prompt
        position; steps, the forwards generate() was given, for a drafter's own (draft_step, head_step)."""

    def propose(self, tokens: Tensor, lengths: Tensor, k: int, **sampling) -> tuple[Tensor, Tensor | None] | int:
        """k drafts a row (B, k) and, when sampling, the drafter's probabilities for them (B, k, V), or
        None for drafts it is sure of (all of their probability on the token). An int n instead of a
        pair: no proposal, the target takes n plain steps (1 <= n <= k + 1) in one round, whose
        bookkeeping then costs once for all of them. With alternatives m > 0, the drafts are
        (B, k, 1 + m): at each depth the draft, then m other tokens (deterministic given the draft),
        which the target checks in its place; probabilities stay the draft's."""
        raise NotImplementedError

    def accepted(self, n: Tensor, active: Tensor, states: Tensor):
        """What the target kept of the last proposal: n (B,) drafts per row; active (B,) the rows still
        generating; states (B, k + 1, dim) the target's last layer at the positions it verified."""


class DraftModel(Drafter):
    """A draft model decoding k tokens a round (and offering its next `alternatives` best tokens at
    each depth). One of the target's own shape and dtype (its quantized copy) reads and writes the
    target's caches instead of keeping its own: it needs no prefill, it drafts from the target's keys
    and values of the text, and the entries it writes (at its drafts' positions) are overwritten by
    the verify step before the target reads them, so the target sees only its own."""

    def __init__(self, model: Transformer, alternatives: int = 0):
        self.model, self.alternatives = model, alternatives

    def start(self, target, tokens, prompt_lengths, cache_length, states=None, steps=decode.EAGER):
        if self.model.config.vocab_size != target.config.vocab_size:
            raise UserError(f"the draft model's vocabulary ({self.model.config.vocab_size} tokens) is not the "
                            f"target's ({target.config.vocab_size}): they must share a tokenizer")
        self.last_position, self.steps = cache_length - 1, steps
        self.shares_caches = share_caches(self.model, target)  # each call: the target's may be new ones
        if not self.shares_caches:
            self.model.setup_caches(tokens.shape[0], cache_length, target.chunk, target.kv_cache_dtype)
            T = int(prompt_lengths.max())
            decode.prefill_logits(self.model, tokens[:, :T], prompt_lengths, steps)  # fills its caches

    def propose(self, tokens, lengths, k, **sampling):
        """The first step feeds the text's last token, and with caches of its own the one before too:
        that one may not be in them yet (when the previous round accepted every draft); feeding it
        again when it is rewrites the same entry. (In the target's caches it always is, and must stay
        the target's.) Positions past the cache are clamped to its last slot: they only ever hold
        drafts beyond the requested length, which are discarded."""
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        fed = 1 if self.shares_caches else 2
        pos = lengths[:, None] - fed + torch.arange(fed, device=tokens.device)  # (B, fed)
        x = tokens[rows[:, None], pos]
        keys = decode.key_positions(self.model, int(lengths.max()) + k)  # the last draft's position + 1
        drafts, probs = [], []
        for _ in range(k):
            logits = self.steps.draft_step(self.model, x, pos.clamp(max=self.last_position), keys)  # (B, V)
            x, q = draft_token(logits, sampling)
            probs += [] if q is None else [q]
            drafts.append(with_alternatives(x, logits, self.alternatives))
            pos = pos[:, -1:] + 1
        return torch.stack(drafts, dim=1).squeeze(-1), torch.stack(probs, dim=1) if probs else None  # (B, k[, 1 + m])


class PromptLookup(Drafter):
    """Drafts from the text itself (no model): the tokens that followed the latest earlier occurrence
    of the last n-gram. On text that does not repeat itself it must cost next to nothing, so it lets
    the target take plain steps for a while when it finds nothing (a search has its cost) and when no
    row keeps two drafts (one, when k is 1) of a proposal (a rejected verify step costs more than a
    plain one). It asks for them k + 1 at a time: a round's bookkeeping costs the loop about as much
    as a search."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def start(self, target, tokens, prompt_lengths, cache_length, states=None, steps=decode.EAGER):
        self.skip = 0  # plain steps to take before drafting again
        self.backoff = 0  # the pause after a proposal no row kept: 2, 8, 32, then 64 steps
        self.misses = 0  # searches in a row that found nothing

    def propose(self, tokens, lengths, k, **sampling):
        self.k = k
        if self.skip == 0:
            drafts, found = prompt_lookup(tokens, lengths, k, self.max_ngram, self.min_ngram)
            if found.any():
                self.misses = 0
                return drafts, None
            self.misses += 1
            self.skip = 1 + min(self.misses, 8)  # this step, then a pause one step longer each miss
        steps = min(self.skip, k + 1)
        self.skip -= steps
        return steps

    def accepted(self, n, active, states):
        kept_enough = (n >= min(2, self.k)) & active  # two drafts, or the only one there was
        self.backoff = 0 if kept_enough.any() else min(4 * self.backoff or 2, 64)
        self.skip = self.backoff


class DraftHead(Transformer):
    """An EAGLE-style draft head (Li et al., 2024): one transformer layer over the target's own
    last-layer states. At position i it reads the target's state at i - 1 with the target's
    embedding of token i, and predicts the target's state at i, from which its output layer scores
    the next token among `vocab`, the most frequent tokens of its training text (a head over the
    whole vocabulary would cost a draft step as much as a small model's). Its attention keeps its own
    cache, so it sees the whole text, through the target's states. config: the target's, with one
    layer and vocab_size = len(vocab)."""

    def __init__(self, config: ModelArgs, vocab: Tensor):
        super().__init__(config)
        del self.tok_embeddings  # its inputs are the target's embeddings
        self.fc = nn.Linear(2 * config.dim, config.dim, bias=False)
        self.register_buffer("vocab", vocab)  # (N,): the target's id of each of its tokens

    @staticmethod
    def config_for(target: ModelArgs, vocab_size: int) -> ModelArgs:
        """The head's shape for a target: one dense layer of the target's, attending to every position."""
        return dataclasses.replace(target, n_layer=1, vocab_size=vocab_size, tie_embeddings=False,
                                   sliding_window=None, sliding_layers=None, n_experts=0, moe_layers=None)

    def forward(self, target: Transformer, tokens: Tensor, states: Tensor, input_pos: Tensor,
                key_positions: Tensor | None = None, last: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """tokens (B, T) at input_pos (B, T); states (B, T, dim): the target's at the positions before.
        Returns the logits over vocab (B, T, N) and the predicted states (B, T, dim), at every position
        or, with last (B,), at each row's index last into T (B, 1, ...)."""
        embeddings = target.tok_embeddings(tokens) * target.embedding_scale
        x = torch.cat([embeddings, states], dim=-1).to(self.fc.weight.dtype)  # (B, T, 2 * dim)
        x = self.blocks(self.fc(x), input_pos, key_positions)
        if last is not None:
            x = rows_at(x, last)
        return self.logits(x), x


HEAD_NAME = "draft_head.safetensors"  # beside the target's checkpoint


def save_head(head: DraftHead, path: Path, target: ModelArgs):
    metadata = {"draft_head": json.dumps(dataclasses.asdict(head.config)),
                "target": json.dumps(dict(vocab_size=target.vocab_size, dim=target.dim))}
    tensors = [single(name, t.dtype, t.shape, lambda t=t: t) for name, t in head.state_dict().items()]
    write_safetensors(path, tensors, metadata, desc="writing the draft head")


def head_drafter(path: Path, target: Transformer, alternatives: int = 0) -> "HeadDrafter":
    """The head at path drafting for target, its products in the forms the target's device decodes best."""
    head = load_head(path, target)
    cpu_decode.apply(head)  # as generate.load_model does for a model
    return HeadDrafter(head, alternatives)


def load_head(path: Path, target: Transformer) -> DraftHead:
    """The head at path, in the target's dtype on its device; one line saying what to run when it is
    missing or belongs to another model."""
    path = Path(path)
    train = "train one: python scripts/train_draft_head.py --checkpoint_path <the target's checkpoint>"
    if not path.is_file():
        raise UserError(f"no draft head at {path}: {train}")
    weight = target.tok_embeddings.weight
    tensors, metadata = read_safetensors(path, weight.device, weight.dtype)
    try:
        config, trained_for = ModelArgs(**json.loads(metadata["draft_head"])), json.loads(metadata["target"])
    except (KeyError, ValueError, TypeError) as e:  # not a head, or one another version wrote
        raise UserError(f"{path} is not a draft head this version reads ({e!r}): {train}")
    mine = dict(vocab_size=target.config.vocab_size, dim=target.config.dim)
    if trained_for != mine:
        raise UserError(f"the draft head {path} was trained for a model with {trained_for}, not this one's "
                        f"{mine}: {train}")
    head = DraftHead(config, tensors["vocab"])
    head.load_state_dict(tensors, assign=True)
    return head.eval()


class HeadDrafter(Drafter):
    """Drafts with a DraftHead: one head step a token, no layer of the target. After each verify
    step, one head forward over its k + 1 positions writes what the target saw there (its states, the
    accepted tokens) into the head's cache, and its output at each row's last text position gives the
    first draft; k - 1 single steps, each fed the head's own predicted state, give the rest (and,
    with alternatives, its next best tokens at each depth)."""

    reads_states = True

    def __init__(self, head: DraftHead, alternatives: int = 0):
        self.head, self.alternatives = head, alternatives

    def start(self, target, tokens, prompt_lengths, cache_length, states=None, steps=decode.EAGER):
        if self.head.config.dim != target.config.dim or int(self.head.vocab.max()) >= target.config.vocab_size:
            raise UserError("the draft head does not fit the target (its width or vocabulary differs): train one "
                            "for it with scripts/train_draft_head.py")
        self.target, self.steps = target, steps
        self.head.setup_caches(tokens.shape[0], cache_length, target.chunk)
        self.last_position = cache_length - 1
        # the prompt: position i reads the target's state at i - 1 and token i (the first new one at the end)
        B, T, _ = states.shape
        positions = torch.arange(1, T + 1, device=tokens.device).expand(B, -1)
        self.next = None, None
        for start, end, last, holds_last in decode.prompt_chunks(prompt_lengths - 1, T, self.head.chunk):
            out = self.head(target, tokens[:, start + 1: end + 1], states[:, start:end],  # eager: any length
                            positions[:, start:end], decode.key_positions(self.head, end + 1), last)
            self.next = tuple(decode.kept(holds_last, new, old) for new, old in zip(out, self.next))
        self.verified = None

    def propose(self, tokens, lengths, k, **sampling):
        if self.verified is not None:  # the last verify step's positions, as the target saw them
            states, first = self.verified  # (B, k + 1, dim); first (B,): the position of their first state + 1
            offsets = torch.arange(states.shape[1], device=tokens.device)
            pos = (first[:, None] + offsets).clamp(max=self.last_position)
            rows = torch.arange(tokens.shape[0], device=tokens.device)[:, None]
            last = (lengths - 1 - first).clamp(0, states.shape[1] - 1)  # each row's last text position
            keys = decode.key_positions(self.head, int(first.max()) + states.shape[1])
            self.next = self.steps.head_step(self.head, self.target, tokens[rows, first[:, None] + offsets], states,
                                             pos, keys, last)
        logits, state = self.next
        keys = decode.key_positions(self.head, int(lengths.max()) + k)
        drafts, probs = [], []
        for i in range(k):
            if i > 0:
                pos = (lengths + i - 1)[:, None].clamp(max=self.last_position)
                logits, state = self.steps.head_step(self.head, self.target, drafts[-1][:, :1], state, pos, keys)
            choice, q = draft_token(logits[:, -1], sampling)  # q (B, N): over the head's vocabulary
            if q is not None:
                probs.append(torch.zeros(q.shape[0], self.target.config.vocab_size, device=q.device)
                             .scatter_(1, self.head.vocab.expand(q.shape[0], -1), q))
            drafts.append(self.head.vocab[with_alternatives(choice, logits[:, -1], self.alternatives)])
        self.lengths = lengths
        return torch.stack(drafts, dim=1).squeeze(-1), torch.stack(probs, dim=1) if probs else None  # (B, k[, 1 + m])

    def accepted(self, n, active, states):
        self.verified = states, self.lengths  # verified at positions lengths - 1 ...: the head's at lengths ...


def share_caches(model: Transformer, other: Transformer) -> bool:
    """Give model other's KV caches (sliding-window rings included) and the position and RoPE tables made
    with them, where they fit it: the same config, dtype and device (a quantized copy, drafting in the
    target's caches). Other must be set up; model then needs no caches of its own. Returns whether they fit."""
    if (model.config, model.activation_dtype(), model.output.weight.device) != (
            other.config, other.activation_dtype(), other.output.weight.device):
        return False
    for layer, source in zip(model.layers, other.layers):
        layer.attention.kv_cache = source.attention.kv_cache
    for name in ("positions", "ring_positions", "rope_cache", "local_rope_cache", "embedding_scale"):
        if hasattr(other, name):  # the tables setup_caches made with the caches
            model.register_buffer(name, getattr(other, name), persistent=False)
    model.max_batch_size, model.chunk, model.kv_cache_dtype = other.max_batch_size, other.chunk, other.kv_cache_dtype
    model.max_seq_length, model.caches_made_for = other.max_seq_length, other.caches_made_for
    return True


def move_cache_entries(model: Transformer, source: Tensor, target: Tensor):
    """Each row's keys and values at slot source (B,) copied to slot target (B,), in every layer's full
    cache: a draft the tree verified in a slot of its own goes where its position is."""
    rows = torch.arange(source.shape[0], device=source.device)
    for layer in model.layers:
        for buffer in layer.attention.kv_cache.buffers():
            buffer[rows, :, target] = buffer[rows, :, source]



def draft_token(logits: Tensor, sampling: dict) -> tuple[Tensor, Tensor | None]:
    """A drafter's token from its logits (B, V): the argmax (B, 1) when greedy, with no probabilities;
    else sampled, with the probabilities it was drawn from (B, V)."""
    if sampling["temperature"] == 0:
        return logits.argmax(-1, keepdim=True), None
    q = decode.logits_to_probs(logits, **sampling)
    return decode.sample_from(q), q


def with_alternatives(choice: Tensor, scores: Tensor, m: int) -> Tensor:
    """The chosen token (B, 1) followed by the m best others by scores (B, V): (B, 1 + m)."""
    if m == 0:
        return choice
    if m >= scores.shape[-1]:
        raise UserError(f"{m} alternatives at each depth need a drafter of more than {m} tokens; this one has "
                        f"{scores.shape[-1]}: lower --draft_alternatives")
    top = scores.topk(m + 1, dim=-1).indices  # (B, m + 1): holds the choice, or m + 1 others
    first_others = (top != choice).long().argsort(dim=1, descending=True, stable=True)[:, :m]
    return torch.cat([choice, top.gather(1, first_others)], dim=1)


def speculative_generate(model: Transformer, prompts: list[Tensor], max_new_tokens: int, drafter: Drafter, *,
                         speculate_k: int = SPECULATE_K, temperature: float = 0.0, top_k: int | None = None,
                         top_p: float | None = None, stop_ids: list[int] | None = None, callback=None,
                         stats: dict | None = None, prefill_chunk: int = PREFILL_CHUNK,
                         kv_cache_dtype: torch.dtype | None = None, steps: decode.Steps = decode.EAGER
                         ) -> list[Tensor]:
    """Each prompt followed by its new tokens, as generate.generate returns them; steps, generate's: the
    forwards the target and the drafter run. `stats`, if given, receives "accepted_counts" (how many
    verify steps, over all rows, found 0, 1, ..., k drafts right; an alternative kept counts as the
    draft it replaced), "verify_tokens" (the tokens those steps added to the text: fewer where a round
    passes max_new_tokens), "plain_steps" (steps taken without a proposal) and, with alternatives,
    "alternatives_kept" (the rounds that kept one)."""
    k, device = speculate_k, next(model.parameters()).device
    B = len(prompts)
    prompt_lengths = torch.tensor([len(p) for p in prompts], device=device)
    T = int(prompt_lengths.max())
    tree_slots = check_speculation(model, drafter, k, T + max_new_tokens, prefill_chunk)
    # the plain cache, and slots for a tree's alternatives: a verify step's slots past it are clamped to
    # its last, since they only ever hold drafts beyond the requested length
    cache_length = decode.padded_length(T + max_new_tokens + tree_slots, model.config.block_size)
    model.setup_caches(B, cache_length, prefill_chunk, kv_cache_dtype)
    cpu_decode.pack(model)  # a CPU bf16 target's verify steps read a copy of its weights in a kernel's layout
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p)

    # tokens: every row's text so far, right-padded, with room for a round's k + 1 tokens past the
    # cache; lengths: how much of each row is text
    tokens = decode.right_padded(prompts, cache_length + k + 1, device)
    if drafter.reads_states:
        logits, states = decode.prefill_logits(model, tokens[:, :T], prompt_lengths, steps, states=True)
    else:
        logits, states = decode.prefill_logits(model, tokens[:, :T], prompt_lengths, steps), None
    cur = decode.sample(logits[:, 0], **sampling)  # (B, 1)
    rows = torch.arange(B, device=device)
    tokens[rows, prompt_lengths] = cur[:, 0]
    drafter.start(model, tokens, prompt_lengths, cache_length, states, steps=steps)
    lengths = prompt_lengths + 1  # cur is text, not yet in the target's cache
    limit = prompt_lengths + max_new_tokens
    stops = torch.tensor(stop_ids or [], device=device)
    done = torch.isin(cur[:, 0], stops) | (lengths >= limit)
    if callback:
        decode.stream(callback, cur, torch.ones_like(cur, dtype=torch.bool))
    accepted_counts = torch.zeros(k + 1, dtype=torch.long, device=device)
    alternatives_kept = torch.zeros((), dtype=torch.long, device=device)
    verify_tokens = torch.zeros((), dtype=torch.long, device=device)
    plain_step_count = 0

    while not done.all():  # host syncs a round, not a token
        keys = decode.key_positions(model, int(lengths.max()) + k + tree_slots)  # a verify step's last slot + 1
        proposal = drafter.propose(tokens, lengths, k, **sampling)
        if isinstance(proposal, int):
            if not 1 <= proposal <= k + 1:
                raise UserError(f"{type(drafter).__name__} asked for {proposal} plain steps in a round; "
                                f"a round takes 1 to speculate_k + 1 = {k + 1}")
            n_plain = min(proposal, int(torch.where(done, 0, limit - lengths).max()))  # none past the last token
            emitted = plain_steps(model, cur, lengths, n_plain, cache_length, keys, steps, **sampling)  # (B, n_plain)
            n, next_token = torch.full_like(lengths, n_plain - 1), emitted[:, -1]
            plain_step_count += n_plain
        else:
            drafts, draft_probs = proposal  # drafts (B, k), or (B, k, 1 + m) with alternatives
            chain = drafts if drafts.dim() == 2 else drafts[..., 0]
            # drafts (B, k) as kept: an alternative stands in place of the draft it replaced
            n, next_token, drafts, states = verify(model, cur, drafts, draft_probs, lengths, cache_length, keys,
                                                   steps, **sampling)
            accepted_counts.scatter_add_(0, n, (~done).long())
            if tree_slots:
                alternatives_kept += ((drafts != chain).any(1) & ~done).sum()
            drafter.accepted(n, ~done, states)
            # the row's accepted drafts, then the target's own token; what lies beyond is overwritten later
            emitted = torch.cat([drafts, drafts[:, :1]], dim=1).scatter(1, n[:, None], next_token[:, None])
        n = torch.where(done, -1, n)  # finished rows stand still
        written = write_emitted(tokens, emitted, n, lengths, limit)
        if not isinstance(proposal, int):
            verify_tokens += written.sum()
        stopped = torch.isin(emitted, stops) & written
        if callback:  # the row's text: written, up to and including a stop token
            decode.stream(callback, emitted, written & (stopped.cumsum(1) - stopped.long() == 0))
        done |= stopped.any(1)
        cur = torch.where(done[:, None], cur, next_token[:, None])
        lengths = torch.minimum(lengths + n + 1, limit)
        done |= lengths == limit

    if stats is not None:
        stats.update(accepted_counts=accepted_counts.tolist(), verify_tokens=int(verify_tokens),
                     plain_steps=plain_step_count)
        if tree_slots:
            stats.update(alternatives_kept=int(alternatives_kept))
    return [torch.cat([p.cpu(), decode.until_stop(row[len(p): end], stop_ids)])
            for p, row, end in zip(prompts, tokens.cpu(), lengths.tolist())]


def check_speculation(model: Transformer, drafter: Drafter, k: int, length: int, prefill_chunk: int) -> int:
    """Refuse, in one line, what speculative decoding with k drafts a round cannot do for texts of `length`
    positions; returns the slots a tree's alternatives take past the text (0 without alternatives)."""
    if not isinstance(drafter, Drafter):
        raise UserError(f"drafter must be a speculative.Drafter (DraftModel, PromptLookup, HeadDrafter), "
                        f"not {drafter!r}")
    if k < 1:
        raise UserError(f"speculate_k must be at least 1, got {k}")
    tree_slots = k * drafter.alternatives
    if tree_slots and model.config.sliding_window:
        raise UserError("drafting with alternatives (a tree) needs full caches, and this model has sliding-window "
                        "layers: draft without alternatives")
    if tree_slots and length + tree_slots > model.config.block_size:
        raise UserError(f"drafting with alternatives (a tree) needs {tree_slots} positions of room past the prompt and "
                        f"max_new_tokens within the context length {model.config.block_size}: lower max_new_tokens, "
                        "speculate_k or the alternatives")
    if k >= prefill_chunk:  # a sliding-window ring keeps the positions of one verify step and no more
        raise UserError(f"speculate_k ({k}) must be less than prefill_chunk ({prefill_chunk})")
    return tree_slots


def write_emitted(tokens: Tensor, emitted: Tensor, n: Tensor, lengths: Tensor, limit: Tensor) -> Tensor:
    """Write a round's tokens emitted (B, e) into the texts tokens at each row's length: the first n + 1 of
    each row (none for n = -1), none past its limit. Returns which were written (B, e)."""
    offsets = torch.arange(emitted.shape[1], device=emitted.device)
    position = lengths[:, None] + offsets  # (B, e): where each emitted token goes
    written = (offsets <= n[:, None]) & (position < limit[:, None])
    tokens.scatter_(1, position, torch.where(written, emitted, tokens.gather(1, position)))
    return written


def plain_steps(model: Transformer, cur: Tensor, lengths: Tensor, n: int, cache_length: int, keys: Tensor,
                steps: decode.Steps, **sampling) -> Tensor:
    """n plain decode steps (steps.decode_one_token) of the target after cur (B, 1), each row's last
    token (at lengths - 1): the next n tokens (B, n). Positions past the cache are clamped to its last
    slot, as in verify."""
    tokens = [cur]
    for i in range(n):
        position = (lengths - 1 + i).clamp(max=cache_length - 1)[:, None]
        tokens.append(steps.decode_one_token(model, tokens[-1], position, keys, **sampling))
    return torch.cat(tokens[1:], dim=1)


def prompt_lookup(tokens: Tensor, lengths: Tensor, k: int, max_ngram: int = 3, min_ngram: int = 2
                  ) -> tuple[Tensor, Tensor]:
    """For each row, find the latest earlier occurrence of its last n-gram (longest n first) and
    propose the k tokens that followed it; where those run past the end of the text, the text repeats
    with the period the match implies ("a b a b" drafts "a b a b"). On the device, with no host sync.
    Returns the drafts (B, k) and which rows found a match (B,); the others propose their last token
    again, for verification to reject."""
    B, L = tokens.shape
    rows = torch.arange(B, device=tokens.device)[:, None]
    length = lengths[:, None]  # (B, 1)
    drafts = tokens[rows, length - 1].expand(B, k)
    found = torch.zeros(B, dtype=torch.bool, device=tokens.device)
    for n in range(max_ngram, min_ngram - 1, -1):
        last = tokens[rows, (length - n + torch.arange(n, device=tokens.device)).clamp(min=0)]  # (B, n)
        starts = torch.arange(L - n + 1, device=tokens.device)
        match = (tokens.unfold(1, n, 1) == last[:, None, :]).all(-1)  # (B, L - n + 1): n-gram at each start
        match &= starts < length - n  # strictly before the last n-gram itself
        latest = torch.where(match, starts, -1).amax(1, keepdim=True)  # (B, 1), -1 where none
        period = (length - n - latest).clamp(min=1)
        follow = latest + n + torch.arange(k, device=tokens.device)  # (B, k)
        follow = torch.where(follow < length, follow, length - period + (follow - length) % period)
        use = (latest[:, 0] >= 0) & ~found
        drafts = torch.where(use[:, None], tokens[rows, follow.clamp(0, L - 1)], drafts)
        found |= use
    return drafts, found


def verify(model: Transformer, cur: Tensor, drafts: Tensor, draft_probs: Tensor | None, lengths: Tensor,
           cache_length: int, keys: Tensor, steps: decode.Steps, temperature: float = 0.0,
           top_k: int | None = None, top_p: float | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Score cur and the drafts in one forward of the target (steps.target_step), writing them into its
    cache; keys: decode.key_positions() above all of their slots. drafts (B, k), or (B, k, 1 + m): each
    draft and m alternatives to it, scored as a tree (draft_tree). Returns each row's number of kept
    drafts n (B,), the token that follows them (B,), the drafts as kept (B, k: an alternative in place
    of the draft it replaced) and the target's last-layer states at cur and them (B, k + 1, dim)."""
    chain, alternatives = (drafts, None) if drafts.dim() == 2 else (drafts[..., 0], drafts[..., 1:])
    B, k = chain.shape
    x = torch.cat([cur, chain] + ([] if alternatives is None else [alternatives.flatten(1)]), dim=1)  # (B, N)
    tree = None if alternatives is None else draft_tree(k, alternatives.shape[2], x.device)
    pos = ((lengths - 1)[:, None] + torch.arange(x.shape[1], device=x.device)).clamp(max=cache_length - 1)
    logits, states = steps.target_step(model, x, pos, keys, tree)  # (B, N, V), (B, N, dim)
    if temperature == 0:
        n, next_token, node = accept_greedy(logits, chain, alternatives)
    else:
        V = logits.shape[-1]
        target_probs = decode.logits_to_probs(logits.view(-1, V), temperature, top_k, top_p).view(B, -1, V)
        if draft_probs is None:  # all of the draft's probability on its token
            draft_probs = torch.zeros(B, k, V, device=x.device).scatter_(2, chain[..., None], 1.0)
        n, next_token, node = accept_sampled(target_probs, draft_probs, chain, alternatives)
    if alternatives is None:
        return n, next_token, chain, states
    # the kept path through the scored tokens: cur, the kept drafts, and the alternative, if one was kept
    steps = torch.arange(k + 1, device=x.device)
    path = torch.where(steps == n[:, None], node[:, None], steps)  # (B, k + 1)
    if bool((node != n).any()):  # its keys and values go where its position is
        rows = torch.arange(B, device=x.device)
        move_cache_entries(model, pos[rows, node], pos[rows, n])
    return n, next_token, x.gather(1, path[:, 1:]), states.gather(1, path[..., None].expand(-1, -1, states.shape[2]))


@functools.cache
def draft_tree(k: int, m: int, device=None) -> Tensor:
    """The tokens a verify step scores with alternatives, as a tree (Transformer.blocks): the last
    token of the text (the root), the k drafts, each below the one before, then at each depth in turn
    the m alternatives to its draft, siblings of it. (N, N), N = 1 + k + k * m: [i, j] when token j
    is token i's ancestor or i itself."""
    parents = [0, *range(k), *(depth for depth in range(k) for _ in range(m))]
    tree = torch.eye(len(parents), dtype=torch.bool, device=device)
    for i in range(1, len(parents)):
        tree[i] |= tree[parents[i]]
    return tree


def accept_greedy(logits: Tensor, drafts: Tensor, alternatives: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Exact greedy: a draft stands while it is the target's argmax; where one falls, the alternative
    at its depth that is the argmax, if any, stands in its place and ends the row's drafts. logits
    (B, N, V) at cur, the drafts and the alternatives (draft_tree's order); drafts (B, k); alternatives
    (B, k, m). Returns the kept drafts n (B,), the target's token after them (B,) and the index into N
    of the last kept token (B,)."""
    best = logits.argmax(-1)  # (B, N): the target's choice after each scored token
    k = drafts.shape[1]
    n = (drafts == best[:, :k]).long().cumprod(1).sum(1)
    node = n
    if alternatives is not None:
        rows, m = torch.arange(len(n), device=n.device), alternatives.shape[2]
        hit = (alternatives[rows, n.clamp(max=k - 1)] == best[rows, n, None]) & (n < k)[:, None]  # (B, m)
        kept = hit.any(1)
        node = torch.where(kept, k + 1 + n * m + hit.long().argmax(1), n)
        n = n + kept.long()
    return n, best.gather(1, node[:, None])[:, 0], node


def accept_sampled(target_probs: Tensor, draft_probs: Tensor, drafts: Tensor, alternatives: Tensor | None = None
                   ) -> tuple[Tensor, Tensor, Tensor]:
    """Modified rejection sampling (Leviathan et al. 2023; Chen et al. 2023): accept draft i with
    probability min(1, p(d_i) / q(d_i)); at the first rejection, sample from normalize(max(0, p - q));
    if all k stand, a bonus token from the target's last distribution. The output is distributed
    exactly as the target's. target_probs (B, N, V) in draft_tree's order, draft_probs (B, k, V),
    drafts (B, k). Returns as accept_greedy does.

    With alternatives (B, k, m), the draw from the residual at the depth where a draft fell is itself
    made by rejection, each alternative a proposal of all its probability on one token: accepted with
    the residual's probability of it, else removed from the residual, which is renormalized. That
    draws from the residual exactly (the alternatives depend on nothing the target draws); when one
    stands, the next token comes from the target's distribution after it."""
    B, k = drafts.shape
    p = target_probs[:, :k].gather(2, drafts[..., None])[..., 0]  # (B, k)
    q = draft_probs.gather(2, drafts[..., None])[..., 0]
    u = 1 - torch.rand(B, k, device=drafts.device)  # in (0, 1]: u = 0 would accept what p gives 0
    accepted = (u * q <= p) & (p > 0)  # u <= p / q without dividing by a q that may be 0
    n = accepted.long().cumprod(1).sum(1)  # (B,)
    rows = torch.arange(B, device=drafts.device)
    p_n = target_probs[rows, n]  # (B, V): the target's distribution where the drafts stop
    q_n = torch.cat([draft_probs, torch.zeros_like(draft_probs[:, :1])], dim=1)[rows, n]  # zero after k: bonus
    residual = (p_n - q_n).clamp(min=0)
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_n)  # p == q leaves nothing: use p
    node = n
    if alternatives is not None:
        m = alternatives.shape[2]
        offered = alternatives[rows, n.clamp(max=k - 1)]  # (B, m): at the depth where the draft fell
        open_rows = n < k
        for i in range(m):
            a = offered[:, i : i + 1]
            take = open_rows & (torch.rand(B, device=drafts.device) < residual.gather(1, a)[:, 0])
            node = torch.where(take, k + 1 + n * m + i, node)
            open_rows &= ~take
            rest = residual.scatter(1, a, 0.0)
            residual = torch.where(open_rows[:, None], rest / rest.sum(-1, keepdim=True).clamp(min=1e-30), residual)
        kept = node != n
        residual = torch.where(kept[:, None], target_probs[rows, node], residual)
        n = n + kept.long()
    return n, decode.sample_from(residual)[:, 0], node  # a fresh draw, not the acceptance uniform


def acceptance_rate(stats: dict, k: int) -> float:
    """The share of drafted tokens the target agreed with, over all verify steps."""
    counts = stats["accepted_counts"]
    return sum(i * c for i, c in enumerate(counts)) / max(1, sum(counts) * k)


def format_stats(stats: dict, k: int) -> str:
    counts = stats["accepted_counts"]
    histogram = " ".join(f"{i}:{c}" for i, c in enumerate(counts))
    tree = f"{stats['alternatives_kept']} of them ending in an alternative, " if "alternatives_kept" in stats else ""
    return (f"acceptance rate {acceptance_rate(stats, k):.1%}, mean tokens per verify step "
            f"{stats['verify_tokens'] / max(1, sum(counts)):.2f}, accepted drafts per verify step [{histogram}], "
            f"{tree}{stats['plain_steps']} plain steps (the target's own, of one token, where the drafter "
            f"proposed nothing)")
