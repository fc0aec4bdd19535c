"""Convert a Hugging Face checkpoint directory into ours, in the same directory.

    python scripts/convert_hf_checkpoint.py --checkpoint_dir checkpoints/meta-llama/Llama-3.1-8B-Instruct

Reads config.json and the *.safetensors or pytorch_model*.bin shards tensor by tensor, and writes
fastllama.safetensors and model_config.json beside them (the tokenizer files are already there).
The Hugging Face files are only read.
"""

import argparse
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's modules, installed or not

from fastllama.convert import convert_hf_checkpoint  # noqa: E402
from fastllama.errors import run_cli  # noqa: E402


def main(args):
    path = convert_hf_checkpoint(args.checkpoint_dir)
    print(f"wrote {path}; run: python generate.py --checkpoint_path {shlex.quote(str(path.parent))}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--checkpoint_dir", type=Path, required=True, help="a HF model directory")
    run_cli(main, parser.parse_args())
