"""Download a Hugging Face checkpoint: config, tokenizer and weights, nothing else.

    python scripts/download.py --repo_id meta-llama/Llama-3.1-8B-Instruct
"""

import argparse
import os
import sys
from fnmatch import fnmatch
from pathlib import Path

from huggingface_hub import HfApi, snapshot_download
from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's modules, installed or not

from fastllama.errors import UserError, run_cli  # noqa: E402

CONFIG_FILES = {
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",  # newer transformers save the chat template here, not in tokenizer_config.json
}

# huggingface_hub >= 1.0 raises the HTTP client's own errors (httpx) for connection failures,
# which are not OSErrors; HfHubHTTPError derives from that client's base error class.
NETWORK_ERRORS = (OSError, *HfHubHTTPError.__bases__)


def select_files(repo_files: list[str]) -> list[str]:
    """The files of a repo listing worth fetching: safetensors weights if any, else pytorch_model*.bin."""
    # Only the top level: subfolders hold other formats (original/ consolidated .pth, onnx/, gguf...).
    top = [f for f in repo_files if "/" not in f]
    # Mistral repos also ship consolidated.safetensors, a second full copy of the weights in another layout.
    weights = [f for f in top if f.endswith(".safetensors") and not f.startswith("consolidated")]
    index = "model.safetensors.index.json"
    if not weights:
        weights = [f for f in top if fnmatch(f, "pytorch_model*.bin")]
        index = "pytorch_model.bin.index.json"
    if not weights:
        raise ValueError("it has no *.safetensors or pytorch_model*.bin weights")
    return sorted(f for f in top if f in CONFIG_FILES or f == index) + sorted(weights)


def download(repo_id: str, checkpoint_dir: str | Path = "checkpoints", token: str | None = None) -> Path:
    token = token or os.environ.get("HF_TOKEN")
    files = select_files(HfApi().list_repo_files(repo_id, token=token))
    local_dir = Path(checkpoint_dir) / repo_id
    snapshot_download(repo_id, local_dir=local_dir, allow_patterns=files, token=token)
    return local_dir


def first_line(e: Exception) -> str:
    return next(iter(str(e).splitlines()), type(e).__name__)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--repo_id", required=True, help="Hugging Face repo id: org/name")
    parser.add_argument("--checkpoint_dir", default="checkpoints", help="files go to CHECKPOINT_DIR/REPO_ID")
    parser.add_argument("--hf_token", help="access token for gated or private repos (default: $HF_TOKEN)")
    args = parser.parse_args(argv)
    token_hint = "pass --hf_token or set HF_TOKEN"
    try:
        path = download(args.repo_id, args.checkpoint_dir, args.hf_token)
    except GatedRepoError:
        error = f"{args.repo_id} is gated: accept its license at https://huggingface.co/{args.repo_id} and {token_hint}"
    except RepositoryNotFoundError:
        error = f"repository {args.repo_id} not found (if it is private, {token_hint})"
    except HfHubHTTPError as e:
        status = getattr(e.response, "status_code", None)
        if status in (401, 403):
            error = f"access to {args.repo_id} denied ({status}): {token_hint} with access to it"
        else:
            error = f"download of {args.repo_id} failed: {first_line(e)}"
    except ValueError as e:  # a malformed repo id, or a repo without usable weights
        error = f"cannot download {args.repo_id}: {first_line(e)}"
    except NETWORK_ERRORS as e:
        error = f"download of {args.repo_id} failed: {type(e).__name__}: {first_line(e)}"
    else:
        print(f"downloaded {args.repo_id} to {path}")
        return
    raise UserError(error)


if __name__ == "__main__":
    run_cli(main, None)  # Ctrl-C: exit code 130, no traceback
