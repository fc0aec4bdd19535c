"""Convert a llama-architecture GGUF file into a checkpoint of ours, once (generate.py, serve.py and
eval.py do the same on first use of `--checkpoint_path FILE.gguf`).

    python scripts/convert_gguf.py --gguf model.Q4_0.gguf [--output_dir DIR]

Q4_0, Q4_1, Q4_K, IQ4_NL and IQ4_XS weights are copied as int4 without loss; a linear held in any part in
more bits a weight than int4 (Q5_0, Q5_K, Q6_K, Q8_0, ...) becomes int8, one in fewer (Q3_K, Q2_K) int4,
both dequantized and quantized again (a notice says so); a file of F32, F16 or BF16 stays unquantized, in bf16.
The GGUF file is only read.
"""

import argparse
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's modules, installed or not

from fastllama.errors import run_cli  # noqa: E402
from fastllama.generate import convert_gguf, gguf_checkpoint  # noqa: E402


def main(args):
    path = gguf_checkpoint(args.gguf) if args.output_dir is None else convert_gguf(args.gguf, args.output_dir)
    print(f"wrote {path}; run: python generate.py --checkpoint_path {shlex.quote(str(path.parent))}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--gguf", type=Path, required=True, help="the GGUF file")
    parser.add_argument("--output_dir", type=Path, default=None,
                        help="where to write the checkpoint (default: checkpoints/gguf/NAME in the repository, where "
                             "--checkpoint_path NAME.gguf finds it)")
    run_cli(main, parser.parse_args())
