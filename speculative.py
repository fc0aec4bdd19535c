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
drafter subclasses `Drafter`; the loop in
`speculative_generate` knows none of their details. Use it through
`generate.generate(..., drafter=DraftModel(small_model))`.
"""

import dataclasses
import json
from pathlib import Path

import torch
import torch.nn as nn
from torch import Tensor

import decode
from checkpoint import read_safetensors, single, write_safetensors
from errors import UserError
from model import PREFILL_CHUNK, ModelArgs, Transformer, rows_at


class Drafter:
    """Proposes draft tokens for speculative decoding. tokens (B, L) hold each row's text so far,
    right-padded; lengths (B,) how much of each row is text. A drafter that reads the target's
    hidden states (`reads_states`) gets those of the prompt in `start` and those of each verify step
    in `accepted`; it must then always propose, as the target's plain steps keep theirs to themselves."""

    reads_states = False

    def start(self, target: Transformer, tokens: Tensor, prompt_lengths: Tensor, cache_length: int,
              states: Tensor | None = None, **sampling):
        """Called once per generate() call, after the target's prefill: tokens hold the prompts, and the
        first new token after each; states (B, T, dim), if read, the target's last layer at each prompt
        position."""

    def propose(self, tokens: Tensor, lengths: Tensor, k: int, **sampling) -> tuple[Tensor, Tensor | None] | None:
        """k drafts a row (B, k) and, when sampling, the drafter's probabilities for them (B, k, V), or
        None for drafts it is sure of (all of their probability on the token). None instead of a pair:
        no proposal this round, the target takes a plain step."""
        raise NotImplementedError

    def accepted(self, n: Tensor, active: Tensor, states: Tensor):
        """What the target kept of the last proposal: n (B,) drafts per row; active (B,) the rows still
        generating; states (B, k + 1, dim) the target's last layer at the positions it verified."""


class DraftModel(Drafter):
    """A draft model with its own static cache, decoding k tokens a round."""

    def __init__(self, model: Transformer):
        self.model = model

    def start(self, target, tokens, prompt_lengths, cache_length, states=None, **sampling):
        if self.model.config.vocab_size != target.config.vocab_size:
            raise UserError(f"the draft model's vocabulary ({self.model.config.vocab_size} tokens) is not the "
                            f"target's ({target.config.vocab_size}): they must share a tokenizer")
        self.model.setup_caches(tokens.shape[0], cache_length, target.chunk, target.kv_cache_dtype)
        self.last_position = cache_length - 1
        T = int(prompt_lengths.max())
        decode.prefill(self.model, tokens[:, :T], prompt_lengths, **sampling)

    def propose(self, tokens, lengths, k, **sampling):
        """The first step feeds the last two tokens of the text: the one before the last may not be in
        the drafter's cache yet (when the previous round accepted every draft); feeding it again when
        it is rewrites the same entry. Positions past the cache are clamped to its last slot: they
        only ever hold drafts beyond the requested length, which are discarded."""
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        pos = torch.stack([lengths - 2, lengths - 1], dim=1)  # (B, 2)
        x = tokens[rows[:, None], pos]
        keys = decode.key_positions(self.model, int(lengths.max()) + k)  # the last draft's position + 1
        drafts, probs = [], []
        for _ in range(k):
            logits = draft_step(self.model, x, pos.clamp(max=self.last_position), keys)  # (B, V)
            if sampling["temperature"] == 0:
                x = logits.argmax(-1, keepdim=True)
            else:
                q = decode.logits_to_probs(logits, **sampling)
                x = decode.sample_from(q)
                probs.append(q)
            drafts.append(x)
            pos = pos[:, -1:] + 1
        return torch.cat(drafts, dim=1), torch.stack(probs, dim=1) if probs else None


class PromptLookup(Drafter):
    """Drafts from the text itself (no model): the tokens that followed the latest earlier occurrence
    of the last n-gram. On text that does not repeat itself it must cost next to nothing, so it lets
    the target take plain steps for a while when it finds nothing (1, 2, ... up to 8 steps, as the
    misses run on: a search costs ~3% of a plain step on a 2-core CPU) and when no row keeps two
    drafts (one, when k is 1) of a proposal (2, 8, 32, then every 64 rounds: a rejected verify step
    costs more than a plain one)."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def start(self, target, tokens, prompt_lengths, cache_length, states=None, **sampling):
        self.backoff = self.skip = 0  # plain steps to take before drafting again
        self.misses = 0  # searches in a row that found nothing

    def propose(self, tokens, lengths, k, **sampling):
        if self.skip > 0:
            self.skip -= 1
            return None
        self.k = k
        drafts, found = prompt_lookup(tokens, lengths, k, self.max_ngram, self.min_ngram)
        if not found.any():
            self.misses += 1
            self.skip = min(self.misses, 8)
            return None
        self.misses = 0
        return drafts, None

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


def load_head(path: Path, target: Transformer) -> DraftHead:
    """The head at path, in the target's dtype on its device; one line saying what to run when it is
    missing or belongs to another model."""
    path = Path(path)
    train = "train one: python scripts/train_draft_head.py --checkpoint_path <the target's checkpoint>"
    if not path.is_file():
        raise UserError(f"no draft head at {path}: {train}")
    weight = target.tok_embeddings.weight
    tensors, metadata = read_safetensors(path, weight.device, weight.dtype)
    if "draft_head" not in metadata:
        raise UserError(f"{path} is not a draft head: {train}")
    trained_for = json.loads(metadata["target"])
    mine = dict(vocab_size=target.config.vocab_size, dim=target.config.dim)
    if trained_for != mine:
        raise UserError(f"the draft head {path} was trained for a model with {trained_for}, not this one's "
                        f"{mine}: {train}")
    head = DraftHead(ModelArgs(**json.loads(metadata["draft_head"])), tensors["vocab"])
    head.load_state_dict(tensors, assign=True)
    return head.eval()


class HeadDrafter(Drafter):
    """Drafts with a DraftHead: one head step a token, no layer of the target. After each verify
    step, one head forward over its k + 1 positions writes what the target saw there (its states, the
    accepted tokens) into the head's cache, and its output at each row's last text position gives the
    first draft; k - 1 single steps, each fed the head's own predicted state, give the rest."""

    reads_states = True

    def __init__(self, head: DraftHead):
        self.head = head

    def start(self, target, tokens, prompt_lengths, cache_length, states=None, **sampling):
        if self.head.config.dim != target.config.dim or int(self.head.vocab.max()) >= target.config.vocab_size:
            raise UserError("the draft head does not fit the target (its width or vocabulary differs): train one "
                            "for it with scripts/train_draft_head.py")
        self.target = target
        self.head.setup_caches(tokens.shape[0], cache_length, target.chunk)
        self.last_position = cache_length - 1
        # the prompt: position i reads the target's state at i - 1 and token i (the first new one at the end)
        B, T, _ = states.shape
        positions = torch.arange(1, T + 1, device=tokens.device).expand(B, -1)
        for start in range(0, T, self.head.chunk):
            end = min(start + self.head.chunk, T)
            last = (prompt_lengths - 1 - start).clamp(0, end - start - 1)
            logits, state = self.head(target, tokens[:, start + 1: end + 1], states[:, start:end],  # eager: any length
                                      positions[:, start:end], decode.key_positions(self.head, end + 1), last)
            mine = ((prompt_lengths - 1 >= start) & (prompt_lengths - 1 < end)).view(-1, 1, 1)
            self.next = (logits, state) if start == 0 else tuple(torch.where(mine, new, old) for new, old in
                                                                 zip((logits, state), self.next))
        self.verified = None

    def propose(self, tokens, lengths, k, **sampling):
        if self.verified is not None:  # the last verify step's positions, as the target saw them
            states, first = self.verified  # (B, k + 1, dim); first (B,): the position of their first state + 1
            offsets = torch.arange(states.shape[1], device=tokens.device)
            pos = (first[:, None] + offsets).clamp(max=self.last_position)
            rows = torch.arange(tokens.shape[0], device=tokens.device)[:, None]
            last = (lengths - 1 - first).clamp(0, states.shape[1] - 1)  # each row's last text position
            keys = decode.key_positions(self.head, int(first.max()) + states.shape[1])
            self.next = head_step(self.head, self.target, tokens[rows, first[:, None] + offsets], states, pos, keys, last)
        logits, state = self.next
        keys = decode.key_positions(self.head, int(lengths.max()) + k)
        drafts, probs = [], []
        for i in range(k):
            if i > 0:
                pos = (lengths + i - 1)[:, None].clamp(max=self.last_position)
                logits, state = head_step(self.head, self.target, drafts[-1], state, pos, keys)
            if sampling["temperature"] == 0:
                drafts.append(self.head.vocab[logits[:, -1].argmax(-1, keepdim=True)])
            else:
                q = decode.logits_to_probs(logits[:, -1], **sampling)  # (B, N)
                choice = decode.sample_from(q)
                drafts.append(self.head.vocab[choice])
                probs.append(torch.zeros(q.shape[0], self.target.config.vocab_size, device=q.device)
                             .scatter_(1, self.head.vocab.expand(q.shape[0], -1), q))
        self.lengths = lengths
        return torch.cat(drafts, dim=1), torch.stack(probs, dim=1) if probs else None

    def accepted(self, n, active, states):
        self.verified = states, self.lengths  # verified at positions lengths - 1 ...: the head's at lengths ...


def head_step(head: DraftHead, target: Transformer, tokens: Tensor, states: Tensor, pos: Tensor, keys: Tensor,
              last: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """DraftHead.forward, cloned: CUDA graphs reuse their output buffers."""
    logits, state = head(target, tokens, states, pos, keys, last)
    return logits.clone(), state.clone()


def speculative_generate(model: Transformer, prompts: list[Tensor], max_new_tokens: int, drafter: Drafter, *,
                         speculate_k: int = 5, temperature: float = 0.0, top_k: int | None = None,
                         top_p: float | None = None, stop_ids: list[int] | None = None, callback=None,
                         stats: dict | None = None, prefill_chunk: int = PREFILL_CHUNK,
                         kv_cache_dtype: torch.dtype | None = None) -> list[Tensor]:
    """Each prompt followed by its new tokens, as generate.generate returns them. `stats`, if given,
    receives the counts of accepted drafts per row and round."""
    if not isinstance(drafter, Drafter):
        raise UserError(f"drafter must be a speculative.Drafter (DraftModel, PromptLookup), not {drafter!r}")
    if speculate_k < 1:
        raise UserError(f"speculate_k must be at least 1, got {speculate_k}")
    k, device = speculate_k, next(model.parameters()).device
    B = len(prompts)
    prompt_lengths = torch.tensor([len(p) for p in prompts], device=device)
    T = int(prompt_lengths.max())
    # the plain cache: a verify step's positions past it are clamped to its last slot, since they
    # only ever hold drafts beyond the requested length
    cache_length = decode.padded_length(T + max_new_tokens, model.config.block_size)
    if speculate_k >= prefill_chunk:  # a sliding-window ring keeps the positions of one verify step and no more
        raise UserError(f"speculate_k ({speculate_k}) must be less than prefill_chunk ({prefill_chunk})")
    model.setup_caches(B, cache_length, prefill_chunk, kv_cache_dtype)
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p)

    # tokens: every row's text so far, right-padded, with room for a round's k + 1 tokens past the
    # cache; lengths: how much of each row is text
    tokens = torch.zeros(B, cache_length + k + 1, dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p.to(device)
    if drafter.reads_states:
        logits, states = decode.prefill_logits(model, tokens[:, :T], prompt_lengths, states=True)
    else:
        logits, states = decode.prefill_logits(model, tokens[:, :T], prompt_lengths), None
    cur = decode.sample(logits[:, 0], **sampling)  # (B, 1)
    rows = torch.arange(B, device=device)
    tokens[rows, prompt_lengths] = cur[:, 0]
    drafter.start(model, tokens, prompt_lengths, cache_length, states, **sampling)
    lengths = prompt_lengths + 1  # cur is text, not yet in the target's cache
    limit = prompt_lengths + max_new_tokens
    stops = torch.tensor(stop_ids or [], device=device)
    done = torch.isin(cur[:, 0], stops) | (lengths >= limit)
    if callback:
        decode.stream(callback, cur, torch.ones_like(cur, dtype=torch.bool))
    accepted_counts = torch.zeros(k + 1, dtype=torch.long, device=device)
    offsets = torch.arange(k + 1, device=device)
    plain_steps = 0

    while not done.all():  # host syncs a round, not a token
        keys = decode.key_positions(model, int(lengths.max()) + k)  # a verify step's last position + 1
        proposal = drafter.propose(tokens, lengths, k, **sampling)
        if proposal is None:
            n = torch.zeros_like(lengths)
            next_token = decode.decode_one_token(model, cur, (lengths - 1)[:, None], keys, **sampling).clone()[:, 0]
            drafts = cur.expand(-1, k)  # placeholders, none kept
            plain_steps += 1
        else:
            drafts, draft_probs = proposal
            n, next_token, states = verify(model, cur, drafts, draft_probs, lengths, cache_length, keys, **sampling)
            accepted_counts.scatter_add_(0, n, (~done).long())
            drafter.accepted(n, ~done, states)
        # the row's accepted drafts, then the target's own token; what lies beyond is overwritten later
        emitted = torch.cat([drafts, drafts[:, :1]], dim=1).scatter(1, n[:, None], next_token[:, None])
        n = torch.where(done, -1, n)  # finished rows stand still
        position = lengths[:, None] + offsets  # (B, k + 1): where each emitted token goes
        written = (offsets <= n[:, None]) & (position < limit[:, None])  # nothing past the requested length
        tokens.scatter_(1, position, torch.where(written, emitted, tokens.gather(1, position)))
        stopped = torch.isin(emitted, stops) & written
        if callback:  # the row's text: written, up to and including a stop token
            decode.stream(callback, emitted, written & (stopped.cumsum(1) - stopped.long() == 0))
        done |= stopped.any(1)
        cur = torch.where(done[:, None], cur, next_token[:, None])
        lengths = torch.minimum(lengths + n + 1, limit)
        done |= lengths == limit

    if stats is not None:  # verify rounds in which 0, 1, ..., k drafts were accepted; steps without drafts
        stats.update(accepted_counts=accepted_counts.tolist(), plain_steps=plain_steps)
    return [torch.cat([p.cpu(), decode.until_stop(row[len(p): end], stop_ids)])
            for p, row, end in zip(prompts, tokens.cpu(), lengths.tolist())]


def draft_step(drafter: Transformer, x: Tensor, pos: Tensor, keys: Tensor) -> Tensor:
    """x: (B, T) at positions pos (B, T) -> the drafter's logits for the next token (B, V)."""
    return drafter(x, pos, key_positions=keys)[:, -1].clone()  # clone: CUDA graphs reuse their output buffers


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
           cache_length: int, keys: Tensor, temperature: float = 0.0, top_k: int | None = None,
           top_p: float | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Score cur and the k drafts in one forward of the target, writing them into its cache; keys:
    decode.key_positions() above all of their positions. Returns each row's number of accepted
    drafts n (B,), the token that follows them (B,), and the target's last-layer states (B, k + 1, dim)."""
    k = drafts.shape[1]
    x = torch.cat([cur, drafts], dim=1)  # (B, k + 1)
    pos = ((lengths - 1)[:, None] + torch.arange(k + 1, device=x.device)).clamp(max=cache_length - 1)
    logits, states = target_step(model, x, pos, keys)  # (B, k + 1, V), (B, k + 1, dim)
    if temperature == 0:
        return *accept_greedy(logits, drafts), states
    B, _, V = logits.shape
    target_probs = decode.logits_to_probs(logits.view(-1, V), temperature, top_k, top_p).view(B, k + 1, V)
    if draft_probs is None:  # all of the draft's probability on its token
        draft_probs = torch.zeros(B, k, V, device=x.device).scatter_(2, drafts[..., None], 1.0)
    return *accept_sampled(target_probs, draft_probs, drafts), states


def target_step(model: Transformer, x: Tensor, pos: Tensor, keys: Tensor) -> tuple[Tensor, Tensor]:
    """The target's logits (B, T, V) and last-layer states (B, T, dim) for x (B, T) at pos (B, T)."""
    states = model.hidden_states(x, pos, keys)
    return model.logits(states).clone(), states.clone()  # clone: CUDA graphs reuse their output buffers


def accept_greedy(logits: Tensor, drafts: Tensor) -> tuple[Tensor, Tensor]:
    """Exact greedy: a draft stands while it is the target's argmax. logits (B, k + 1, V), drafts (B, k)."""
    best = logits.argmax(-1)  # (B, k + 1): the target's choice after cur, d1, ..., dk
    n = (drafts == best[:, :-1]).long().cumprod(1).sum(1)
    return n, best.gather(1, n[:, None])[:, 0]


def accept_sampled(target_probs: Tensor, draft_probs: Tensor, drafts: Tensor) -> tuple[Tensor, Tensor]:
    """Modified rejection sampling (Leviathan et al. 2023; Chen et al. 2023): accept draft i with
    probability min(1, p(d_i) / q(d_i)); at the first rejection, sample from normalize(max(0, p - q));
    if all k stand, a bonus token from the target's last distribution. The output is distributed
    exactly as the target's. target_probs (B, k + 1, V), draft_probs (B, k, V), drafts (B, k)."""
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
    return n, decode.sample_from(residual)[:, 0]  # a fresh draw, not the acceptance uniform


def compile_steps():
    """Compile the draft model's step and the target's verify step, each with fixed shapes (CUDA
    graphs on GPU)."""
    global draft_step, target_step, head_step
    draft_step = torch.compile(draft_step, mode="reduce-overhead", fullgraph=True, dynamic=False)
    head_step = torch.compile(head_step, mode="reduce-overhead", fullgraph=True, dynamic=False)
    target_step = torch.compile(target_step, mode="reduce-overhead", fullgraph=True, dynamic=False)


def acceptance_rate(stats: dict, k: int) -> float:
    """The share of drafted tokens kept, over all verify steps."""
    counts = stats["accepted_counts"]
    return sum(i * c for i, c in enumerate(counts)) / max(1, sum(counts) * k)


def format_stats(stats: dict, k: int) -> str:
    counts = stats["accepted_counts"]
    rounds = sum(counts)
    accepted = sum(i * c for i, c in enumerate(counts))
    histogram = " ".join(f"{i}:{c}" for i, c in enumerate(counts))
    return (f"acceptance rate {acceptance_rate(stats, k):.1%}, mean tokens per verify step "
            f"{(accepted + rounds) / max(1, rounds):.2f}, accepted drafts per verify step [{histogram}], "
            f"{stats['plain_steps']} plain steps")
