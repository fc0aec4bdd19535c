import shutil
from fnmatch import fnmatch
from pathlib import Path
from types import SimpleNamespace

import pytest
from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

from fastllama.errors import run_cli
from scripts import download

CONFIGS = ["config.json", "generation_config.json", "special_tokens_map.json", "tokenizer_config.json"]
LLAMA = CONFIGS + ["tokenizer.json", "model.safetensors.index.json",
                   "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
MISTRAL = LLAMA + ["tokenizer.model"]
BIN = CONFIGS + ["tokenizer.model", "pytorch_model.bin.index.json",
                 "pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"]
# Each repo: (all its files, those to download).
REPOS = {
    "meta-llama/Llama-3.1-8B-Instruct": (LLAMA + [
        "original/consolidated.00.pth", "original/params.json", "original/tokenizer.model",
        "checkpoint-500/model.safetensors", "README.md", "LICENSE", "USE_POLICY.md", ".gitattributes",
    ], LLAMA),
    "mistralai/Mistral-7B-Instruct-v0.3": (MISTRAL + ["tokenizer.model.v3", "consolidated.safetensors", "params.json"],
                                           MISTRAL),
    "old/bin-only": (BIN + [
        "tf_model.h5", "flax_model.msgpack", "model.onnx", "onnx/model.onnx", "model-q4_0.gguf", "README.md",
    ], BIN),
    "some/no-weights": (CONFIGS + ["tokenizer.json", "model.gguf"], None),
}


def http_error(cls, status: int):
    return cls(f"{status} Client Error", response=SimpleNamespace(status_code=status, headers={}, request=None))


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A fake Hugging Face Hub serving REPOS from local files; records (call, repo_id, token)."""
    root = tmp_path / "hub"
    for repo_id, (files, _) in REPOS.items():
        for name in files:
            (root / repo_id / name).parent.mkdir(parents=True, exist_ok=True)
            (root / repo_id / name).write_text(name)
    calls = []
    hub = SimpleNamespace(calls=calls, error=None)

    def list_repo_files(self, repo_id, *, token=None, **kwargs):
        calls.append(("list", repo_id, token))
        if hub.error is not None:
            raise hub.error
        if not (root / repo_id).is_dir():
            raise http_error(RepositoryNotFoundError, 404)
        return sorted(files_in(root / repo_id))

    def snapshot_download(repo_id, *, local_dir, allow_patterns, token=None, **kwargs):
        calls.append(("snapshot", repo_id, token))
        for name in files_in(root / repo_id):
            if any(fnmatch(name, pattern) for pattern in allow_patterns):
                (Path(local_dir) / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(root / repo_id / name, Path(local_dir) / name)
        return str(local_dir)

    monkeypatch.setattr(download.HfApi, "list_repo_files", list_repo_files)
    monkeypatch.setattr(download, "snapshot_download", snapshot_download)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    return hub


def files_in(directory: Path) -> set[str]:
    return {p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file()}


@pytest.mark.parametrize("repo_id", [repo_id for repo_id, (_, expected) in REPOS.items() if expected])
def test_download_fetches_only_needed_files(tmp_path, hub, repo_id):
    path = download.download(repo_id, tmp_path / "checkpoints", token="hf_arg")
    assert path == tmp_path / "checkpoints" / repo_id
    assert files_in(path) == set(REPOS[repo_id][1])
    assert hub.calls == [("list", repo_id, "hf_arg"), ("snapshot", repo_id, "hf_arg")]


def test_token_from_environment(tmp_path, hub, monkeypatch):
    download.download("old/bin-only", tmp_path)
    assert [token for _, _, token in hub.calls] == [None, None]
    monkeypatch.setenv("HF_TOKEN", "hf_env")
    download.download("old/bin-only", tmp_path)
    assert [token for _, _, token in hub.calls[2:]] == ["hf_env", "hf_env"]


def test_main(tmp_path, hub, capsys):
    download.main(["--repo_id", "old/bin-only", "--checkpoint_dir", str(tmp_path), "--hf_token", "hf_cli"])
    assert files_in(tmp_path / "old/bin-only") == set(BIN)
    assert hub.calls[0] == ("list", "old/bin-only", "hf_cli")
    assert str(tmp_path / "old/bin-only") in capsys.readouterr().out


@pytest.mark.parametrize("repo_id, error, message", [
    ("nobody/nothing", None, "not found"),
    ("some/no-weights", None, "no *.safetensors"),
    ("meta-llama/Llama-3.1-8B", http_error(GatedRepoError, 401), "is gated"),
    ("meta-llama/Llama-3.1-8B", http_error(HfHubHTTPError, 403), "denied (403)"),
    ("meta-llama/Llama-3.1-8B", http_error(HfHubHTTPError, 500), "500 Client Error"),
    ("meta-llama/Llama-3.1-8B", ConnectionError("[Errno -2] Name or service not known\nmore"), "not known"),
    # huggingface_hub >= 1.0 raises its HTTP client's errors for connection failures, which are not OSErrors
    ("meta-llama/Llama-3.1-8B", HfHubHTTPError.__bases__[0]("[Errno -2] Name or service not known"), "not known"),
])
def test_main_errors(tmp_path, hub, repo_id, error, message):
    hub.error = error
    with pytest.raises(SystemExit) as exit:  # as the command line runs it
        run_cli(download.main, ["--repo_id", repo_id, "--checkpoint_dir", str(tmp_path)])
    line = exit.value.code  # what sys.exit prints to stderr, exiting with 1
    assert line.startswith("error: ") and "\n" not in line
    assert repo_id in line and message in line
    assert not (tmp_path / repo_id).exists()
