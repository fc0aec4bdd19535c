"""The trained draft head: the training script on a tiny model and a short text (its loss goes down,
the saved head loads and drafts), exact greedy output with it, and its one-line errors."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastllama import quantize, speculative
from fastllama.checkpoint import CHECKPOINT_NAME, CONFIG_NAME, read_safetensors, single, write_safetensors
from fastllama.errors import UserError
from fastllama.generate import generate, get_tokenizer, load_model
from fastllama.model import ModelArgs, Transformer
from fastllama.quantize import python_docs_text
from fastllama.speculative import HEAD_NAME, DraftHead, HeadDrafter
from fastllama.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import train_draft_head  # noqa: E402


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory, bundled_checkpoint) -> Path:
    """A 2-layer model with random weights and the bundled model's tokenizer, as a checkpoint."""
    directory = tmp_path_factory.mktemp("tiny")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(bundled_checkpoint.parent / name, directory / name)
    config = ModelArgs(vocab_size=49152, n_layer=2, n_head=4, n_local_heads=2, dim=64, intermediate_size=128,
                       block_size=512)
    (directory / CONFIG_NAME).write_text(json.dumps(config.__dict__))
    torch.manual_seed(0)
    state = Transformer(config).state_dict()
    write_safetensors(directory / CHECKPOINT_NAME, [single(n, t.dtype, t.shape, lambda t=t: t) for n, t in state.items()])
    return directory / CHECKPOINT_NAME


@pytest.fixture(scope="module")
def trained(tiny_checkpoint, tmp_path_factory):
    text = tmp_path_factory.mktemp("text") / "text.txt"
    text.write_text(python_docs_text("calibration")[:30000])
    args = train_draft_head.parse_args(["--checkpoint_path", str(tiny_checkpoint), "--text", str(text),
                                        "--window", "64", "--batch_size", "4", "--epochs", "4", "--vocab", "1024",
                                        "--lr", "3e-3", "--precision", "fp32", "--own_answers", "1000",
                                        "--max_windows", "110"])
    return train_draft_head.train(args)


def test_own_answers_are_the_targets_chats_on_prompts_made_from_the_text(tiny_checkpoint):
    target, tokenizer = load_model(tiny_checkpoint, "cpu", "fp32"), get_tokenizer(tiny_checkpoint)
    text = python_docs_text("calibration")[:30000]
    chats = train_draft_head.own_answers(target, tokenizer, text, 300, batch=3, max_new_tokens=8)
    again = train_draft_head.own_answers(target, tokenizer, text, 300, batch=3, max_new_tokens=8)
    assert sum(map(len, chats)) >= 300 and all(map(torch.equal, chats, again))  # seeded: the same chats
    few = train_draft_head.own_answers(target, tokenizer, text, 20, batch=8, max_new_tokens=8)
    assert len(few) == 3  # not a whole batch of 8 for 20 tokens
    templates = [t.split("{")[0] for t in train_draft_head.OWN_PROMPTS]
    for chat in chats:  # a prompt made from a template, then at most 8 tokens of answer
        asked = tokenizer.decode(chat.tolist()).split("\nuser\n")[1]
        assert any(asked.startswith(t) for t in templates), asked
        prompt = tokenizer.encode_prompt(asked.rsplit("\nassistant\n", 1)[0], chat=True)
        assert chat[: len(prompt)].tolist() == prompt and len(chat) <= len(prompt) + 8


def test_training_lowers_the_loss_and_saves_a_head_that_loads(trained, tiny_checkpoint):
    history = trained
    tenth = max(1, len(history) // 10)
    first, last = sum(history[:tenth]) / tenth, sum(history[-tenth:]) / tenth
    assert last < 0.8 * first, (first, last)
    target = load_model(tiny_checkpoint, "cpu", "fp32")
    head = speculative.load_head(tiny_checkpoint.parent / speculative.HEAD_NAME, target)
    assert head.config.n_layer == 1 and len(head.vocab) == 1024 and head.fc.weight.dtype == torch.float32


@pytest.mark.parametrize("k, alternatives", [(1, 0), (4, 0), (3, 2)])
def test_greedy_with_the_trained_head_is_plain_greedy(trained, tiny_checkpoint, k, alternatives):
    target = load_model(tiny_checkpoint, "cpu", "fp32")
    head = speculative.load_head(tiny_checkpoint.parent / speculative.HEAD_NAME, target)
    tokenizer = get_tokenizer(tiny_checkpoint)
    prompts = [torch.tensor(tokenizer.encode(t)) for t in ("The built-in function", "Each object has an identity, a")]
    for batch in ([prompts[0]], prompts):
        plain = generate(target, batch, 20, temperature=0)
        stats = {}
        spec = generate(target, batch, 20, temperature=0, drafter=HeadDrafter(head, alternatives), speculate_k=k,
                        stats=stats)
        assert [s.tolist() for s in spec] == [p.tolist() for p in plain]
        assert sum(stats["accepted_counts"]) > 0 and stats["plain_steps"] == 0


def test_greedy_with_a_head_on_the_bundled_model_is_plain_greedy(model_fp32, bundled_checkpoint):
    """A random head on the real model: it drafts nonsense, and the output is still the target's."""
    torch.manual_seed(0)
    vocab = torch.randperm(model_fp32.config.vocab_size)[:4096].sort().values
    head = DraftHead(DraftHead.config_for(model_fp32.config, 4096), vocab).eval()
    tokenizer = get_tokenizer(bundled_checkpoint)
    prompts = [torch.tensor(tokenizer.encode(t)) for t in ("Once upon a time,", "def add(a, b):\n    return")]
    plain = generate(model_fp32, prompts, 16, temperature=0)
    for alternatives in (0, 2):
        spec = generate(model_fp32, prompts, 16, temperature=0, drafter=HeadDrafter(head, alternatives), speculate_k=3)
        assert [s.tolist() for s in spec] == [p.tolist() for p in plain]


def test_a_head_for_another_model_or_none_is_one_line(trained, tiny_checkpoint, model_fp32, tmp_path):
    path = tiny_checkpoint.parent / speculative.HEAD_NAME
    with pytest.raises(UserError, match="was trained for a model with"):
        speculative.load_head(path, model_fp32)
    with pytest.raises(UserError, match="no draft head at .*train_draft_head.py"):
        speculative.load_head(tmp_path / "nothing.safetensors", model_fp32)
    with pytest.raises(UserError, match="is not a draft head"):
        speculative.load_head(tiny_checkpoint, model_fp32)
    tensors, metadata = read_safetensors(path)
    config = json.loads(metadata["draft_head"])
    groups = [single(n, t.dtype, t.shape, lambda t=t: t) for n, t in tensors.items()]
    write_safetensors(tmp_path / "other.safetensors", groups, {**metadata, "draft_head": json.dumps({**config, "later": 1})})
    with pytest.raises(UserError, match="is not a draft head this version reads"):
        speculative.load_head(tmp_path / "other.safetensors", model_fp32)
    shutil.copytree(tiny_checkpoint.parent, tmp_path / "copy")
    (tmp_path / "copy" / speculative.HEAD_NAME).unlink()
    result = subprocess.run([sys.executable, "generate.py", "--checkpoint_path", str(tmp_path / "copy" / CHECKPOINT_NAME),
                             "--draft", "head", "--prompt", "hi", "--max_new_tokens", "4"],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "no draft head at" in result.stderr and "train_draft_head.py" in result.stderr


def test_bad_training_arguments_are_one_line(tiny_checkpoint, tmp_path, monkeypatch):
    """Refused before the target writes or reads anything where the arguments tell, else as soon as the
    text or the model does."""
    for argv, message in ((["--max_windows", "8"], "--max_windows 8 leaves fewer than --batch_size 8 windows"),
                          (["--epochs", "0"], "--epochs must be at least 1"),
                          (["--window", "1"], "--window must be at least 2"),
                          (["--minutes", "0"], "--minutes must be more than 0"),
                          (["--output", str(tmp_path / "missing" / "h.safetensors")],
                           f"--output {tmp_path / 'missing' / 'h.safetensors'}: its folder does not exist")):
        with pytest.raises(SystemExit) as exit:
            train_draft_head.parse_args(argv)
        assert exit.value.code.startswith(f"error: {message}")
    assert train_draft_head.parse_args(["--output", str(tmp_path)]).output == tmp_path / HEAD_NAME  # a folder
    text = tmp_path / "text.txt"
    text.write_text(python_docs_text("calibration")[:1500])  # 5 windows of 64 tokens
    args = train_draft_head.parse_args(["--checkpoint_path", str(tiny_checkpoint), "--text", str(text),
                                        "--window", "64", "--precision", "fp32", "--own_answers", "0"])
    with pytest.raises(UserError, match="5 windows of 64 tokens leave fewer than --batch_size 8 to train on"):
        train_draft_head.train(args)
    args.window = 1024
    with pytest.raises(UserError, match="--window 1024 is longer than the model's context, 512"):
        train_draft_head.train(args)
    monkeypatch.setattr(Tokenizer, "can_chat", property(lambda self: False))  # a model without a chat format
    args = train_draft_head.parse_args(["--checkpoint_path", str(tiny_checkpoint), "--precision", "fp32"])
    with pytest.raises(UserError, match="no chat template, so it cannot write its own chats to train on: pass "
                                        "--own_answers 0"):
        train_draft_head.train(args)
    int8 = quantize.quantize(tiny_checkpoint, "int8", output=tiny_checkpoint.parent / "fastllama_int8.safetensors")
    args = train_draft_head.parse_args(["--checkpoint_path", str(int8), "--text", str(text), "--precision", "fp32"])
    with pytest.raises(UserError, match="is quantized: train the head on the checkpoint it was quantized from"):
        train_draft_head.train(args)


def test_two_drafters_on_the_command_line_are_refused():
    from fastllama.generate import parse_args

    assert parse_args(["--draft", "head", "--draft_head", "h.safetensors"]).draft_head == Path("h.safetensors")
    for argv in (["--draft", "prompt-lookup", "--draft_head", "h"], ["--draft_checkpoint_path", "d", "--draft", "head"]):
        with pytest.raises(SystemExit) as exit:
            parse_args(argv)
        assert exit.value.code.startswith("error: ") and "name different drafters" in exit.value.code


def test_each_first_draft_is_what_the_head_predicts_over_the_whole_text(trained, tiny_checkpoint, monkeypatch):
    """In the loop, the head's first draft of a round at text length L is its prediction at position
    L - 1 when it reads the whole final text with the target's states (as in training): the loop
    pairs each state with its token, and rejected drafts leave nothing behind in the head's cache.
    The verify step keeps 0, 1, 2, 3 drafts in turn, whatever the target says (a random head's drafts
    are never the target's), and the text is what was kept."""
    target = load_model(tiny_checkpoint, "cpu", "fp32")
    head = speculative.load_head(tiny_checkpoint.parent / speculative.HEAD_NAME, target)
    prompt = torch.tensor(get_tokenizer(tiny_checkpoint).encode("Each object has an identity, a"))
    rounds = iter(range(1000))

    def keep_in_turn(logits, drafts, alternatives=None):
        n = torch.full_like(drafts[:, 0], next(rounds) % (drafts.shape[1] + 1))
        return n, logits.argmax(-1).gather(1, n[:, None])[:, 0], n

    monkeypatch.setattr(speculative, "accept_greedy", keep_in_turn)
    drafter, first_drafts = HeadDrafter(head), []
    propose = drafter.propose

    def recording(tokens, lengths, k, **sampling):
        drafts, probs = propose(tokens, lengths, k, **sampling)
        first_drafts.append((int(lengths[0]), int(drafts[0, 0])))
        return drafts, probs

    drafter.propose = recording
    text = generate(target, [prompt], 40, temperature=0, drafter=drafter, speculate_k=3)[0]
    with torch.no_grad():
        target.setup_caches(1, len(text))
        states = target.hidden_states(text[None], torch.arange(len(text))[None])
        head.setup_caches(1, len(text))
        logits, _ = head(target, text[None, 1:], states[:, :-1], torch.arange(1, len(text))[None])
    predicted = head.vocab[logits[0].argmax(-1)]  # predicted[i]: the token after position i + 1
    assert len(first_drafts) > 10
    assert [draft for _, draft in first_drafts] == [int(predicted[length - 2]) for length, _ in first_drafts]
