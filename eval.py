"""Perplexity of a checkpoint on a text: what a quantization scheme costs in accuracy.

    python eval.py --checkpoint_path checkpoints/X/model_int4.g32.safetensors [--text_file notes.txt]

The default text is the held-out half of the documentation that ships with Python (the other half
calibrates GPTQ), so every machine can compare schemes with no download.
"""

import argparse
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from errors import UserError, run_cli
from generate import KV_CACHE_DTYPES, PRECISIONS, get_tokenizer, load_model
from model import Transformer
from quantize import python_docs_text


@torch.no_grad()
def perplexity(model: Transformer, tokens: torch.Tensor, seq_len: int = 512, batch_size: int = 4,
               progress: bool = False, kv_cache_dtype: torch.dtype | None = None) -> float:
    """exp(mean next-token loss) over consecutive windows of seq_len tokens, the keys and values each
    window attends to stored in kv_cache_dtype (None: the model's dtype)."""
    n_windows = len(tokens) // seq_len
    if n_windows == 0:
        raise UserError(f"the text has {len(tokens)} tokens, fewer than one window of {seq_len}")
    windows = tokens[: n_windows * seq_len].view(n_windows, seq_len)
    device = next(model.parameters()).device
    model.setup_caches(batch_size, seq_len, kv_cache_dtype=kv_cache_dtype)
    total = 0.0
    for batch in tqdm(windows.split(batch_size), desc="perplexity", unit="batch", disable=not progress):
        batch = batch.to(device)
        logits = model(batch, torch.arange(seq_len, device=device))  # (B, T, V)
        total += F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch[:, 1:].flatten(), reduction="sum").item()
    return math.exp(total / (n_windows * (seq_len - 1)))


def main(args):
    text = Path(args.text_file).read_text(errors="replace") if args.text_file else python_docs_text("held-out")
    tokens = torch.tensor(get_tokenizer(args.checkpoint_path).encode(text)[: args.max_tokens])
    model = load_model(args.checkpoint_path, args.device, args.precision)
    ppl = perplexity(model, tokens, args.seq_len, args.batch_size, progress=True,
                     kv_cache_dtype=KV_CACHE_DTYPES[args.kv_cache_dtype or args.precision])
    print(f"{args.checkpoint_path or 'bundled model'}: perplexity {ppl:.3f} over {len(tokens)} tokens "
          f"in windows of {args.seq_len}, KV cache {args.kv_cache_dtype or args.precision}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint_path", type=Path, default=None, help="default: the bundled model")
    p.add_argument("--text_file", type=Path, default=None, help="default: held-out Python documentation")
    p.add_argument("--max_tokens", type=int, default=16384, help="tokens of the text to score")
    p.add_argument("--seq_len", type=int, default=512)
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--device", default=None)
    p.add_argument("--precision", choices=PRECISIONS, default="bf16")
    p.add_argument("--kv_cache_dtype", choices=KV_CACHE_DTYPES, default=None, help="default: --precision's")
    args = p.parse_args()
    if args.text_file and not args.text_file.is_file():
        p.error(f"{args.text_file} does not exist")
    run_cli(main, args)
