"""An OpenAI-compatible server for one model, batching its requests continuously in one static KV cache.

    pip install -e ".[serve]"
    python serve.py [--checkpoint_path X] [--port 8000] [--max_batch 8] [--compile] [--kv_cache_dtype int8]

Endpoints as OpenAI's API writes them: POST /v1/chat/completions (the checkpoint's chat template),
POST /v1/completions (with echo and logprobs, as lm-eval's local-completions scores through them),
GET /v1/models, GET /health; `stream` answers with server-sent events ending in `data: [DONE]`.

One thread, the main one, runs the Scheduler, which owns the model and a cache of --max_batch rows, and
one more (HTTP runs in another thread). A request waits for a free row. Prompts waiting, when there are at
least as many as rows running (a burst, or any while nothing runs), are prefilled together in one batch
into free rows, the running rows waiting for it (at most --prefill_chunk positions, padded), the beginning
they all share computed once where that saves enough positions (SHARED); otherwise a prompt goes into the
extra row, --join_chunk positions at a time, each chunk carried by a decode step of the rows already
running (one forward reads the weights once for both, and their streams keep flowing), and is then copied
into its row. The extra row keeps the last joined prompt's keys and values, so a prompt that begins as it
did (a system prompt that chats share, say) joins from where they part. The running requests are kept in
the cache's first rows (a request's cache moves down into a row freed below it), and every decode step
runs them at once, as the first 1, 2, 4, ... rows of the cache (a few fixed shapes, each compiled once,
before the first request: CUDA graphs on a GPU); each row samples with its own settings and random stream,
outside the step, so that no mix of requests recompiles it. A row is freed when its request ends: a stop
token, max_tokens, a stop string (the HTTP side finds those in the text), or a client gone away. In fp32 a
greedy request gets the tokens it gets alone, whatever else runs beside it (docs/design.md, "A few shapes
for every step", says where its numbers can move by rounding). An error in one request answers that
request, and the server goes on; SIGTERM or Ctrl-C answers the requests still open with a 503 error object
and stops.

Under torchrun (`torchrun --nproc_per_node=N serve.py`) the model is sharded as generate.py shards it:
rank 0 serves HTTP and schedules, and every rank makes the same calls to its shard (Engine).
"""

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import queue
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from . import cpu_decode, decode, tp
from .checkpoint import load_config
from .errors import UserError, run_cli
from .generate import (KV_CACHE_DTYPES, PRECISIONS, busy_cores, compiled_steps, cpu_clock, default_device,
                      find_checkpoint, fit_threads, get_tokenizer, load_model)
from .model import PREFILL_CHUNK, Transformer
from .tokenizer import TextPieces, Tokenizer

# what an OpenAI request may carry that this server does not do: refused in one line, not ignored
UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "response_format", "logit_bias", "suffix",
               "best_of", "audio", "modalities", "prediction", "parallel_tool_calls")


class APIError(Exception):
    """An answer in OpenAI's error format: {"error": {"message", "type", "param", "code"}}, with its status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


# ---------------------------------------------------------------------------------------------
# The scheduler: one thread, the model's only user


@dataclass
class Request:
    """What the scheduler needs of a request, and the queue its results go back on: ("token", id,
    logprob, top) for each new token (logprob and top None unless asked), ("prompt", logprobs, tops) for
    echo, then ("end", reason) or ("error", APIError)."""
    prompt: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    logprobs: int | None = None  # how many top alternatives a token's logprob comes with (0: only its own)
    echo: bool = False  # the prompt's own logprobs first (completions)
    stop_ids: list[int] = field(default_factory=list)
    loop: asyncio.AbstractEventLoop | None = None
    events: asyncio.Queue | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    generated: int = 0
    generator: torch.Generator | None = None

    def send(self, *event):
        """Hand an event to the HTTP side, from the scheduler's thread."""
        with contextlib.suppress(RuntimeError):  # its event loop closed: the server has stopped serving
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)


# prompt positions a decode step carries for a prompt joining the running rows (Scheduler.decode_step):
# more make the step slower for every running stream, fewer make a prompt wait more steps for its row, idle
# meanwhile. 8: where a plain step is cheap, a step of 16 more positions costs the streams a stall of twice its
# time (benchmarks/RESULTS.md, "Prompts carried by decode steps", "Joining prompts 8 positions a step, again")
JOIN_CHUNK = 8
# positions that prompts prefilled together must save, by the beginning they share, for it to go into one row
# alone first and be copied into the others': that forward reads every weight once more, which costs what
# about 40 positions do on 2 cores (benchmarks/RESULTS.md, "A burst's shared beginning prefilled once")
SHARED = 48


class Engine:
    """The model's side of the scheduler: its cache of max_batch rows and the extra one prompts are
    prefilled in, and the calls that run them. Under torchrun every rank holds one (its shard of the
    model) and makes the same calls in the same order, the sharded forwards' all-reduces pairing up
    across ranks: rank 0's scheduler makes each through call(), which first broadcasts it, and the
    other ranks follow() (gloo times out a collective after 30 minutes: an idle scheduler calls idle)."""

    def __init__(self, model: Transformer, max_batch: int, context: int, steps: decode.Steps,
                 prefill_chunk: int = PREFILL_CHUNK, kv_cache_dtype: torch.dtype | None = None, world: int = 1,
                 join_chunk: int = JOIN_CHUNK):
        self.model, self.steps, self.world = model, steps, world
        self.device = next(model.parameters()).device
        self.prompt_row = max_batch  # the extra row, a joining prompt's
        # a chunk's positions all lie in the context, and a sliding-window ring takes them in one forward
        self.join_chunk = min(join_chunk, prefill_chunk, context)
        model.setup_caches(max_batch + 1, context, prefill_chunk, kv_cache_dtype)
        # a CPU bf16 model's steps read a second copy of its weights, in cpu_linear.cpp's tiles where it builds:
        # a step of 8 rows costs little more than one row's so, several times as much through the plain weights
        # (benchmarks/RESULTS.md, "Bf16 products of our own on CPU"); so do its prompts of up to
        # cpu_decode.TILE_ROWS positions, longer ones read the plain weights ("The server's prompts through the tiles")
        cpu_decode.pack(model)

    def call(self, name: str, *args):
        if self.world > 1:
            torch.distributed.broadcast_object_list([(name, args)], src=0)
        return getattr(self, name)(*args)

    @torch.no_grad()
    def follow(self):
        """The other ranks' loop: rank 0's calls, until it stops."""
        while True:
            message = [None]
            torch.distributed.broadcast_object_list(message, src=0)
            name, args = message[0]
            if name == "stop":
                return
            try:
                getattr(self, name)(*args)
            except Exception:  # noqa: BLE001 - rank 0 met it too, and answers the request that met it
                pass

    def prefill(self, prompts: list[list[int]], states: bool, shared: int = 0):
        """The prompts, whole, into the cache's first rows, one each, in one batch: decode.prefill_logits'
        result. Always from row 0, so that compiled prefill sees one row number (Scheduler.prefill_together).
        Their first `shared` tokens, the same in all, go into row 0 alone first and are copied into the others'."""
        if shared:
            self.prefill([prompts[0][:shared]], False, 0)
            for row in range(1, len(prompts)):
                self.copy(0, row, shared)
        ids = decode.right_padded([torch.tensor(p[shared:]) for p in prompts], max(map(len, prompts)) - shared,
                                  self.device)
        lengths = torch.tensor([len(p) - shared for p in prompts], device=self.device)
        return decode.prefill_logits(self.model, ids, lengths, self.steps, states, start=shared)

    def copy(self, source: int, row: int, length: int):
        """The cache's row source, its first length positions, into row (a joined prompt's, a moved request's)."""
        copy_row(self.model, source, row, length)

    @torch.no_grad()
    def warm(self):
        """Every shape of step once, before the first request (the scheduler's row counts, a step carrying a
        chunk, one prompt prefilled and several), so that compiled code compiles each now and not mid-stream
        under load, where each stalled every stream for as long as it took. Rows at positions 0 and 1 write
        only slots that a request taking the row writes again before it reads them."""
        rows = self.prompt_row
        for n in sorted({min(1 << row.bit_length(), rows) for row in range(rows)}):
            self.step([0] * n, [0] * n)
        self.step([0] * rows, [0] * rows, join_chunks([0], self.join_chunk)[0])
        for batch in sorted({1, min(2, rows)}):  # one prompt, and several: compiled prefill specializes one row
            self.prefill([[0, 0]] * batch, False)

    def step(self, tokens: list[int], positions: list[int], chunk: tuple[list[int], list[int], int] | None = None):
        """One decode step of the cache's first len(tokens) rows: logits (len(tokens), 1, V). With a chunk of
        a joining prompt (join_chunks), the same forward writes it into the prompt row: then (the logits and
        a last row, the chunk's last prompt position's, and the chunk's last layer's output (1, t, dim))."""
        keys = decode.key_positions(self.model, max(positions) + 1, len(tokens))
        tokens = torch.tensor(tokens, device=self.device)[:, None]
        positions = torch.tensor(positions, device=self.device)[:, None]
        if chunk is None:
            return self.steps.target_step(self.model, tokens, positions, keys)[0]
        chunk_tokens, chunk_positions, n = chunk
        chunk_keys = decode.key_positions(self.model, chunk_positions[-1] + 1, 1)
        chunk_tokens, chunk_positions = (torch.tensor([t], device=self.device) for t in (chunk_tokens, chunk_positions))
        last = torch.tensor([n - 1], device=self.device)
        return self.steps.joined_step(self.model, tokens, positions, keys, chunk_tokens, chunk_positions, last,
                                      chunk_keys, self.prompt_row)

    def idle(self):
        pass

    def stop(self):  # the other ranks' follow() returns on it
        pass


class Scheduler:
    """Runs requests on an Engine of max_batch rows of `context` positions (see the module's docstring).
    submit() and stop() from any thread; run() in the model's (the main thread), until stop()."""

    IDLE_SECONDS = 60  # how often an idle scheduler tells the other ranks it is there

    def __init__(self, engine: Engine, max_batch: int, context: int):
        self.engine, self.context, self.device = engine, context, engine.device
        self.rows: list[Request | None] = [None] * max_batch
        self.tokens = [0] * max_batch  # each row's last token
        self.positions = [0] * max_batch  # ... and its position
        self.waiting: queue.Queue[Request | None] = queue.Queue()  # submitted, from other threads
        self.pending: list[Request] = []  # taken from there, in order, waiting for a row
        self.prefilling: Request | None = None  # the prompt joining the running rows ...
        self.chunks: list[tuple[list[int], list[int], int]] = []  # ... its chunks still to go (join_chunks) ...
        self.prompt_states: list[Tensor] = []  # ... and its last layer's output so far, for echoed logprobs
        self.held: list[int] = []  # the tokens whose keys the prompt row holds, from position 0 (joins' prompts)
        self.stopping = self.closed = False

    def submit(self, request: Request):
        self.waiting.put(request)

    def stop(self):
        """Stop after the step running now: every request not yet answered whole is answered 503."""
        self.waiting.put(None)

    @torch.no_grad()  # grad mode is a thread's own: so in whatever thread runs it
    def run(self):
        while not self.stopping:
            self.take_waiting(block=not (any(self.rows) or self.prefilling or self.pending))
            self.drop_cancelled()
            self.pack()
            running = len(self.rows) - self.rows.count(None)
            if not running and self.prefilling is not None:  # the rows it was joining have all ended
                self.pending.insert(0, self.prefilling)
                self.prefilling = None
            if group := self.together(running):
                self.prefill_together(group, running)
                continue
            if self.prefilling is None and None in self.rows:
                self.start_prefill()
            if running:
                self.decode_step()  # with the joining prompt's next chunk
        self.engine.call("stop")
        self.closed = True  # what comes from now on is refused where it is submitted
        shutting = APIError(503, "the server is shutting down: send the request again once it is back")
        late = []
        with contextlib.suppress(queue.Empty):
            while True:
                late.append(self.waiting.get_nowait())
        for request in [*filter(None, self.rows), *self.pending, *filter(None, [self.prefilling] + late)]:
            request.send("error", shutting)

    def take_waiting(self, block: bool):
        """Requests submitted since the last step join the line (waiting for one, when there is no work)."""
        taken = []
        try:
            taken.append(self.waiting.get(timeout=self.IDLE_SECONDS) if block else self.waiting.get_nowait())
            while True:
                taken.append(self.waiting.get_nowait())
        except queue.Empty:
            if block and not taken:
                self.engine.call("idle")
        self.stopping = None in taken
        self.pending += [r for r in taken if r is not None]

    def drop_cancelled(self):
        """Rows and waiting requests whose clients went away (or whose text reached a stop string) end now."""
        for row, request in enumerate(self.rows):
            if request is not None and request.cancelled.is_set():
                self.free(row)
        self.pending = [r for r in self.pending if not r.cancelled.is_set()]
        if self.prefilling is not None and self.prefilling.cancelled.is_set():
            self.prefilling = None

    def free(self, row: int):
        """The row is free: it steps at position 0 with token 0 (writing its slot 0, which the next request
        to take the row overwrites) until then, so that it adds nothing to the keys a step reads."""
        self.rows[row] = None
        self.tokens[row] = self.positions[row] = 0

    def pack(self):
        """Requests end in any order: the last running rows move into the free rows below them, so that the
        running rows are always the first ones (a step runs the first 1, 2, 4, ... rows)."""
        running = [row for row, request in enumerate(self.rows) if request is not None]
        for source, row in zip(reversed(running), [row for row, request in enumerate(self.rows) if request is None]):
            if source < row:
                return
            self.move(source, row)

    def move(self, source: int, row: int):
        self.engine.call("copy", source, row, self.positions[source])
        self.rows[row], self.tokens[row], self.positions[row] = (self.rows[source], self.tokens[source],
                                                                 self.positions[source])
        self.free(source)

    def together(self, running: int) -> list[Request]:
        """The waiting requests, in order, that free rows take now, prefilled together (one free row stays for
        a prompt joining by chunks), as long as padding their prompts to the longest adds at most as many
        positions as they have: all that fit when no row runs; while some do, only as many as run or more,
        and at most --prefill_chunk positions padded, a bound on the running rows' wait."""
        group, longest, total = [], 0, 0
        for request in self.pending[: self.rows.count(None) - (self.prefilling is not None)]:
            n = len(request.prompt)
            if group and (len(group) + 1) * max(longest, n) > 2 * (total + n):
                break
            group, longest, total = group + [request], max(longest, n), total + n
        if running and (len(group) < running or len(group) * longest > self.engine.model.chunk):  # --prefill_chunk
            return []
        return group

    def prefill_together(self, group: list[Request], running: int):
        """As many waiting prompts as rows run, or more (a burst of requests, or none running): prefilled
        together in one batch, into the cache's first rows (the running ones move above them), while the
        running rows wait for it: joining by chunks, one prompt a few steps at a time, would leave most rows
        idle meanwhile (benchmarks/RESULTS.md, "Prompts prefilled together")."""
        self.pending = self.pending[len(group):]
        above = range(max(running, len(group)), running + len(group))  # free rows (the running ones are the first)
        for source, row in zip(range(min(running, len(group))), above):
            self.move(source, row)
        shared = self.beginning(group)
        if (len(group) - 1) * shared < SHARED:  # too few positions saved to pay for the forward of its own
            shared = 0
        try:
            result = self.engine.call("prefill", [r.prompt for r in group], any(map(wants_prompt_logprobs, group)),
                                      shared)
        except Exception as e:  # noqa: BLE001 - these requests' failure is their own answer, not the server's end
            for request in group:
                fail(request, e)
            return
        logits, states = result if isinstance(result, tuple) else (result, None)
        for row, request in enumerate(group):
            own = states[row: row + 1, : len(request.prompt)] if wants_prompt_logprobs(request) else None
            self.start(row, request, logits[row: row + 1, -1], own)

    def start_prefill(self):
        if self.pending:
            self.prefilling = request = self.pending.pop(0)
            start = self.shared(request)
            self.chunks, self.prompt_states = join_chunks(request.prompt, self.engine.join_chunk, start), []
            self.held = request.prompt[:start]  # the chunks write from there on

    def shared(self, request: Request) -> int:
        """How many of the request's first positions the prompt row holds already (from the prompts that
        joined before it), which its join skips (beginning); a chunk stays within the context."""
        return max(0, min(self.beginning([request], [self.held]), self.context - self.engine.join_chunk))

    def beginning(self, requests: list[Request], also: list[list[int]] = ()) -> int:
        """How many first positions the requests' prompts (and `also`) share, which a prefill need compute only
        once; never a prompt's last, whose logits start it. Nothing where a prompt's own logprobs are asked
        (they come from the outputs at its positions), nor through a sliding-window ring, whose slots hold
        only the last positions written."""
        if any(map(wants_prompt_logprobs, requests)) or self.engine.model.config.sliding_window:
            return 0
        prompts = [r.prompt for r in requests]
        return max(0, min(len(os.path.commonprefix(prompts + list(also))), min(map(len, prompts)) - 1))

    def start(self, row: int, request: Request, logits: Tensor, states: Tensor | None):
        """The request, prefilled into row: its prompt's logprobs if asked (states: its last layer's output
        there), its first token (from logits (1, V))."""
        if states is not None:  # the output head is whole on every rank: rank 0 alone computes them
            prompt_logprobs(request, self.engine.model.logits(states)[0].float().log_softmax(-1))
        self.rows[row] = request
        self.positions[row] = len(request.prompt)
        if request.max_tokens > 0:
            self.emit(row, logits)
        else:
            self.finish(row, "length")

    def decode_step(self):
        """One step of the first rows, up to the last running one, rounded up to a power of 2 (a few fixed
        shapes: one graph each, compiled), then each running row's next token. The running rows are the
        first ones (pack), so that the rows stepped stay few while few run: the step's time grows with them.
        The step carries the joining prompt's next chunk, if any (then it steps every row: one more compiled
        shape, not four); after its last, the request takes its row."""
        joining, chunk = self.prefilling, self.chunks.pop(0) if self.prefilling else None
        last = max(row for row, request in enumerate(self.rows) if request is not None)
        n = len(self.rows) if chunk else min(1 << last.bit_length(), len(self.rows))
        try:
            out = self.engine.call("step", self.tokens[:n], self.positions[:n], chunk)
        except Exception as e:  # noqa: BLE001 - the rows running now fail; the server goes on
            for row, request in enumerate(self.rows):
                if request is not None:
                    fail(request, e)
                    self.free(row)
            if joining is not None:
                self.prefilling, self.held = None, []  # what the prompt row holds is not known
                fail(joining, e)
            return
        logits = out if chunk is None else out[0][:n]
        # the greedy rows' tokens in one argmax over every row (an argmax a row cost more in all)
        greedy = (argmax(logits[:, -1]).tolist() if any(r is not None and r.temperature == 0 for r in self.rows)
                  else [None] * n)
        for row, request in enumerate(self.rows):
            if request is not None:
                self.positions[row] += 1
                self.emit(row, logits[row: row + 1, -1], greedy[row])
        if chunk is not None:
            self.held = joining.prompt[: chunk[1][0] + chunk[2]]
            if wants_prompt_logprobs(joining):  # the chunk's states at the prompt's own positions
                self.prompt_states.append(out[1][:, :chunk[2]])
            if not self.chunks:  # its last: the logits at the prompt's last position; its cache into a free row
                self.prefilling, row = None, self.rows.index(None)
                self.engine.call("copy", self.engine.prompt_row, row, len(joining.prompt))
                self.start(row, joining, out[0][n:, -1],
                           torch.cat(self.prompt_states, dim=1) if self.prompt_states else None)

    def emit(self, row: int, logits: Tensor, greedy: int | None = None):
        """Sample row's next token from its logits (1, V) (greedy: their argmax, where known), send it,
        and end the row where it ends."""
        request = self.rows[row]
        token, logprob, top = sample(request, logits, greedy)
        request.generated += 1
        if token in request.stop_ids:
            return self.finish(row, "stop")
        request.send("token", token, logprob, top)
        self.tokens[row] = token
        if request.generated >= request.max_tokens or self.positions[row] + 1 >= self.context:
            self.finish(row, "length")

    def finish(self, row: int, reason: str):
        self.rows[row].send("end", reason)
        self.free(row)


def join_chunks(prompt: list[int], size: int, start: int = 0) -> list[tuple[list[int], list[int], int]]:
    """The chunks in which a prompt joins the running rows from position start on (the cache holds the
    ones before), `size` positions each (one compiled step): (tokens, positions, how many of them are the
    prompt's). The last ends at the prompt's last position; the first holds what is left of the prompt,
    then zeros, at positions that the next chunk writes again (or, for a prompt shorter than a chunk, past
    its end, masked until decoding writes them)."""
    first = len(prompt) - start - size * ((len(prompt) - start - 1) // size)
    chunks = [(prompt[start: start + first] + [0] * (size - first), list(range(start, start + size)), first)]
    return chunks + [(prompt[p: p + size], list(range(p, p + size)), size)
                     for p in range(start + first, len(prompt), size)]


def wants_prompt_logprobs(request: Request) -> bool:
    return request.echo and request.logprobs is not None


def copy_row(model: Transformer, source: int, row: int, length: int):
    """The caches' (keys, values, their scales) row source into row, positions 0 .. length - 1: all of a
    sliding-window ring, whose slots are positions modulo its length."""
    for layer in model.layers:
        for buffer in layer.attention.kv_cache.buffers():
            n = min(length, buffer.shape[2])
            buffer[row, :, :n] = buffer[source, :, :n]
    if hasattr(model, "ring_positions"):
        model.ring_positions[row] = model.ring_positions[source]


def sample(request: Request, logits: Tensor, greedy: int | None = None) -> tuple[int, float | None, dict | None]:
    """The request's next token from logits (1, V), with its own settings and random stream, and its
    logprob and top alternatives ({id: logprob}) where asked. greedy: the logits' argmax, where known."""
    if request.temperature == 0:
        token = int(argmax(logits)) if greedy is None else greedy
    else:
        probs = decode.logits_to_probs(logits, request.temperature, request.top_k, request.top_p)
        noise = torch.empty_like(probs).exponential_(1, generator=request.generator)
        token = int((probs / noise.clamp_(min=torch.finfo(probs.dtype).tiny)).argmax(-1))
    if request.logprobs is None:
        return token, None, None
    logprobs = logits.float().log_softmax(-1)[0]
    return token, float(logprobs[token]), top_alternatives(logprobs, request.logprobs)


def argmax(logits: Tensor) -> Tensor:
    """(..., V) -> (...): the first largest logit's index, taken in fp32 (exact for bf16 logits), where
    PyTorch's CPU argmax is several times faster than over bf16 (benchmarks/RESULTS.md, "Greedy tokens in
    the server")."""
    return logits.float().argmax(-1)


def top_alternatives(logprobs: Tensor, n: int) -> dict[int, float]:
    values, ids = logprobs.topk(max(n, 1))
    return dict(zip(ids.tolist(), values.tolist()))


def prompt_logprobs(request: Request, logprobs: Tensor):
    """echo: each prompt token's logprob given the ones before it (None for the first), with the top
    alternatives at each position, as OpenAI's completions report them."""
    tokens = request.prompt
    own = [None] + [float(logprobs[i - 1, t]) for i, t in enumerate(tokens) if i > 0]
    tops = [None] + [top_alternatives(logprobs[i - 1], request.logprobs) for i in range(1, len(tokens))]
    request.send("prompt", own, tops)


def fail(request: Request, error: Exception):
    print(f"request failed: {type(error).__name__}: {error}", file=sys.stderr)
    request.send("error", APIError(500, f"the request failed in the model: {type(error).__name__}: {error}"))


# ---------------------------------------------------------------------------------------------
# The HTTP side: OpenAI's requests and answers


class Service:
    """What the endpoints share: the scheduler they submit to, the tokenizer, the model's name and context."""

    def __init__(self, scheduler: Scheduler, tokenizer: Tokenizer, name: str):
        self.scheduler, self.tokenizer, self.name = scheduler, tokenizer, name

    def request(self, body: dict, prompt: list[int], chat: bool) -> tuple[Request, list[str], bool]:
        """The scheduler's Request for an OpenAI request body (check_body'ed) and its prompt's tokens, checked;
        its stop strings; whether it streams."""
        context = self.scheduler.context
        if len(prompt) >= context:
            raise APIError(400, f"the prompt takes {len(prompt)} tokens, and this server's context is {context}: "
                                f"shorten it", "messages" if chat else "prompt", "context_length_exceeded")
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        room = context - len(prompt)
        if limit is None:
            limit = room
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < (0 if body.get("echo") else 1):
            raise APIError(400, f"max_tokens must be a positive integer, got {limit!r}", "max_tokens")
        if limit > room:
            raise APIError(400, f"max_tokens {limit} and the prompt's {len(prompt)} tokens pass this server's "
                                f"context of {context}: lower max_tokens", "max_tokens", "context_length_exceeded")
        temperature, top_p = number(body, "temperature", 1.0, 0, 2), number(body, "top_p", 1.0, 0, 1)
        seed = body.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise APIError(400, f"seed must be an integer, got {seed!r}", "seed")
        logprobs = logprobs_asked(body, chat)
        request = Request(prompt, limit, temperature, top_p if top_p < 1 else None, None, seed, logprobs,
                          bool(body.get("echo")), self.tokenizer.stop_ids)
        if temperature > 0:
            request.generator = torch.Generator(self.scheduler.device)
            if seed is None:
                request.generator.seed()
            else:
                request.generator.manual_seed(seed)
        return request, stop_strings(body), bool(body.get("stream"))

    async def answers(self, request: Request):
        """The request's events, as the scheduler sends them, until it ends; cancelled on the way out
        (a client gone, a stop string found), which frees its row."""
        if self.scheduler.closed:
            raise APIError(503, "the server is shutting down: send the request again once it is back")
        request.loop, request.events = asyncio.get_running_loop(), asyncio.Queue()
        self.scheduler.submit(request)
        try:
            while True:
                event = await request.events.get()
                if event[0] == "error":
                    raise event[1]
                yield event
                if event[0] == "end":
                    return
        finally:  # the end, an error, a stop string (aclosing), or the client's going (the task cancelled)
            request.cancelled.set()


def check_body(body: dict, name: str, chat: bool):
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    if body.get("model") not in (None, name):  # None: whatever this server serves (lm-eval's default)
        raise APIError(404, f"the model {body.get('model')!r} does not exist: this server serves {name!r}",
                       "model", "model_not_found")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise APIError(400, "messages must be a non-empty list of {\"role\": ..., \"content\": \"...\"} objects",
                           "messages")
    for key in UNSUPPORTED:
        if body.get(key) is not None:
            raise APIError(400, f"{key} is not supported by this server", key)
    if body.get("n", 1) != 1:
        raise APIError(400, "n must be 1: this server makes one choice a request", "n")
    for key in ("frequency_penalty", "presence_penalty"):
        if body.get(key, 0) != 0:
            raise APIError(400, f"{key} is not supported by this server (0 only)", key)


def number(body: dict, key: str, default: float, low: float, high: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not low <= value <= high:
        raise APIError(400, f"{key} must be a number from {low} to {high}, got {value!r}", key)
    return float(value)


def logprobs_asked(body: dict, chat: bool) -> int | None:
    """How many top alternatives each token's logprob comes with, or None where none is asked: chat's
    logprobs (a bool) with top_logprobs, completions' logprobs (an integer)."""
    if chat:
        if not body.get("logprobs"):
            return None
        top = body.get("top_logprobs") or 0
        if not isinstance(top, int) or not 0 <= top <= 20:
            raise APIError(400, f"top_logprobs must be an integer from 0 to 20, got {top!r}", "top_logprobs")
        return top
    n = body.get("logprobs")
    if n is None:
        return None
    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= 20:
        raise APIError(400, f"logprobs must be an integer from 0 to 20, got {n!r}", "logprobs")
    return n


def stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
        raise APIError(400, "stop must be a non-empty string or a list of up to 4 of them", "stop")
    return stops


class Text:
    """The text of a request's new tokens, as it may be shown: a character split across tokens waits for
    its end (tokenizer.TextPieces), and a tail that may be the start of a stop string waits until it is
    known not to be. add() returns what may be shown now; `stopped` once a stop string is found (the text
    ends before it)."""

    def __init__(self, tokenizer: Tokenizer, stops: list[str]):
        self.pieces, self.stops, self.text, self.shown, self.stopped = TextPieces(tokenizer), stops, "", "", False
        self.hold = max((len(s) for s in stops), default=1) - 1

    def add(self, token: int | None = None) -> str:
        """The text a new token (None: the end) makes showable."""
        self.text += self.pieces.rest() if token is None else self.pieces.add([token])
        text = self.text
        for stop in self.stops:
            at = text.find(stop, max(0, len(self.shown) - len(stop) + 1))
            if at >= 0:
                text, self.stopped = text[:at], True
        end = len(text) if token is None or self.stopped else max(len(self.shown), len(text) - self.hold)
        new, self.shown = text[len(self.shown): end], text[:end]
        return new


def tokens_info(tokenizer: Tokenizer, ids: list[int], logprobs: list, tops: list, offset: int) -> dict:
    """completions' logprobs object for tokens ids: their strings, logprobs, top alternatives ({string:
    logprob}) and each one's offset in the text (which starts at offset)."""
    strings = [tokenizer.decode([t]) for t in ids]
    offsets = [offset + n for n in itertools.accumulate((len(s) for s in strings[:-1]), initial=0)]
    return {"tokens": strings, "token_logprobs": logprobs, "text_offset": offsets,
            "top_logprobs": [None if top is None else by_string(tokenizer, top) for top in tops]}


def by_string(tokenizer: Tokenizer, top: dict[int, float]) -> dict[str, float]:
    """Top alternatives {id: logprob}, best first, by their strings: where two tokens read alike the better
    one stands (lm-eval takes the best of them for the greedy choice)."""
    out = {}
    for token, logprob in top.items():
        out.setdefault(tokenizer.decode([token]), logprob)
    return out


def app_for(service: Service):
    """The FastAPI application: the four endpoints, every error as an OpenAI error object."""
    from fastapi import FastAPI, Request as HTTPRequest
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI(title="fastllama", docs_url=None, redoc_url=None)

    @app.exception_handler(APIError)
    async def api_error(_, error: APIError):
        print(f"{error.status}: {error.message}", file=sys.stderr)
        return JSONResponse(error.body(), status_code=error.status)

    async def json_body(http: HTTPRequest) -> dict:
        try:
            body = json.loads(await http.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not JSON: {e}")
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        return body

    @app.get("/health")
    async def health():
        scheduler = service.scheduler
        return {"status": "ok", "busy_rows": sum(r is not None for r in scheduler.rows),
                "waiting": scheduler.waiting.qsize() + len(scheduler.pending)}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": service.name, "object": "model", "created": 0,
                                           "owned_by": "fastllama"}]}

    @app.post("/v1/chat/completions")
    async def chat(http: HTTPRequest):
        body = await json_body(http)
        check_body(body, service.name, chat=True)
        try:
            prompt = service.tokenizer.encode_dialog(body["messages"])
        except Exception as e:  # noqa: BLE001 - the template's own refusal (a role it does not take, say)
            raise APIError(400, f"the chat template does not take these messages: {e}", "messages")
        request, stops, stream = service.request(body, prompt, chat=True)
        return await respond(service, request, stops, stream, chat=True)

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        body = await json_body(http)
        check_body(body, service.name, chat=False)
        prompt = completion_prompt(service.tokenizer, body.get("prompt"))
        request, stops, stream = service.request(body, prompt, chat=False)
        return await respond(service, request, stops, stream, chat=False)

    async def respond(service: Service, request: Request, stops: list[str], stream: bool, chat: bool):
        made = Made(service, request, stops, chat)
        if stream:
            return StreamingResponse(made.events(), media_type="text/event-stream")
        return JSONResponse(await made.whole())

    return app


def completion_prompt(tokenizer: Tokenizer, prompt) -> list[int]:
    """completions' prompt: a string, or token ids (as lm-eval sends them), or a list of one of either."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise APIError(400, "prompt must be a non-empty string or list of token ids (one prompt a request)", "prompt")


class Made:
    """One answer in the making: the request's events turned into OpenAI's chunks (stream) or its whole
    response, with the text cut at a stop string, usage counted and the finish reason given."""

    def __init__(self, service: Service, request: Request, stops: list[str], chat: bool):
        self.service, self.request, self.chat = service, request, chat
        self.text = Text(service.tokenizer, stops)
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created, self.completion_tokens = int(time.time()), 0
        self.logprobs = {"ids": [], "logprobs": [], "tops": []}
        self.echo_text = service.tokenizer.decode(request.prompt) if request.echo else ""

    async def pieces(self):
        """(text to add, finish reason or None) as the request's tokens come: the prompt's first with echo."""
        if self.request.echo:
            yield self.echo_text, None
        async with contextlib.aclosing(self.service.answers(self.request)) as events:
            async for event in events:
                if event[0] == "prompt":
                    _, own, tops = event
                    self.logprobs = {"ids": list(self.request.prompt), "logprobs": own, "tops": tops}
                elif event[0] == "token":
                    _, token, logprob, top = event
                    self.completion_tokens += 1
                    if self.request.logprobs is not None:
                        self.logprobs["ids"].append(token)
                        self.logprobs["logprobs"].append(logprob)
                        self.logprobs["tops"].append(top)
                    new = self.text.add(token)
                    if self.text.stopped:
                        yield new, "stop"
                        return
                    yield new, None
                else:
                    yield self.text.add(None), event[1]

    async def whole(self) -> dict:
        text, reason = "", None
        async for new, reason in self.pieces():
            text += new
        choice = {"index": 0, "finish_reason": reason}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
            if self.request.logprobs is not None:
                choice["logprobs"] = {"content": self.chat_logprobs()}
        else:
            choice["text"] = text
            choice["logprobs"] = self.completion_logprobs() if self.request.logprobs is not None else None
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.service.name, "choices": [choice], "usage": self.usage()}

    async def events(self):
        """Server-sent events: a chunk a piece of text, the finish reason in the last, then [DONE]."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        first = True
        try:
            async for new, reason in self.pieces():
                if not new and reason is None and not first:
                    continue
                if self.chat:
                    delta = {"role": "assistant", "content": new} if first else {"content": new} if new else {}
                    choice = {"index": 0, "delta": delta, "finish_reason": reason}
                else:
                    choice = {"index": 0, "text": new, "finish_reason": reason, "logprobs": None}
                first = False
                chunk = {"id": self.id, "object": kind, "created": self.created, "model": self.service.name,
                         "choices": [choice]}
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"
        except APIError as e:  # the stream has begun: its error goes as an event
            print(f"{e.status}: {e.message}", file=sys.stderr)
            yield f"data: {json.dumps(e.body())}\n\n"

    def usage(self) -> dict:
        prompt = len(self.request.prompt)
        return {"prompt_tokens": prompt, "completion_tokens": self.completion_tokens,
                "total_tokens": prompt + self.completion_tokens}

    def completion_logprobs(self) -> dict:
        lp = self.logprobs
        return tokens_info(self.service.tokenizer, lp["ids"], lp["logprobs"], lp["tops"], 0)

    def chat_logprobs(self) -> list[dict]:
        decode_one = self.service.tokenizer.decode
        return [{"token": decode_one([t]), "logprob": lp,
                 "top_logprobs": [{"token": decode_one([a]), "logprob": alp} for a, alp in (top or {}).items()]}
                for t, lp, top in zip(self.logprobs["ids"], self.logprobs["logprobs"], self.logprobs["tops"])]


# ---------------------------------------------------------------------------------------------
# The command line


def main(args):
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError:
        raise UserError("serve.py needs FastAPI and uvicorn: pip install -e '.[serve]'")
    rank, world = tp.maybe_init_distributed(args.device)
    if rank != 0:  # only rank 0 speaks, as in generate.py
        sys.stdout = sys.stderr = open(os.devnull, "w")
    try:
        if world > 1:  # one rank converts the bundled model on first use; the others wait for its files
            checkpoint_path = tp.rank_zero_first(lambda: find_checkpoint(args.checkpoint_path))
            tp.check_divisible(load_config(checkpoint_path), world)
        else:
            checkpoint_path = find_checkpoint(args.checkpoint_path)
        device, clock = args.device or default_device(), cpu_clock()
        model = load_model(checkpoint_path, device, args.precision, rank, world)
        if device == "cpu":
            fit_threads(busy_cores(clock))  # as generate.py: OpenMP's team waits on a thread sharing a busy core
        context = decode.padded_length(min(args.context or model.config.block_size, model.config.block_size),
                                       model.config.block_size)
        steps = compiled_steps(dynamic_prefill=True) if args.compile else decode.EAGER
        engine = Engine(model, args.max_batch, context, steps, args.prefill_chunk,
                        KV_CACHE_DTYPES[args.kv_cache_dtype or args.precision], world, args.join_chunk)
        if rank != 0:
            return engine.follow()
        if args.compile:
            print("compiling every shape of step first (minutes on a CPU)", file=sys.stderr)
            engine.call("warm")  # and so does every other rank
        scheduler = Scheduler(engine, args.max_batch, context)
        name = args.model_name or checkpoint_path.parent.name
        service = Service(scheduler, get_tokenizer(checkpoint_path), name)
        # The scheduler runs in the main thread, the one that loaded the model, and HTTP in another: a
        # second thread running the model has an OpenMP team of its own, and with more threads than
        # cores OpenMP stops spinning and puts its threads to sleep between ops, which made a step
        # twice as slow on 2 cores.
        server = uvicorn.Server(uvicorn.Config(app_for(service), host=args.host, port=args.port,
                                               log_level=args.log_level, timeout_graceful_shutdown=10))
        http = threading.Thread(target=server.run, name="http", daemon=True)
        http.start()
        while not server.started:
            if not http.is_alive():
                raise UserError(f"could not serve on {args.host}:{args.port} (uvicorn's line above says why; "
                                f"another port: --port)")
            time.sleep(0.05)
        print(f"serving {name} on http://{args.host}:{args.port}/v1 ({args.max_batch} rows of {context} positions, "
              f"{device}{f', {world} ranks' if world > 1 else ''})", file=sys.stderr)
        # SIGTERM or Ctrl-C: the scheduler answers what is open (503) and stops, then the HTTP side does. The
        # handler runs in the main thread, which may hold the queue's lock: another thread hands it the stop.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda number, frame: threading.Thread(target=scheduler.stop).start())
        try:
            scheduler.run()  # and tells the other ranks to stop when it does
        finally:
            server.should_exit = True
            http.join(timeout=30)
    finally:
        if world > 1:
            torch.distributed.destroy_process_group()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--checkpoint_path", type=Path, default=None, help="default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--model_name", default=None, help="the name clients ask for (default: the checkpoint's folder)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max_batch", type=int, default=8, help="rows of the cache: requests decoded at once")
    p.add_argument("--context", type=int, default=None,
                   help="positions a row holds, prompt and answer (default: the model's context length)")
    p.add_argument("--compile", action="store_true", help="compile the decode step (CUDA graphs on a GPU) and prefill")
    p.add_argument("--device", default=None, help="default: cuda when present, else cpu")
    p.add_argument("--precision", choices=PRECISIONS, default="bf16")
    p.add_argument("--kv_cache_dtype", choices=KV_CACHE_DTYPES, default=None, help="default: --precision's")
    p.add_argument("--prefill_chunk", type=int, default=PREFILL_CHUNK,
                   help="prompt positions a prefill forward takes; while requests run, the most (padded) that "
                        "prompts prefilled together make them wait for")
    p.add_argument("--join_chunk", type=int, default=JOIN_CHUNK,
                   help="prompt positions a decode step of the running requests carries for a request joining them")
    p.add_argument("--log_level", default="warning", help="uvicorn's")
    args = p.parse_args(argv)
    if args.max_batch < 1:
        p.error("--max_batch must be at least 1")
    if args.join_chunk < 1:
        p.error("--join_chunk must be at least 1")
    if args.context is not None and args.context < 2:
        p.error("--context must be at least 2")
    return args


def cli():
    """python serve.py's command line."""
    run_cli(main, parse_args())


if __name__ == "__main__":
    cli()
