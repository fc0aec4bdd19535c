"""The steps of decoding, shared by generate.py and speculative.py: from logits to tokens (sampling),
prefill, the one-token step, and the cache length both size their caches by.

The forwards decoding runs (the one-token step, prefill's forward of one chunk, and speculative
decoding's verify, draft-model and draft-head steps) travel together as a `Steps` value that callers
hold and pass down: `EAGER`, the plain functions here, or `generate.compiled_steps()`. Nothing here
is ever rebound, so what runs is what the caller passed.
"""

import dataclasses
from collections.abc import Callable

import torch
from torch import Tensor

from .model import Transformer, rows_at

# a forward reads the caches' slots in blocks of this many: those below its last position, rounded up
KV_BLOCK = 256
# ... and on a CPU in finer ones: its compiled code takes the length as a symbol, with no CUDA graph per
# block count to keep few, so a short text's steps read less (benchmarks/RESULTS.md, "Finer key blocks
# on a CPU")
CPU_KV_BLOCK = 32


def logits_to_probs(logits: Tensor, temperature: float = 1.0, top_k: int | None = None,
                    top_p: float | None = None) -> Tensor:
    """logits: (B, V) -> probabilities (B, V) after temperature, top-k and nucleus (top-p) filtering.
    Temperature 0 puts all the mass on the argmax; a tiny one is as good as greedy (no clamp that
    would flatten near-ties). top_p keeps the smallest set of top tokens whose mass reaches it, and
    always the top token (so top_p=0 is greedy too)."""
    logits = logits.float()
    if temperature == 0:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    # the max is subtracted first, so that dividing by a tiny temperature cannot overflow to inf - inf
    logits = (logits - logits.amax(-1, keepdim=True)) / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -float("inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already reach top_p; the top one always stays
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p
        drop[:, 0] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), -float("inf"))
    return logits.softmax(-1)


def sample(logits: Tensor, temperature: float = 0.0, top_k: int | None = None,
           top_p: float | None = None) -> Tensor:
    """logits: (B, V) -> next tokens (B, 1). Temperature 0 is exact argmax."""
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    return sample_from(logits_to_probs(logits, temperature, top_k, top_p))


def sample_from(probs: Tensor) -> Tensor:
    """probs: (B, V) -> one draw per row (B, 1). argmax(p / Exp(1)) is a draw from p, without the
    host sync of torch.multinomial. A token of probability 0 scores 0 whatever the draw (a draw of
    exactly 0 is raised to the smallest positive float: 0 / 0 would be NaN), and every other token
    scores more, so a filtered token is never drawn."""
    exponential = torch.empty_like(probs).exponential_(1).clamp_(min=torch.finfo(probs.dtype).tiny)
    return (probs / exponential).argmax(-1, keepdim=True)


def prefill(model: Transformer, idx: Tensor, lengths: Tensor, steps: "Steps", **sampling) -> Tensor:
    """idx: (B, T) right-padded prompts of lengths (B,). Fills the cache and returns the first new token
    of each row, (B, 1)."""
    return sample(prefill_logits(model, idx, lengths, steps)[:, 0], **sampling)


def prefill_logits(model: Transformer, idx: Tensor, lengths: Tensor, steps: "Steps", states: bool = False,
                   first: int = 0, start: int = 0):
    """Fill the cache's rows first .. first + B - 1 with the prompts, `model.chunk` positions a forward
    (steps.prefill_chunk), so that activation memory is bounded by the chunk whatever the prompt's length,
    and compiled prefill sees a few shapes only; from position start on, where the rows hold the positions
    before it already. Returns the logits of each row's last prompt position, (B, 1, V); with states, also
    the last layer's output at every position (B, T, dim), for a drafter that reads them, or a server's
    prompt logprobs.
    A prompt of one token is run by the plain prefill_chunk whatever steps holds: compiled prefill
    specializes a dimension of size 1, and would compile a graph for that length alone."""
    T = idx.shape[1]
    positions = prompt_positions(lengths, T, model.chunk) + start
    forward = steps.prefill_chunk if T > 1 else prefill_chunk
    logits, hidden = None, []
    for begin, end, in_chunk_last, holds_last in prompt_chunks(lengths - 1, T, model.chunk):
        # copies with strides of their own (a slice keeps the whole row's), so that compiled prefill
        # sees the same strides in every chunk: one graph. The chunk reads the slots below its end (a
        # row's padding, at positions past it, then sees fewer keys than it would: its output is unused)
        ids, pos = (t[:, begin:end].clone(memory_format=torch.contiguous_format) for t in (idx, positions))
        keys = key_positions(model, start + end, idx.shape[0])
        chunk_logits, chunk_states = forward(model, ids, pos, in_chunk_last, keys, first)
        logits = kept(holds_last, chunk_logits, logits)
        if states:
            hidden.append(chunk_states)
    return (logits, torch.cat(hidden, dim=1)) if states else logits


def prompt_chunks(last: Tensor, T: int, chunk: int):
    """The forwards of a prefill of T positions (chunk_bounds), and what each row keeps of them, its last
    position being last (B,): (start, end, the index of that position in the chunk, clamped into it (B,),
    and whether the chunk holds it (B, 1, 1)). A row's output is kept from the chunk that holds it."""
    for start, end in chunk_bounds(T, chunk):
        yield start, end, (last - start).clamp(0, end - start - 1), ((last >= start) & (last < end)).view(-1, 1, 1)


def kept(holds_last: Tensor, new: Tensor, old: Tensor | None) -> Tensor:
    """The rows whose last position a chunk holds (prompt_chunks) from its output new, the others from old."""
    return new if old is None else torch.where(holds_last, new, old)


def right_padded(prompts: list[Tensor], width: int, device) -> Tensor:
    """The prompts as the rows of one (B, width) tensor, each from position 0, zeros after it."""
    tokens = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p.to(device)
    return tokens


def chunk_bounds(T: int, chunk: int) -> list[tuple[int, int]]:
    """(start, end) of prefill's forwards over T positions, at most `chunk` each. A last chunk of one
    position takes two instead, one from the chunk before it (where that leaves it more than one), for
    the reason prefill_logits runs a one-token prompt uncompiled."""
    starts = list(range(0, T, chunk))
    if len(starts) > 1 and T - starts[-1] == 1 and chunk > 2:
        starts[-1] -= 1
    return list(zip(starts, [*starts[1:], T]))


def prefill_chunk(model: Transformer, idx: Tensor, input_pos: Tensor, last: Tensor, keys: Tensor, first: int = 0
                  ) -> tuple[Tensor, Tensor]:
    """One forward of prefill: idx, input_pos (B, t) into the cache's rows from `first`; the logits at each
    row's position `last` (B,), (B, 1, V), and the last layer's output (B, t, dim). keys: key_positions()."""
    x = model.hidden_states(idx, input_pos, keys, first=first)
    return model.logits(rows_at(x, last)), x


def prompt_positions(lengths: Tensor, T: int, chunk: int) -> Tensor:
    """(B, T) positions of right-padded prompts of lengths (B,): 0, 1, ... for each prompt, and for the
    padding after it positions it will overwrite when it decodes, cycling through the `chunk` after its
    end (the model takes at most `chunk` positions a forward, so that those in one are distinct). Its
    padding then never reaches past the prompt's end + chunk, where a sliding-window ring would lose
    positions the row still needs."""
    columns = torch.arange(T, device=lengths.device)
    end = lengths.unsqueeze(1)  # (B, 1)
    return torch.where(columns < end, columns, end + (columns - end) % chunk)


def decode_one_token(model: Transformer, cur_token: Tensor, input_pos: Tensor, keys: Tensor, **sampling) -> Tensor:
    """cur_token: (B, 1); input_pos: (B, 1), each row's own position; keys: key_positions() above
    all of them. Returns the next tokens (B, 1)."""
    logits = model(cur_token, input_pos, key_positions=keys)  # (B, 1, V)
    return sample(logits[:, -1], **sampling)


def target_step(model: Transformer, x: Tensor, pos: Tensor, keys: Tensor, tree: Tensor | None = None
                ) -> tuple[Tensor, Tensor]:
    """Speculative decoding's verify step: the target's logits (B, T, V) and last-layer states
    (B, T, dim) for x (B, T) at pos (B, T)."""
    states = model.hidden_states(x, pos, keys, tree)
    return model.logits(states), states


def joined_step(model: Transformer, x: Tensor, pos: Tensor, keys: Tensor, chunk: Tensor, chunk_pos: Tensor,
                chunk_last: Tensor, chunk_keys: Tensor, chunk_row: int) -> tuple[Tensor, Tensor]:
    """A server's decode step of the cache's first B rows, x (B, 1) at pos (B, 1), that also carries a chunk
    of a prompt joining them, chunk (1, t) at chunk_pos (1, t) into cache row chunk_row, in one forward
    that reads each weight once for both (Transformer.packed_states). Returns the logits of the B rows and
    of the chunk's position chunk_last (1,), (B + 1, 1, V), and the chunk's last layer's output (1, t, dim)."""
    states, chunk_states = model.packed_states([(x, pos, keys, 0), (chunk, chunk_pos, chunk_keys, chunk_row)])
    return model.logits(torch.cat([states, rows_at(chunk_states, chunk_last)])), chunk_states


def draft_step(draft_model: Transformer, x: Tensor, pos: Tensor, keys: Tensor) -> Tensor:
    """x: (B, T) at positions pos (B, T) -> the draft model's logits for the next token (B, V)."""
    return draft_model(x, pos, key_positions=keys)[:, -1]


def head_step(head: Transformer, target: Transformer, tokens: Tensor, states: Tensor, pos: Tensor, keys: Tensor,
              last: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """speculative.DraftHead's forward, as a function that generate.compiled_steps() compiles."""
    return head(target, tokens, states, pos, keys, last)


@dataclasses.dataclass(frozen=True)
class Steps:
    """The forwards decoding runs, as one value that generate() and speculative decoding take and pass
    down: the plain functions above (EAGER), or compiled ones (generate.compiled_steps())."""
    decode_one_token: Callable = decode_one_token
    prefill_chunk: Callable = prefill_chunk
    target_step: Callable = target_step
    joined_step: Callable = joined_step
    draft_step: Callable = draft_step
    head_step: Callable = head_step


EAGER = Steps()


def key_positions(model: Transformer, n: int, rows: int | None = None) -> Tensor:
    """The cache slots a forward reads when all its positions lie below n: the first n slots of the
    full caches, rounded up to a block of KV_BLOCK (CPU_KV_BLOCK on a CPU; at most all of them), as the
    positions they hold (B, n'), for the first `rows` rows (None: all). So a step's cost follows the
    depth, and a cache sized for the whole context does not slow a short text. The length is marked
    dynamic: compiled code makes one graph for every depth (on GPU, CUDA graphs record one replay per
    block count, without recompiling)."""
    block = CPU_KV_BLOCK if model.positions.device.type == "cpu" else KV_BLOCK
    keys = model.positions[:rows, : padded_length(n, model.max_seq_length, block)]
    torch._dynamo.maybe_mark_dynamic(keys, 1)
    return keys


def padded_length(n: int, context: int, block: int = KV_BLOCK) -> int:
    """Cache length for n positions: rounded up to whole blocks of `block`, never past the model's
    context length. Nearby lengths share one compiled decode graph, and the cache's reads
    (key_positions) are whole blocks up to the context: on a GPU a part block read slowly
    (benchmarks/RESULTS.md, "A third GPU session")."""
    return min(-(-n // block) * block, context)


def until_stop(new_tokens: Tensor, stop_ids: list[int] | None) -> Tensor:
    """new_tokens up to and including the first stop token."""
    hits = torch.isin(new_tokens, torch.tensor(stop_ids or [])).nonzero()
    return new_tokens[: hits[0, 0] + 1] if len(hits) else new_tokens


def stream(callback, tokens: Tensor, shown: Tensor):
    """callback(one list of token ids per row): tokens (B, n) of this step, shown (B, n) which of them
    are the row's text (none once the row has ended)."""
    callback([row[keep].tolist() for row, keep in zip(tokens.cpu(), shown.cpu())])
