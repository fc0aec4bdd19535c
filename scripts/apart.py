"""The ladder's compiled rungs each in a process of its own (scripts/benchmark.py --apart): they compile at
once, then take turns on the device to be timed.

Compiling an 8B's decode step takes one to two minutes of one CPU core, and a ladder of six compiled rungs
(ours and gpt-fast's, each in bf16, int8 and int4) compiled one after another takes longer than a call on a
lent GPU. Apart, the six compile side by side on the machine's cores, and the timing is as fair as in one
process: a round asks each rung in turn for one timed run while the others wait, idle, on a pipe.

The parent (measure) starts one child a rung and tells them, one at a time, to build their model, so that only
one holds an unquantized copy beyond what it keeps (release) at any moment; each compiles as soon as it has
built. When all are ready, each round asks each child for a run and reads back its seconds. A child that fails
is reported and the others go on.

The child (Channel) answers on its own standard output, a line of JSON a message; whatever else it prints
goes to standard error.
"""

import json
import os
import subprocess
import sys

import torch


def measure(commands: dict[str, list[str]], runs: int) -> dict[str, dict]:
    """Start each command (a child measuring the rung it is named for), have them build in the order given,
    then `runs` rounds in that order. Returns, for each rung, what its child said when ready (first_run_s,
    weight_bytes, memory_gb, note) with its runs' seconds (full_s, first_s), or error."""
    children = {name: subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
                for name, command in commands.items()}
    said = {name: {} for name in commands}

    def ask(name: str, word: str | None, answer: str) -> bool:
        """Send word (None: nothing) and read the child's reply until `answer`; False once it has failed."""
        child = children[name]
        if "error" in said[name]:
            return False
        try:
            if word:
                child.stdin.write(word + "\n")
            while line := child.stdout.readline():
                if not line.startswith('{"say"'):  # printed before the child took its stdout for the channel
                    print(line, end="", file=sys.stderr)
                    continue
                message = json.loads(line)
                if message.pop("say") == answer:
                    said[name].update(message)
                    return True
        except BrokenPipeError as e:
            child.kill()
            said[name]["error"] = f"its pipe closed: {e}"
            return False
        said[name]["error"] = f"exited with {child.wait()} before it said {answer} (its output is above)"
        return False

    try:
        for name in children:  # one at a time: a child holds its unquantized copy only while it builds
            ask(name, "build", "built")
        for name in children:
            ask(name, None, "ready")
        for _ in range(runs):
            for name in children:
                if ask(name, "run", "times"):
                    for key in ("full", "first"):
                        said[name].setdefault(f"{key}_s", []).append(said[name].pop(key))
    finally:
        for child in children.values():
            if child.poll() is None:
                child.stdin.close()  # the end: each exits
        for child in children.values():
            child.wait()
    return said


class Channel:
    """A child's side: its standard output becomes the channel to the parent, and everything else it prints
    (Python's and C's) goes to standard error."""

    def __init__(self):
        self.out = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
        sys.stdout.flush()
        os.dup2(sys.stderr.fileno(), sys.stdout.fileno())

    def say(self, word: str, **figures):
        self.out.write(json.dumps(dict(say=word, **figures)) + "\n")

    def heard(self, word: str) -> bool:
        """Wait for the parent's next word: True if it is `word`, False at the end (the parent closed the pipe)."""
        line = sys.stdin.readline()
        if line and line.strip() != word:
            raise RuntimeError(f"the parent said {line.strip()!r}, not {word!r}")
        return bool(line)


@torch.no_grad()
def release(model: torch.nn.Module, keep: torch.nn.Module):
    """Free the memory of model's tensors that keep does not share (a child keeps only its rung's model)."""
    kept = {t.untyped_storage().data_ptr() for t in [*keep.parameters(), *keep.buffers()]}
    for t in [*model.parameters(), *model.buffers()]:
        if t.untyped_storage().data_ptr() not in kept:
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
