"""The server under load: throughput (generated tokens a second, all clients together) and latency (time
to the first token, time between tokens, p50 and p95) at each of --clients concurrent clients (1: the
requests one after another), and against llama.cpp's server (llama-cpp-python's `llama_cpp.server`,
the same GGUF file) at the same concurrency: each server started here, one at a time, on a free port.

    python scripts/benchmark_serve.py [--clients 1 4 8 16] [--requests 2] [--max_tokens 64] [--vary]
        [--llama-cpp] [--json out.json] [-- serve.py's own flags, e.g. --compile]
    python scripts/benchmark_serve.py --random Llama-3.1-8B --tokenizer DIR --clients 1 8 32 -- --compile
        --max_batch 32 --context 4096   # a GPU: random weights of a known shape, written to a folder first

Each client streams its requests one after another (chat completions, greedy, a prompt of the set each).
With --vary each request asks for its own number of tokens, from half --max_tokens to one and a half times
it, so that answers end at different times and prompts join while the others run, as under a real load. A
token's time is the arrival of the chunk holding it, and the tokens of an answer are counted by
re-tokenizing its text with the model's tokenizer, the same way for both servers.

With --random MODEL the server runs a checkpoint of random bf16 weights in that shape (scripts/shapes.py),
written to a temporary folder first, with the tokenizer of --tokenizer (a checkpoint's folder; default the
bundled model's) and that tokenizer's vocabulary: a model too large to have, served where it fits (a GPU).
Its answers are random tokens, as long as --max_tokens allows (an end-of-text token ends one early, rarely).
"""

import argparse
import dataclasses
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's modules, installed or not

import torch  # noqa: E402

from fastllama.checkpoint import (CHECKPOINT_NAME, CONFIG_NAME, copy_companions, single, write_json,  # noqa: E402
                                  write_safetensors)
from fastllama.convert import bundled_gguf  # noqa: E402
from fastllama.errors import UserError, run_cli  # noqa: E402
from fastllama.generate import default_device, find_checkpoint, get_tokenizer  # noqa: E402
from fastllama.model import Transformer  # noqa: E402
from fastllama.tokenizer import load_tokenizer  # noqa: E402
from shapes import shape  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["Tell me about Paris.", "Explain how a bicycle works.", "Describe the water cycle.",
           "What makes a good story?", "Explain photosynthesis to a child.", "Describe a busy market.",
           "How do airplanes fly?", "Write about the sea."]


@torch.no_grad()
def random_checkpoint(model: str, tokenizer: Path, folder: Path, n_layer: int | None = None) -> Path:
    """A checkpoint in folder of random bf16 weights in model's shape (n_layer: fewer layers, for tests), with
    the tokenizer files of the folder `tokenizer` and that tokenizer's vocabulary. Norms are ones, the rest
    normal with a standard deviation of 0.02, made on the GPU where there is one."""
    vocabulary = load_tokenizer(tokenizer).vocab_size
    config = dataclasses.replace(shape(model), vocab_size=vocabulary, n_layer=n_layer or shape(model).n_layer)
    with torch.device("meta"):
        weights = Transformer(config).state_dict()
    if config.tie_embeddings:
        weights.pop("output.weight")
    device = default_device()
    torch.manual_seed(0)

    def make(name: str, size: torch.Size) -> torch.Tensor:
        if name.endswith("norm.weight"):
            return torch.ones(size, dtype=torch.bfloat16)
        return torch.randn(size, dtype=torch.bfloat16, device=device).mul_(0.02)

    groups = [single(name, torch.bfloat16, w.shape, lambda name=name, size=w.shape: make(name, size))
              for name, w in weights.items()]
    write_safetensors(folder / CHECKPOINT_NAME, groups, {"source": f"random weights of {model}'s shape"},
                      desc=f"random {model}")
    write_json(folder / CONFIG_NAME, dataclasses.asdict(config))
    copy_companions(tokenizer / CONFIG_NAME, folder)  # the tokenizer's files (model_config.json is written)
    return folder / CHECKPOINT_NAME


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def started(command: list[str], url: str, seconds: float = 900) -> subprocess.Popen:
    """A server process, once it answers url. Its log goes to a file: a pipe nobody reads fills up and
    stops the server (llama.cpp logs its whole model loading)."""
    log = tempfile.TemporaryFile("w+")
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=log, text=True)
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            urllib.request.urlopen(url, timeout=5).read()
            return process
        except (urllib.error.URLError, ConnectionError):
            if process.poll() is not None:
                log.seek(0)
                raise UserError(f"{command[1]} stopped: {log.read()[-1500:]}")
            time.sleep(0.5)
    process.kill()
    raise UserError(f"{' '.join(command[:3])} did not answer in {seconds:.0f} s")


def stream_one(base: str, model: str, prompt: str, max_tokens: int) -> tuple[str, list[float], float]:
    """One streamed chat completion: its text, the arrival time of each chunk with text, and its start."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                       "temperature": 0, "stream": True}).encode()
    request = urllib.request.Request(base + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    start, text, times = time.perf_counter(), "", []
    with urllib.request.urlopen(request, timeout=600) as response:
        for line in response:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            piece = (chunk.get("choices") or [{}])[0].get("delta", {}).get("content") or ""
            if piece:
                text += piece
                times.append(time.perf_counter())
    return text, times, start


def load(base: str, model: str, clients: int, requests: int, max_tokens: int, tokenizer, vary: bool = False) -> dict:
    """`clients` threads, each streaming `requests` requests one after another."""
    results, lock = [], threading.Lock()

    def client(i: int):
        for j in range(requests):
            # each request its own length, the same for every server: strides of 17 a client, 29 a request
            n = (max_tokens + 1) // 2 + (17 * i + 29 * j) % max_tokens if vary else max_tokens
            text, times, start = stream_one(base, model, PROMPTS[(i * requests + j) % len(PROMPTS)], n)
            with lock:
                results.append((len(tokenizer.encode(text)), times, start))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    began = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - began
    tokens = sum(n for n, _, _ in results)
    first = [(times[0] - start) * 1e3 for _, times, start in results if times]
    gaps = [(b - a) * 1e3 for _, times, _ in results for a, b in zip(times, times[1:])]
    return dict(clients=clients, requests=len(results), tokens=tokens, seconds=wall, tok_s=tokens / wall,
                ttft_p50=pct(first, 50), ttft_p95=pct(first, 95), gap_p50=pct(gaps, 50), gap_p95=pct(gaps, 95))


def pct(values: list[float], p: float) -> float:
    return statistics.quantiles(values, n=100)[p - 1] if len(values) > 1 else (values or [float("nan")])[0]


def measure(name: str, base: str, model: str, args, tokenizer) -> list[dict]:
    rows = []
    for clients in args.clients:
        row = dict(load(base, model, clients, args.requests, args.max_tokens, tokenizer, args.vary), server=name)
        print(f"{name:24} {clients:7} {row['tok_s']:9.1f} {row['ttft_p50']:9.0f} {row['ttft_p95']:9.0f} "
              f"{row['gap_p50']:8.1f} {row['gap_p95']:8.1f}", flush=True)
        rows.append(row)
    return rows


def main(args):
    with tempfile.TemporaryDirectory(prefix="benchmark-serve-") as folder:
        if args.random:
            tokenizer_dir = args.tokenizer or find_checkpoint(None).parent
            args.checkpoint_path = random_checkpoint(args.random, tokenizer_dir, Path(folder), args.n_layer)
        run(args)


def run(args):
    checkpoint = find_checkpoint(args.checkpoint_path)
    tokenizer = get_tokenizer(checkpoint)
    low = (args.max_tokens + 1) // 2
    lengths = f"{low} to {low + args.max_tokens - 1}" if args.vary else args.max_tokens
    print(f"{args.requests} requests a client, {lengths} new tokens at most, greedy; ms")
    print(f"{'server':24} {'clients':>7} {'tok/s':>9} {'TTFT p50':>9} {'TTFT p95':>9} {'gap p50':>8} {'gap p95':>8}")
    rows = []
    port = free_port()
    ours = started([sys.executable, "serve.py", "--port", str(port), "--checkpoint_path", str(checkpoint),
                    *args.serve_args], f"http://127.0.0.1:{port}/health")
    try:
        base = f"http://127.0.0.1:{port}"
        model = json.loads(urllib.request.urlopen(base + "/v1/models").read())["data"][0]["id"]
        # warm: with --compile, each step shape compiles the first time its rows run (1, 2, 4, ... rows), and
        # answers long enough that every client's runs beside the others' (prompts join a chunk a step)
        load(base, model, max(args.clients), 1, args.max_tokens, tokenizer)
        rows += measure("ours", base, model, args, tokenizer)
    finally:
        ours.terminate()
        ours.wait(timeout=60)
    if args.llama_cpp:
        port = free_port()
        theirs = started([sys.executable, "-m", "llama_cpp.server", "--model", str(args.gguf or bundled_gguf()),
                          "--port", str(port), "--n_threads", str(args.threads), "--n_ctx", "4096",
                          "--chat_format", "chatml",
                          # its default cuts a running answer short when the next request comes
                          "--interrupt_requests", "False"], f"http://127.0.0.1:{port}/v1/models")
        try:
            base = f"http://127.0.0.1:{port}"
            model = json.loads(urllib.request.urlopen(base + "/v1/models").read())["data"][0]["id"]
            load(base, model, 1, 1, 8, tokenizer)  # warm
            rows += measure("llama.cpp (llama_cpp.server)", base, model, args, tokenizer)
        finally:
            theirs.terminate()
            theirs.wait(timeout=60)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(args=vars(args), rows=rows), indent=1, default=str))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--checkpoint_path", type=Path, default=None, help="default: the bundled model")
    p.add_argument("--random", default=None, metavar="MODEL",
                   help="random weights of a known shape (scripts/shapes.py) instead, written to a folder first")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="with --random: a folder with a checkpoint's tokenizer files (default: the bundled model's)")
    p.add_argument("--n_layer", type=int, default=None, help="with --random: fewer layers than the shape has (tests)")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--requests", type=int, default=2, help="requests each client sends, one after another")
    p.add_argument("--max_tokens", type=int, default=64)
    p.add_argument("--vary", action="store_true", help="each request its own max_tokens, around --max_tokens")
    p.add_argument("--llama-cpp", action="store_true", help="also llama-cpp-python's server on the GGUF")
    p.add_argument("--gguf", type=Path, default=None, help="llama.cpp's file (default: the bundled model's GGUF)")
    p.add_argument("--threads", type=int, default=2, help="llama.cpp's threads")
    p.add_argument("--json", default=None)
    p.add_argument("serve_args", nargs="*", help="after --: serve.py's flags")
    args = p.parse_args()
    if args.random and args.checkpoint_path or (args.tokenizer or args.n_layer) and not args.random:
        p.error("--random takes the place of --checkpoint_path, and --tokenizer and --n_layer go with it")
    if args.random and args.llama_cpp:
        p.error("--random has no GGUF file for --llama-cpp")
    run_cli(main, args)
