"""Plot the speed ladder of a `scripts/benchmark.py --json` record: decode tok/s of every rung, a bar each.

    pip install -e ".[plot]"
    python scripts/plot_ladder.py benchmarks/results/cpu-smollm2.json benchmarks/results/cpu-smollm2.png
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastllama.errors import UserError, refuse, run_cli  # noqa: E402

COLORS = {"floor": "#bbbbbb", "HF": "#f28e2b", "llama.cpp": "#b07aa1", "ours": "#4e79a7"}


def color(name: str) -> str:
    if "floor" in name:
        return COLORS["floor"]
    return next((c for prefix, c in COLORS.items() if name.startswith(prefix)), COLORS["ours"])


def plot(record: dict, path: str):
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    rows = record.get("rows")
    if not isinstance(rows, dict) or not all("ms_per_token" in row for row in rows.values()):
        raise UserError("not a speed ladder's record (a benchmark_depths.py, --speculative or --harness run?): give the JSON of "
                        "a plain scripts/benchmark.py run")
    names = list(rows)
    tok_s = [1e3 / rows[name]["ms_per_token"] for name in names]
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(names) + 1.2))
    bars = ax.barh(names, tok_s, color=[color(n) for n in names])
    ax.bar_label(bars, [f"{t:.0f}" for t in tok_s], padding=3, fontsize=8)
    ax.invert_yaxis()  # the ladder reads top to bottom, as the table does
    ax.set_xlabel("decode tokens/s, batch 1 (speculative: tokens of output per second)", fontsize=9)
    args = record["args"]
    model = args["model"] or args["checkpoint_path"] or "bundled SmolLM2-135M-Instruct"
    ax.set_title(f"{model} on {record['hardware']}\n"
                 f"PyTorch {record['torch']}, {record['threads']} threads, {record['date'][:10]}", fontsize=9)
    ax.margins(x=0.12)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("json", help="a scripts/benchmark.py --json record")
    p.add_argument("png", help="the plot to write")
    args = p.parse_args()
    if not Path(args.json).is_file():
        refuse(f"{args.json} does not exist")
    run_cli(lambda args: plot(json.loads(Path(args.json).read_text()), args.png), args)
