"""The house's rooms: imports between the library's modules run one way, conversion code stays out of
the run path, and the installed library takes one name, fastllama."""

import ast
import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MODULES = {p.stem: p for p in (REPO / "fastllama").glob("*.py") if p.stem != "__init__"}


def imports(name: str, lazy: bool = True) -> set[str]:
    """The library's modules a module imports (lazy=False: only at module level)."""
    tree = ast.parse(MODULES[name].read_text())
    nodes = ast.walk(tree) if lazy else tree.body
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 1:  # from .model import X, from . import model
            found |= {node.module.split(".")[0]} if node.module else {a.name for a in node.names}
    return found & set(MODULES) - {name}


def reachable(name: str) -> set[str]:
    seen, todo = set(), [name]
    while todo:
        for other in imports(todo.pop()):
            if other not in seen:
                seen.add(other)
                todo.append(other)
    return seen


def test_no_module_imports_one_that_imports_it_back():
    cycles = sorted(name for name in MODULES if name in reachable(name))
    assert not cycles, f"import cycles through {cycles} (lazy imports count)"


def test_the_one_way_order():
    assert imports("model") <= {"errors", "moe"}  # the transformer needs nothing of the rest but its MoE layer
    assert not imports("moe")
    for name in ("speculative", "quantize", "tp", "decode", "cpu_decode", "checkpoint", "convert"):
        assert "generate" not in reachable(name), name
    assert "convert" not in imports("checkpoint") | imports("generate", lazy=False) | imports("quantize", lazy=False)


def test_running_does_not_load_the_converters():
    code = "import sys, fastllama.generate, fastllama.eval; print('fastllama.convert' in sys.modules, 'gguf' in sys.modules)"
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.stdout.split() == ["False", "False"], run.stderr


def test_the_installed_library_is_one_name_beside_a_project_of_its_own(tmp_path):
    """A research project with a model.py of its own imports its model and ours, whatever its folder: the
    installation puts fastllama on the path, not model, tokenizer, eval, generate."""
    try:
        importlib.metadata.distribution("fastllama")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("fastllama is not installed (pip install -e .)")
    (tmp_path / "model.py").write_text("MINE = True\n")
    code = ("import importlib.util, model, fastllama.model, fastllama.generate\n"
            "print(model.MINE, fastllama.model.Transformer.__name__,\n"
            "      *(importlib.util.find_spec(n) is None for n in ('tokenizer', 'eval', 'generate', 'errors')))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # as a user's program runs: only the installation
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert run.stdout.split() == ["True", "Transformer", "True", "True", "True", "True"], run.stderr


def test_no_command_line_takes_a_flag_by_its_abbreviation():
    """allow_abbrev=False in every CLI's parser: --max_new_token is a typo to point out, not --max_new_tokens."""
    for path in [*MODULES.values(), *REPO.glob("scripts/*.py")]:  # the scripts at the top hold no parser
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "ArgumentParser":
                assert any(k.arg == "allow_abbrev" and getattr(k.value, "value", None) is False
                           for k in node.keywords), f"{path.name}:{node.lineno}"
