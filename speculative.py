"""Speculative decoding: a cheap drafter proposes k tokens, the target checks all of them in one
forward, and the output is the target's own: in fp32, greedy decoding gives exactly plain greedy
decoding's tokens and sampling draws from exactly the target's distribution. (In bf16 a verify step
scores k + 1 tokens at once, which rounds differently from scoring them one by one: the logits agree
up to rounding, so a near-tie can resolve the other way.) Any batch size: each row accepts its own
number of tokens and moves on at its own position in the static caches.

A drafter is one object with one job: given the text so far, propose k tokens (and, when sampling,
its probabilities for them). Three are here: `DraftModel` (a smaller model sharing the target's
vocabulary, or the target quantized to int4), and `PromptLookup` (the continuation of the latest
earlier occurrence of the last n-gram, no model). A new drafter subclasses `Drafter`; the loop in
`speculative_generate` knows none of their details. Use it through
`generate.generate(..., drafter=DraftModel(small_model))`.
"""

import torch
from torch import Tensor

import decode
from errors import UserError
from model import PREFILL_CHUNK, Transformer


class Drafter:
    """Proposes draft tokens for speculative decoding. tokens (B, L) hold each row's text so far,
    right-padded; lengths (B,) how much of each row is text."""

    def start(self, target: Transformer, tokens: Tensor, prompt_lengths: Tensor, cache_length: int, **sampling):
        """Called once per generate() call, after the target's prefill: tokens hold the prompts."""

    def propose(self, tokens: Tensor, lengths: Tensor, k: int, **sampling) -> tuple[Tensor, Tensor | None] | None:
        """k drafts a row (B, k) and, when sampling, the drafter's probabilities for them (B, k, V), or
        None for drafts it is sure of (all of their probability on the token). None instead of a pair:
        no proposal this round, the target takes a plain step."""
        raise NotImplementedError

    def accepted(self, n: Tensor, active: Tensor):
        """What the target kept of the last proposal: n (B,) drafts per row; active (B,) the rows still
        generating."""


class DraftModel(Drafter):
    """A draft model with its own static cache, decoding k tokens a round."""

    def __init__(self, model: Transformer):
        self.model = model

    def start(self, target, tokens, prompt_lengths, cache_length, **sampling):
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
    of the last n-gram. When it finds nothing, or no row keeps two drafts (one, when k is 1), it
    backs off (2, 8, 32, then every 64 rounds) and lets the target take plain steps: a verify step
    costs more than a plain one, so on text that does not repeat itself it must cost next to nothing."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def start(self, target, tokens, prompt_lengths, cache_length, **sampling):
        self.backoff = self.skip = 0  # plain steps to take before drafting again

    def propose(self, tokens, lengths, k, **sampling):
        if self.skip > 0:
            self.skip -= 1
            return None
        self.k = k
        drafts, found = prompt_lookup(tokens, lengths, k, self.max_ngram, self.min_ngram)
        return (drafts, None) if found.any() else None

    def accepted(self, n, active):
        kept_enough = (n >= min(2, self.k)) & active  # two drafts, or the only one there was
        self.backoff = 0 if kept_enough.any() else min(4 * self.backoff or 2, 64)
        self.skip = self.backoff


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
    cur = decode.prefill(model, tokens[:, :T], prompt_lengths, **sampling).clone()  # (B, 1)
    drafter.start(model, tokens, prompt_lengths, cache_length, **sampling)
    rows = torch.arange(B, device=device)
    tokens[rows, prompt_lengths] = cur[:, 0]
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
            n, next_token = verify(model, cur, drafts, draft_probs, lengths, cache_length, keys, **sampling)
            accepted_counts.scatter_add_(0, n, (~done).long())
            drafter.accepted(n, ~done)
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
           top_p: float | None = None) -> tuple[Tensor, Tensor]:
    """Score cur and the k drafts in one forward of the target, writing them into its cache; keys:
    decode.key_positions() above all of their positions. Returns each row's number of accepted
    drafts n (B,) and the token that follows them (B,)."""
    k = drafts.shape[1]
    x = torch.cat([cur, drafts], dim=1)  # (B, k + 1)
    pos = ((lengths - 1)[:, None] + torch.arange(k + 1, device=x.device)).clamp(max=cache_length - 1)
    logits = target_step(model, x, pos, keys)  # (B, k + 1, V)
    if temperature == 0:
        return accept_greedy(logits, drafts)
    B, _, V = logits.shape
    target_probs = decode.logits_to_probs(logits.view(-1, V), temperature, top_k, top_p).view(B, k + 1, V)
    if draft_probs is None:  # all of the draft's probability on its token
        draft_probs = torch.zeros(B, k, V, device=x.device).scatter_(2, drafts[..., None], 1.0)
    return accept_sampled(target_probs, draft_probs, drafts)


def target_step(model: Transformer, x: Tensor, pos: Tensor, keys: Tensor) -> Tensor:
    return model(x, pos, key_positions=keys).clone()


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
    global draft_step, target_step
    draft_step = torch.compile(draft_step, mode="reduce-overhead", fullgraph=True, dynamic=False)
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
