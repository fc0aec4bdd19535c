"""serve.py through the official openai client, against a server this module starts on a free loopback
port with the bundled model in fp32: chat and completions, streamed and not, equal to generate() alone
for greedy requests whatever runs beside them; stop strings, max_tokens, seeds; a client that goes away
mid-stream frees its row; lm-eval's local-completions scores a repo task through it as eval.py does; bad
input is an OpenAI error object and the server goes on; a bounded load loses nothing."""

import asyncio
import contextlib
import copy
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from fastllama import cpu_decode, decode, serve
from fastllama.generate import compiled_steps, generate, get_tokenizer
from fastllama.model import Attention, ModelArgs, Transformer


openai = pytest.importorskip("openai", reason="the server's tests speak through openai: pip install -e '.[test]'")
pytest.importorskip("fastapi", reason="serve.py needs FastAPI and uvicorn: pip install -e '.[serve]'")


REPO = Path(__file__).resolve().parents[1]
CONTEXT = 512  # the server's positions a row, so that "past the context" is reachable
PROMPTS = ["Tell me about Paris.", "Name three rivers of Europe.", "What is a prime number?", "Write a haiku.",
           "Explain recursion in one sentence.", "What is 12 times 7?", "Who wrote Hamlet?", "Describe a cat."]


@pytest.mark.parametrize("rows, window", [(1, None), (3, None), (3, 5)])
def test_requests_past_the_rows_wait_for_one_and_all_finish(rows, window):
    """The scheduler alone (no HTTP): seven requests at once for one row or three, of several lengths, so that
    rows end at other times; their prompts prefilled together, into free rows (several at once with nothing
    running, the running rows moving above them), or in chunks of 4 carried by the decode steps of the rows
    running (with three rows), also through a sliding-window ring; each waits its turn and gets the greedy
    tokens generate() gives it alone."""
    torch.manual_seed(0)
    model = Transformer(ModelArgs(vocab_size=64, n_layer=2, dim=32, n_head=4, n_local_heads=2, block_size=128,
                                  sliding_window=window)).eval()
    prompts = [[(7 * i + j) % 64 for j in range(3 + 2 * i)] for i in range(7)]
    lengths = [6, 3, 5, 6, 2, 4, 6]
    alone_model = copy.deepcopy(model)
    expected = [generate(alone_model, torch.tensor(p), n, temperature=0)[len(p):].tolist()
                for p, n in zip(prompts, lengths)]
    engine = serve.Engine(model, rows, 64, decode.EAGER, prefill_chunk=16, join_chunk=4)
    joined, prefilled, step, prefill = [], [], engine.step, engine.prefill
    engine.step = lambda *args: joined.append(args[2:] != (None,)) or step(*args)
    # how many prompts each prefill takes, and how many rows were running meanwhile
    engine.prefill = lambda prompts, *args: (prefilled.append((len(prompts), rows - scheduler.rows.count(None)))
                                             or prefill(prompts, *args))
    scheduler = serve.Scheduler(engine, rows, 64)
    assert scheduled(scheduler, prompts, lengths) == expected
    assert any(joined) == (rows > 1)  # prompts of up to 15 positions joined running rows 4 at a time
    assert prefilled[0] == (rows, 0)  # the first ones together, nothing running
    assert any(running for _, running in prefilled) == (rows > 1)  # and later some while rows ran


def scheduled(scheduler: serve.Scheduler, prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
    """The scheduler alone (no HTTP), in a thread of its own: the greedy tokens of each prompt, all submitted
    before it starts, each asking for its length of tokens, which each gets; then it stops."""
    async def ask_all() -> list[list[int]]:
        loop = asyncio.get_running_loop()
        requests = [serve.Request(p, n, loop=loop, events=asyncio.Queue()) for p, n in zip(prompts, lengths)]
        for request in requests:
            scheduler.submit(request)
        threading.Thread(target=scheduler.run, daemon=True).start()
        answers = []
        for request in requests:
            tokens = []
            while (event := await asyncio.wait_for(request.events.get(), 120))[0] == "token":
                tokens.append(event[1])
            assert event == ("end", "length")
            answers.append(tokens)
        scheduler.stop()
        return answers

    return asyncio.run(ask_all())


def test_a_prompt_joins_in_chunks_of_one_size_ending_at_its_end():
    for length, size, start in [(1, 4, 0), (4, 4, 0), (5, 4, 0), (36, 16, 0), (3, 16, 0), (36, 16, 24), (5, 4, 4)]:
        prompt = list(range(100, 100 + length))
        chunks = serve.join_chunks(prompt, size, start)
        assert all(len(tokens) == len(positions) == size for tokens, positions, _ in chunks)
        assert chunks[-1][1][chunks[-1][2] - 1] == length - 1  # the last chunk's prompt ends the prompt
        assert [t for tokens, _, n in chunks for t in tokens[:n]] == prompt[start:]
        assert [p for _, positions, n in chunks for p in positions[:n]] == list(range(start, length))


def test_a_prompt_joins_from_where_it_parts_from_the_one_before(model_fp32, tokenizer):
    """Two chats (the same system prompt) join running rows one after the other: the second's chunks start
    where it parts from the first, whose keys the prompt row still holds, and each gets the greedy tokens
    generate() gives it alone (the bundled model in fp32: its answers hang on the system prompt). A prompt
    whose own logprobs are asked, or a model with a sliding-window ring, computes every position; a
    prompt's last position is always computed."""
    chats = [tokenizer.encode_dialog([{"role": "user", "content": p}]) for p in PROMPTS[:2]]
    shared = len(os.path.commonprefix(chats))
    prompts, lengths = [[1, 2], [3, 4], *chats], [60, 60, 4, 8]
    expected = [generate(model_fp32, torch.tensor(p), n, temperature=0)[len(p):].tolist()
                for p, n in zip(prompts, lengths)]
    engine = serve.Engine(copy.deepcopy(model_fp32), 3, CONTEXT, decode.EAGER, join_chunk=8)
    chunks, step = [], engine.step
    engine.step = lambda tokens, positions, chunk=None: (chunk and chunks.append(chunk[1])) or step(tokens, positions,
                                                                                                    chunk)
    scheduler = serve.Scheduler(engine, 3, CONTEXT)
    assert scheduled(scheduler, prompts, lengths) == expected  # the first two prefilled together; the chats join
    first = len(serve.join_chunks(chats[0], 8))  # the first chat's chunks, from position 0
    assert chunks[0][0] == 0 and shared > 16 and chunks[first][0] == shared  # the second's, where they part
    scheduler.held = chats[0]
    asking = serve.Request(chats[1], 1, echo=True, logprobs=0)
    assert [scheduler.shared(serve.Request(chats[1], 1)), scheduler.shared(asking)] == [shared, 0]
    assert scheduler.shared(serve.Request(chats[0], 1)) == len(chats[0]) - 1
    window = Transformer(ModelArgs(vocab_size=64, n_layer=2, dim=32, n_head=4, block_size=128, sliding_window=8))
    ringed = serve.Scheduler(serve.Engine(window.eval(), 3, 64, decode.EAGER, prefill_chunk=16, join_chunk=4), 3, 64)
    ringed.held = [1, 2, 3]
    assert ringed.shared(serve.Request([1, 2, 3, 4], 1)) == 0


def test_prompts_prefilled_together_compute_the_beginning_they_share_once(model_fp32, tokenizer):
    """Four chats at once (the same system prompt) are prefilled together: their shared beginning into one row
    alone, copied into the others', then each one's rest from there; each gets the greedy tokens generate()
    gives it alone (the bundled model in fp32). Two chats share too little for the extra forward to pay."""
    chats = [tokenizer.encode_dialog([{"role": "user", "content": p}]) for p in PROMPTS[:4]]
    shared = len(os.path.commonprefix(chats))
    lengths = [6, 3, 5, 4]
    expected = [generate(model_fp32, torch.tensor(p), n, temperature=0)[len(p):].tolist()
                for p, n in zip(chats, lengths)]
    engine = serve.Engine(copy.deepcopy(model_fp32), 4, CONTEXT, decode.EAGER)
    calls, prefill = [], engine.prefill
    engine.prefill = lambda prompts, *args: calls.append((len(prompts), *args[1:])) or prefill(prompts, *args)
    assert scheduled(serve.Scheduler(engine, 4, CONTEXT), chats, lengths) == expected
    assert shared > 16 and calls == [(4, shared), (1, 0)]  # all four; within that call, their beginning alone
    calls.clear()
    scheduled(serve.Scheduler(engine, 2, CONTEXT), chats[:2], lengths[:2])
    assert calls == [(2, 0)]


def test_a_compiled_server_runs_every_shape_of_step_before_its_first_request():
    """Engine.warm (serve.py --compile) steps each row count the scheduler uses, a step carrying a prompt's
    chunk, and prefills one prompt and two: compiled code then compiles none of them mid-stream."""
    model = Transformer(ModelArgs(vocab_size=64, n_layer=2, dim=32, n_head=4, n_local_heads=2, block_size=128)).eval()
    shapes = []

    def recorded(name, step):
        return lambda model, x, *args: shapes.append((name, tuple(x.shape))) or step(model, x, *args)

    steps = dataclasses.replace(decode.EAGER, target_step=recorded("step", decode.target_step),
                                joined_step=recorded("joined", decode.joined_step),
                                prefill_chunk=recorded("prefill", decode.prefill_chunk))
    serve.Engine(model, 3, 64, steps).warm()
    assert shapes == [("step", (1, 1)), ("step", (2, 1)), ("step", (3, 1)), ("joined", (3, 1)), ("prefill", (1, 2)),
                      ("prefill", (2, 2))]


def test_after_warming_a_compiled_engine_compiles_nothing():
    """What the scheduler runs after Engine.warm, compiled for real, with a bf16 model in its CPU forms (through
    packed weights where oneDNN has bf16 kernels): steps of each row count at other positions, a step
    carrying a chunk, prompts prefilled together of other counts and lengths (and from a shared beginning),
    and one alone: not one graph compiled again (the output head's product over a batch's last positions
    asked whether it had 2 rows, and compiled each count of prompts again; without AVX-512 a prompt's length
    was asked whether it reached cpu_decode.MANY_ROWS, and a bound on the batch followed)."""
    torch._dynamo.reset()  # past the recompile limit (other tests' models) dynamo would run it eagerly, unasked
    torch.manual_seed(0)
    model = Transformer(ModelArgs(vocab_size=64, n_layer=2, dim=32, n_head=4, n_local_heads=2, block_size=128))
    model = model.to(torch.bfloat16).eval()
    cpu_decode.apply(model)
    engine = serve.Engine(model, 3, 64, compiled_steps(dynamic_prefill=True), join_chunk=4)
    engine.warm()
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):  # as Scheduler.run
        for prompts in ([[1] * 7] * 3, [[2] * 5, [3] * 9], [[4] * 6], [[5] * 3] * 3, [[7] * 20]):
            engine.prefill(prompts, False)
        engine.prefill([[6] * 8 + [i] * 3 for i in range(3)], False, 8)  # a shared beginning first
        for rows in (1, 2, 3):
            engine.step([1] * rows, [9] * rows)
        engine.step([1] * 3, [9] * 3, serve.join_chunks(list(range(10)), 4)[1])


@pytest.mark.skipif(not cpu_decode.PACKABLE, reason="oneDNN has no bf16 kernels of its own on this CPU")
def test_a_bf16_cpu_engine_steps_through_packed_weights():
    """On a CPU with bf16 kernels the engine's model reads a packed copy of each linear's weight (a step of
    several rows costs much less so), current, in cpu_linear.cpp's tiles where it is built; and its attention
    keeps the CPU's kernel where the machine has it, which the server's steps run faster through
    (benchmarks/RESULTS.md, "The attention kernel in the server, a third time")."""
    model = Transformer(ModelArgs(vocab_size=64, n_layer=2, dim=32, n_head=4, n_local_heads=2, head_dim=16,
                                  block_size=128))  # heads of 16: the CPU's attention kernel takes them
    model = model.to(torch.bfloat16).eval()
    cpu_decode.apply(model)
    serve.Engine(model, 4, 64, decode.EAGER)
    linears = [m for m in model.modules() if isinstance(m, cpu_decode.FewRowLinear)]
    assert linears and all(m.packed_is_current() for m in linears)
    assert all(m.tiled == (cpu_decode.bf16_kernel() is not None) for m in linears)
    kernel = cpu_decode.decode_attention if cpu_decode.USE_ATTENTION_KERNEL and cpu_decode.attention_kernel() else None
    attentions = [m for m in model.modules() if isinstance(m, Attention)]
    assert attentions and all(m.decode_kernel is kernel for m in attentions)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def started(command: list[str]) -> tuple[str, subprocess.Popen]:
    """A server (serve.py's flags after `command`) on a free port, once it answers /health: its base URL
    and process (the leader of its own process group, which stopped() signals)."""
    port = free_port()
    process = subprocess.Popen([*command, "--port", str(port), "--precision", "fp32", "--context", str(CONTEXT)],
                               cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    while time.time() < deadline:
        try:
            get(base + "/health")
            return base, process
        except (urllib.error.URLError, ConnectionError):
            if process.poll() is not None:
                pytest.fail(f"the server stopped: {process.stderr.read()[-2000:]}")
            time.sleep(0.5)
    stopped(process, signal.SIGKILL)
    pytest.fail("the server did not answer /health in 180 s")


def stopped(process: subprocess.Popen, sig=signal.SIGTERM) -> int:
    """The server's exit code once SIGTERM (as a service manager sends it) has stopped its processes."""
    os.killpg(process.pid, sig)
    try:
        return process.wait(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def server(bundled_checkpoint):
    base, process = started([sys.executable, "serve.py", "--max_batch", "8"])
    yield base, process
    assert stopped(process) == 0, "the server did not stop cleanly on SIGTERM"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def name(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def tokenizer(bundled_checkpoint):
    return get_tokenizer(bundled_checkpoint)


def alone(model, tokenizer, prompt: list[int], n: int) -> str:
    """What generate() makes of the prompt alone, greedy: the text of its new tokens before a stop token."""
    out = generate(model, torch.tensor(prompt), n, temperature=0, stop_ids=tokenizer.stop_ids)[len(prompt):]
    return tokenizer.decode([t for t in out.tolist() if t not in tokenizer.stop_ids])


def test_chat_streamed_and_not_is_generate_alone(client, name, model_fp32, tokenizer):
    messages = [{"role": "user", "content": PROMPTS[0]}]
    whole = client.chat.completions.create(model=name, messages=messages, max_tokens=24, temperature=0)
    expected = alone(model_fp32, tokenizer, tokenizer.encode_dialog(messages), 24)
    assert whole.choices[0].message.content == expected and whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason in ("stop", "length") and whole.object == "chat.completion"
    assert whole.usage.prompt_tokens == len(tokenizer.encode_dialog(messages))
    assert whole.usage.completion_tokens <= 24 and whole.usage.total_tokens == (
        whole.usage.prompt_tokens + whole.usage.completion_tokens)
    chunks = list(client.chat.completions.create(model=name, messages=messages, max_tokens=24, temperature=0,
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_completion_with_max_tokens_is_generate_alone(client, name, model_fp32, tokenizer):
    prompt = "The three primary colors are"
    whole = client.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0)
    assert whole.choices[0].text == alone(model_fp32, tokenizer, tokenizer.encode(prompt), 12)
    assert whole.usage.completion_tokens == 12 and whole.choices[0].finish_reason == "length"
    streamed = client.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text


def test_eight_clients_at_once_each_get_their_text_alone(client, name, model_fp32, tokenizer):
    def ask(prompt):
        messages = [{"role": "user", "content": prompt}]
        return client.chat.completions.create(model=name, messages=messages, max_tokens=20,
                                              temperature=0).choices[0].message.content

    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(ask, PROMPTS))
    for prompt, text in zip(PROMPTS, together):
        assert text == alone(model_fp32, tokenizer, tokenizer.encode_dialog([{"role": "user", "content": prompt}]), 20)


def test_stop_strings_cut_the_text_even_inside_a_token(client, name):
    prompt = "Count: one, two, three, four, five, six, seven, eight"
    free = client.completions.create(model=name, prompt=prompt, max_tokens=16, temperature=0).choices[0].text
    assert len(free) > 6
    for stop in (free[3:6], free[4]):  # three characters from inside the text, and one
        cut = client.completions.create(model=name, prompt=prompt, max_tokens=16, temperature=0, stop=[stop])
        assert cut.choices[0].text == free[: free.index(stop)] and cut.choices[0].finish_reason == "stop"
        streamed = client.completions.create(model=name, prompt=prompt, max_tokens=16, temperature=0, stop=stop,
                                             stream=True)
        assert "".join(c.choices[0].text for c in streamed) == free[: free.index(stop)]


def test_a_seed_gives_a_sampled_answer_again(client, name):
    messages = [{"role": "user", "content": PROMPTS[3]}]
    runs = [client.chat.completions.create(model=name, messages=messages, max_tokens=16, temperature=1.0,
                                           seed=s).choices[0].message.content for s in (7, 7, 8)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_a_client_gone_mid_stream_frees_its_row_while_others_finish(client, name, server):
    others = ThreadPoolExecutor(4)
    finished = [others.submit(client.completions.create, model=name, prompt=p, max_tokens=24, temperature=0)
                for p in PROMPTS[:4]]
    stream = client.completions.create(model=name, prompt="Once upon a time", max_tokens=400, temperature=0,
                                       stream=True)
    for _ in zip(range(3), stream):
        pass
    stream.close()
    assert all(f.result().choices[0].finish_reason in ("stop", "length") for f in finished)
    deadline = time.time() + 10
    while get(server[0] + "/health")["busy_rows"] and time.time() < deadline:
        time.sleep(0.1)
    assert get(server[0] + "/health")["busy_rows"] == 0


def test_lm_eval_scores_a_task_through_the_server_as_eval_py_does(server, model_fp32, bundled_checkpoint):
    lm_eval = pytest.importorskip("lm_eval")
    from fastllama import eval as ev

    task, limit = str(REPO / "tasks" / "pydoc_cloze.yaml"), 20
    ours = ev.evaluate_tasks(ev.HarnessModel(model_fp32, get_tokenizer(bundled_checkpoint), "bundled", batch_size=4),
                             task, limit=limit)
    served = lm_eval.simple_evaluate(
        model="local-completions", tasks=ev.task_specs(task), limit=limit, log_samples=False,
        model_args=dict(base_url=server[0] + "/v1/completions", tokenizer=str(bundled_checkpoint.parent),
                        tokenizer_backend="huggingface", num_concurrent=4, max_retries=1))
    ours, served = (next(iter(r["results"].values())) for r in (ours, served))
    for metric in ("acc,none", "acc_norm,none"):
        assert served[metric] == pytest.approx(ours[metric], abs=1e-9), metric


BAD = [  # (path, body or raw text, status, a piece of the message)
    ("/v1/chat/completions", "{not json", 400, "not JSON"),
    ("/v1/chat/completions", {"model": "x"}, 404, "does not exist"),
    ("/v1/chat/completions", {}, 400, "messages must be"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": CONTEXT}, 400,
     "context"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n must be 1"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{}]}, 400, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": 5}, 400,
     "temperature"),
    ("/v1/completions", {"prompt": "word " * CONTEXT}, 400, "context"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt must be"),
]


@pytest.mark.parametrize("path,body,status,message", BAD)
def test_bad_input_is_an_error_object_and_the_server_goes_on(server, client, name, path, body, status, message):
    data = body if isinstance(body, str) else json.dumps({"model": name, **body} if "model" not in body else body)
    request = urllib.request.Request(server[0] + path, data=data.encode(), headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as answer:
        urllib.request.urlopen(request, timeout=30)
    assert answer.value.code == status
    error = json.loads(answer.value.read())["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error"
    assert client.completions.create(model=name, prompt="Hi", max_tokens=2).usage.completion_tokens >= 1


def test_a_bounded_load_loses_nothing(client, name):
    """64 requests from 16 clients, each bounded: every answer arrives whole and well-formed."""
    def loop(i):
        answers = []
        for j in range(4):
            started = time.time()
            kw = dict(model=name, max_tokens=8 + (i + j) % 8, temperature=0.5 * (j % 2), seed=i)
            if j % 2:
                a = client.chat.completions.create(messages=[{"role": "user", "content": PROMPTS[(i + j) % 8]}], **kw)
                answers.append((a.choices[0].message.content, a.choices[0].finish_reason, a.usage, kw))
            else:
                a = client.completions.create(prompt=PROMPTS[(i + j) % 8], **kw)
                answers.append((a.choices[0].text, a.choices[0].finish_reason, a.usage, kw))
            assert time.time() - started < 120
        return answers

    with ThreadPoolExecutor(16) as pool:
        answers = [a for loop_answers in pool.map(loop, range(16)) for a in loop_answers]
    assert len(answers) == 64
    for text, reason, usage, kw in answers:
        assert isinstance(text, str) and reason in ("stop", "length")
        # a sampled answer may end at once (its first token the end of text, which usage does not count)
        assert 0 <= usage.completion_tokens <= kw["max_tokens"] and usage.total_tokens == (
            usage.prompt_tokens + usage.completion_tokens)
        assert reason == "stop" or usage.completion_tokens == kw["max_tokens"]


def test_health_and_models(server, name):
    assert get(server[0] + "/health")["status"] == "ok"
    assert get(server[0] + "/v1/models")["data"] == [{"id": name, "object": "model", "created": 0,
                                                      "owned_by": "fastllama"}]


def test_sigterm_answers_open_requests_and_stops_cleanly(bundled_checkpoint):
    """A service manager's SIGTERM: streams and whole answers still open end with a 503 error object (not
    a connection cut), the log holds no traceback, and the server exits 0."""
    base, process = started([sys.executable, "serve.py"])
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=60)
    with ThreadPoolExecutor(2) as pool:
        whole = pool.submit(client.completions.create, model=None, prompt="Once upon a time", max_tokens=CONTEXT - 8)
        stream = client.completions.create(prompt="Once upon a time", max_tokens=CONTEXT - 8, stream=True,
                                           model=None)
        next(iter(stream))
        assert stopped(process) == 0
        with pytest.raises(openai.APIStatusError) as refused:
            whole.result()
    assert refused.value.status_code == 503 and "shutting down" in refused.value.message
    with pytest.raises(openai.APIError, match="shutting down"):
        list(stream)
    assert "Traceback" not in process.stderr.read()


def test_under_torchrun_rank_zero_serves_and_every_rank_steps(bundled_checkpoint, model_fp32, tokenizer):
    """Three ranks on gloo, the model sharded as generate.py shards it: rank 0 answers HTTP and broadcasts
    each call to the model; three requests at once each get their greedy text alone."""
    base, process = started([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3",
                             "serve.py"])
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
        messages = [[{"role": "user", "content": prompt}] for prompt in PROMPTS[:3]]
        with ThreadPoolExecutor(3) as pool:
            texts = list(pool.map(lambda m: client.chat.completions.create(
                model=None, messages=m, max_tokens=16, temperature=0).choices[0].message.content, messages))
    finally:
        stopped(process)
    assert texts == [alone(model_fp32, tokenizer, tokenizer.encode_dialog(m), 16) for m in messages]


def test_a_port_in_use_is_one_line(server):
    port = server[0].rsplit(":", 1)[1]
    run = subprocess.run([sys.executable, "serve.py", "--port", port], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 1 and f"error: could not serve on 127.0.0.1:{port}" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr


def test_serve_without_fastapi_or_a_bad_flag_is_one_line():
    run = subprocess.run([sys.executable, "serve.py", "--max_batch", "0"], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 2 and "--max_batch must be at least 1" in run.stderr and "Traceback" not in run.stderr


def test_the_benchmark_serves_random_weights_of_a_known_shape(bundled_checkpoint, tmp_path):
    """scripts/benchmark_serve.py --random (what a GPU session runs for the 8B): a checkpoint of random weights in
    a known shape (2 of its layers here) with the tokenizer of a folder that holds no weights (as a GPU machine
    has it), served and measured at each client count."""
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tokenizer / name).write_bytes((bundled_checkpoint.parent / name).read_bytes())
    out = tmp_path / "serve.json"
    run = subprocess.run([sys.executable, "scripts/benchmark_serve.py", "--random", "SmolLM2-360M", "--n_layer", "2",
                          "--tokenizer", str(tokenizer), "--clients", "1", "2", "--requests", "1", "--max_tokens", "6",
                          "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(row["clients"], row["requests"]) for row in rows] == [(1, 1), (2, 2)]
    assert all(row["tokens"] > 0 and row["gap_p50"] > 0 for row in rows), rows
