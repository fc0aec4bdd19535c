#!/usr/bin/env bash
# Download a Hugging Face model and convert it: scripts/prepare.sh meta-llama/Llama-3.1-8B-Instruct
set -euo pipefail
repo_id=${1:?usage: scripts/prepare.sh REPO_ID (e.g. meta-llama/Llama-3.1-8B-Instruct)}
here=$(dirname "$0")
python "$here/download.py" --repo_id "$repo_id"
python "$here/convert_hf_checkpoint.py" --checkpoint_dir "checkpoints/$repo_id"
