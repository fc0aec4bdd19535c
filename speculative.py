"""Speculative decoding: a cheap drafter proposes k tokens, the target checks all of them in one
forward, and the output is exactly the target's (token for token at temperature 0, the same
distribution when sampling). Any batch size: each row accepts its own number of tokens and moves
on at its own position in the static caches.

Drafters: a draft model sharing the target's vocabulary (a smaller model, or the target quantized
to int4), or prompt lookup (the continuation of the latest earlier occurrence of the last n-gram in
the text so far, no model). Use it through generate.generate(..., draft_model=...) or draft="prompt-lookup".
"""

import torch
from torch import Tensor

import generate as gen
from model import Transformer, UserError


def speculative_generate(model: Transformer, prompts: list[Tensor], max_new_tokens: int, *,
                         draft_model: Transformer | None = None, draft: str = "model", speculate_k: int = 5,
                         temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                         stop_ids: list[int] | None = None, stats: dict | None = None) -> list[Tensor]:
    """Each prompt followed by its new tokens, as generate.generate returns them. `stats`, if given,
    receives the counts of accepted drafts per row and round."""
    if draft == "model" and draft_model is None:
        raise UserError("speculative decoding needs a draft model or draft='prompt-lookup'")
    if draft_model is not None and draft_model.config.vocab_size != model.config.vocab_size:
        raise UserError(f"the draft model's vocabulary ({draft_model.config.vocab_size} tokens) is not the "
                        f"target's ({model.config.vocab_size}): they must share a tokenizer")
    if speculate_k < 1:
        raise UserError(f"speculate_k must be at least 1, got {speculate_k}")
    k, device = speculate_k, next(model.parameters()).device
    B = len(prompts)
    prompt_lengths = torch.tensor([len(p) for p in prompts], device=device)
    T = int(prompt_lengths.max())
    # room for the prompt and the new tokens, plus what a finished row's last rounds write past them
    cache_length = gen.padded_length(T + max_new_tokens + 2 * k + 1)
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    drafter = draft_model if draft == "model" else None
    for m in (model, drafter):
        if m is not None:
            m.setup_caches(max_batch_size=B, max_seq_length=cache_length)

    # tokens: every row's text so far, right-padded; lengths: how much of each row is text
    tokens = torch.zeros(B, cache_length, dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p.to(device)
    positions = torch.arange(T, device=device)
    cur = gen.prefill(model, tokens[:, :T], positions, prompt_lengths - 1, **sampling).clone()  # (B, 1)
    if drafter is not None:
        gen.prefill(drafter, tokens[:, :T], positions, prompt_lengths - 1, **sampling)
    rows = torch.arange(B, device=device)
    tokens[rows, prompt_lengths] = cur[:, 0]
    lengths = prompt_lengths + 1  # cur is text, not yet in the target's cache
    limit = prompt_lengths + max_new_tokens
    stops = torch.tensor(stop_ids or [], device=device)
    done = torch.isin(cur[:, 0], stops) | (lengths >= limit)
    accepted_counts = torch.zeros(k + 1, dtype=torch.long, device=device)
    offsets = torch.arange(k + 1, device=device)
    backoff = skip = plain_steps = 0  # prompt lookup's back-off: plain steps to take before drafting again

    while not done.all():  # one host sync a round, not a token
        if drafter is not None:
            drafts, draft_probs = draft_with_model(drafter, tokens, lengths, k, **sampling)
        elif skip == 0:
            drafts, found = prompt_lookup(tokens, lengths, k)
            draft_probs = None  # one-hot: all of the draft's probability on its token
            if not found.any():  # nothing to propose: a plain step costs less than verifying k guesses
                drafts = None
        else:
            drafts, skip = None, skip - 1
        if drafts is None:
            n = torch.zeros_like(lengths)
            next_token = gen.decode_one_token(model, cur, (lengths - 1)[:, None], **sampling).clone()[:, 0]
            drafts = cur.expand(-1, k)  # placeholders, none kept
            plain_steps += 1
        else:
            n, next_token = verify(model, cur, drafts, draft_probs, lengths, **sampling)
            accepted_counts.scatter_add_(0, n, (~done).long())
            if drafter is None:
                # a verify step costs about two plain ones on CPU: when no row kept two drafts, back off
                # for 2, 8, 32, then every 64 steps, so that open-ended text runs at plain decoding's speed
                backoff = min(4 * backoff or 2, 64) if (n < 2).all() else 0
                skip = backoff
        # the row's accepted drafts, then the target's own token; what lies beyond is overwritten later
        emitted = torch.cat([drafts, drafts[:, :1]], dim=1).scatter(1, n[:, None], next_token[:, None])
        n = torch.where(done, -1, n)  # finished rows stand still
        written = offsets <= n[:, None]
        index = (lengths[:, None] + offsets).clamp(max=cache_length - 1)
        tokens.scatter_(1, index, torch.where(written, emitted, tokens.gather(1, index)))
        done |= (torch.isin(emitted, stops) & written).any(1)
        cur = torch.where(done[:, None], cur, next_token[:, None])
        lengths = lengths + n + 1
        done |= lengths >= limit

    if stats is not None:  # verify rounds in which 0, 1, ..., k drafts were accepted; steps without drafts
        stats.update(accepted_counts=accepted_counts.tolist(), plain_steps=plain_steps)
    ends = torch.minimum(lengths, limit).tolist()
    return [torch.cat([p.cpu(), gen.until_stop(row[len(p): end], stop_ids)])
            for p, row, end in zip(prompts, tokens.cpu(), ends)]


def draft_with_model(drafter: Transformer, tokens: Tensor, lengths: Tensor, k: int, **sampling
                     ) -> tuple[Tensor, Tensor | None]:
    """k draft tokens (B, k) and, when sampling, the drafter's probabilities for them (B, k, V).
    The first step feeds the last two tokens of the text: the one before cur may not be in the
    drafter's cache yet (when the previous round accepted every draft); feeding it again when it is
    rewrites the same entry."""
    rows = torch.arange(tokens.shape[0], device=tokens.device)
    pos = torch.stack([lengths - 2, lengths - 1], dim=1)  # (B, 2)
    x = tokens[rows[:, None], pos]
    drafts, probs = [], []
    for i in range(k):
        logits = draft_step(drafter, x, pos)  # (B, V)
        if sampling["temperature"] == 0:
            x = logits.argmax(-1, keepdim=True)
        else:
            q = gen.logits_to_probs(logits, **sampling)
            x = gen.sample_from(q)
            probs.append(q)
        drafts.append(x)
        pos = pos[:, -1:] + 1
    return torch.cat(drafts, dim=1), torch.stack(probs, dim=1) if probs else None


def draft_step(drafter: Transformer, x: Tensor, pos: Tensor) -> Tensor:
    """x: (B, T) at positions pos (B, T) -> the drafter's logits for the next token (B, V)."""
    return drafter(x, pos)[:, -1].clone()  # clone: CUDA graphs reuse their output buffers


def prompt_lookup(tokens: Tensor, lengths: Tensor, k: int, max_ngram: int = 3, min_ngram: int = 2
                  ) -> tuple[Tensor, Tensor]:
    """Drafts from the text itself: for each row, find the latest earlier occurrence of its last
    n-gram (longest n first) and propose the k tokens that followed it. On the device, with no host
    sync. Returns the drafts (B, k) and which rows found a match (B,); the others propose their last
    token again, for verification to reject."""
    B, L = tokens.shape
    rows = torch.arange(B, device=tokens.device)[:, None]
    drafts = tokens[rows, (lengths[:, None] - 1)].expand(B, k)
    found = torch.zeros(B, dtype=torch.bool, device=tokens.device)
    for n in range(max_ngram, min_ngram - 1, -1):
        last = tokens[rows, (lengths[:, None] - n + torch.arange(n, device=tokens.device)).clamp(min=0)]  # (B, n)
        starts = torch.arange(L - n + 1, device=tokens.device)
        match = (tokens.unfold(1, n, 1) == last[:, None, :]).all(-1)  # (B, L - n + 1): n-gram at each start
        match &= starts < (lengths - n)[:, None]  # strictly before the last n-gram itself
        latest = torch.where(match, starts, -1).amax(1)  # (B,), -1 where none
        follow = tokens[rows, (latest[:, None] + n + torch.arange(k, device=tokens.device)).clamp(max=L - 1)]
        use = (latest >= 0) & ~found
        drafts = torch.where(use[:, None], follow, drafts)
        found |= use
    return drafts, found


def verify(model: Transformer, cur: Tensor, drafts: Tensor, draft_probs: Tensor | None, lengths: Tensor,
           temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None) -> tuple[Tensor, Tensor]:
    """Score cur and the k drafts in one forward of the target, writing them into its cache.
    Returns each row's number of accepted drafts n (B,) and the token that follows them (B,)."""
    k = drafts.shape[1]
    x = torch.cat([cur, drafts], dim=1)  # (B, k + 1)
    pos = (lengths - 1)[:, None] + torch.arange(k + 1, device=x.device)
    logits = target_step(model, x, pos)  # (B, k + 1, V)
    if temperature == 0:
        return accept_greedy(logits, drafts)
    B, _, V = logits.shape
    target_probs = gen.logits_to_probs(logits.view(-1, V), temperature, top_k, top_p).view(B, k + 1, V)
    if draft_probs is None:  # prompt lookup: all of the draft's probability on its token
        draft_probs = torch.zeros(B, k, V, device=x.device).scatter_(2, drafts[..., None], 1.0)
    return accept_sampled(target_probs, draft_probs, drafts)


def target_step(model: Transformer, x: Tensor, pos: Tensor) -> Tensor:
    return model(x, pos).clone()


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
    return n, gen.sample_from(residual)[:, 0]  # a fresh draw, not the acceptance uniform


def compile_functions():
    """Compile the drafter's step and the target's verify step, each with fixed shapes (CUDA graphs
    on GPU)."""
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
