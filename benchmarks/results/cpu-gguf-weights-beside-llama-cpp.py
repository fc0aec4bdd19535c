"""How near our import of a GGUF file computes to llama.cpp on that file: for each GGUF file given, the
file converted as generate.py converts it (into a fresh folder), then the logits of both over the same
tokens (a text from the README, tokenized by llama.cpp; llama.cpp with an fp32 cache, ours in fp32 with
its int4/int8 kernels as they run), and beside each linear's weight as the file's own dequantization
gives it: the relative error of the logits, the share of positions whose top token agrees, and each
weight type's relative error.

    python benchmarks/results/cpu-gguf-weights-beside-llama-cpp.py FILE.gguf [FILE2.gguf ...] [--tokens 256]
"""

import argparse
import sys
import tempfile
from pathlib import Path

import gguf
import llama_cpp
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from fastllama import convert, generate as gen, quantize  # noqa: E402
from fastllama.checkpoint import load_config, read_safetensors  # noqa: E402


def weight_errors(path: Path, checkpoint: Path) -> dict[str, float]:
    """Each GGUF weight type's relative error (norm of the difference over the norm) in our checkpoint."""
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    ours, metadata = read_safetensors(checkpoint)
    iq4 = quantize.read_scheme(metadata).iq4_layers if "quantization" in metadata else ()
    errors = {}  # type -> [sum of squared differences, sum of squares]
    for name, parts in convert.gguf_names(load_config(checkpoint)).items():
        base = name.removesuffix(".weight")
        if not base.startswith("layers.") or name.endswith("norm.weight"):
            continue
        if f"{base}.mins" in ours:
            levels = torch.tensor(quantize.IQ4_LEVELS, dtype=torch.int8) if base in iq4 else None
            mine = quantize.dequantize_int4(ours[f"{base}.weight"], ours[f"{base}.scales"], ours[f"{base}.mins"],
                                            levels=levels)
        elif f"{base}.scales" in ours:
            mine = ours[f"{base}.weight"].float() * ours[f"{base}.scales"].float()[:, None]
        else:
            mine = ours[name].float()
        row = 0
        for part, heads in parts:
            t = tensors[part]
            w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype("float32"))
            w = w if heads is None else convert.unpermute_rows(w, heads)
            d = mine[row:row + w.shape[0]] - w
            row += w.shape[0]
            e = errors.setdefault(t.tensor_type.name, [0.0, 0.0])
            e[0] += float(d.square().sum())
            e[1] += float(w.square().sum())
    return {kind: (d / s) ** 0.5 for kind, (d, s) in errors.items()}


@torch.no_grad()
def main(args):
    text = (REPO / "README.md").read_text()
    for path in args.files:
        theirs = llama_cpp.Llama(str(path), n_ctx=args.tokens + 8, logits_all=True, verbose=False, n_threads=2,
                                 type_k=0, type_v=0)  # an fp32 cache (GGML_TYPE_F32), as ours
        tokens = theirs.tokenize(text.encode(), add_bos=False)[:args.tokens]
        theirs.eval(tokens)
        reference = torch.from_numpy(theirs.scores[:len(tokens)].copy())
        with tempfile.TemporaryDirectory() as out:
            checkpoint = gen.convert_gguf(path, Path(out))
            model = gen.load_model(checkpoint, "cpu", "fp32")
            model.setup_caches(1, len(tokens) + 8)
            ours = model(torch.tensor([tokens]), torch.arange(len(tokens)))[0].float()
            per_type = weight_errors(path, checkpoint)
        error = ((ours - reference).norm() / reference.norm()).item()
        agree = (ours.argmax(-1) == reference.argmax(-1)).float().mean().item()
        print(f"{path.name}: logits' relative error against llama.cpp's {error:.4f}, top token agrees at "
              f"{agree:.3f} of {len(tokens)} positions; weights' relative error against the file's, by type: "
              + ", ".join(f"{kind} {e:.4f}" for kind, e in sorted(per_type.items())), flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", type=Path, nargs="+")
    p.add_argument("--tokens", type=int, default=256)
    main(p.parse_args())
