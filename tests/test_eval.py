"""eval.py's harness adapter: log-likelihoods equal HF transformers' on the same weights, ragged batches
equal requests alone, generation stops before the task's stop strings, the harness's own HF backend
scores the repo's multiple-choice task as ours does; bad input is one line."""

import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fastllama import eval as ev
from fastllama.errors import UserError
from fastllama.generate import generate, get_tokenizer
from fastllama.model import ModelArgs, Transformer

REPO = Path(__file__).resolve().parents[1]
CLOZE = REPO / "tasks" / "pydoc_cloze.yaml"
REQUESTS = [("The capital of France is", " Paris"), ("Water boils at", " 100 degrees Celsius at sea level."),
            ("Once upon a time, in a small village by the sea, there lived", " an old fisherman"),
            ("", "Hello world"), ("A list: apples, pears,  ", "plums"),
            # choices of one question: their prefix runs once, their other tokens in rows of their own
            ("Water boils at", " 90 degrees"), ("Water boils at", " room temperature, never"), ("Water boils at", " 3")]


def requests(pairs):
    return [SimpleNamespace(args=pair) for pair in pairs]


@pytest.fixture(scope="module")
def harness_model(model_fp32, bundled_checkpoint):
    return ev.HarnessModel(model_fp32, get_tokenizer(bundled_checkpoint), "bundled", batch_size=3)


def hf_logprob(hf, context: list[int], continuation: list[int], max_length: int) -> float:
    ids = (context + continuation)[-(max_length + 1):]
    with torch.no_grad():
        logprobs = hf(torch.tensor([ids[:-1]])).logits[0].float().log_softmax(-1)
    targets = torch.tensor(continuation)
    return logprobs[-len(continuation):].gather(-1, targets[:, None]).sum().item()


def test_loglikelihood_equals_hf_and_a_batch_equals_each_alone(harness_model, hf_model):
    ours = harness_model.loglikelihood(requests(REQUESTS))
    for pair, (logprob, _) in zip(REQUESTS, ours):
        context, continuation = harness_model.encode_pair(*pair)
        assert logprob == pytest.approx(hf_logprob(hf_model, context, continuation, 10**6), rel=1e-4, abs=1e-4)
        assert harness_model.loglikelihood(requests([pair]))[0][0] == pytest.approx(logprob, rel=1e-5, abs=1e-5)
    # a greedy continuation is flagged so, and a continuation that is not greedy is not
    context = "The capital of France is"
    greedy = harness_model.generate_until(requests([(context, {"until": ["\n"], "max_gen_toks": 3})]))[0]
    assert harness_model.loglikelihood(requests([(context, greedy), (context, " Berlin")]))[0][1] is True
    assert harness_model.loglikelihood(requests([(context, " Berlin")]))[0][1] is False
    # an empty continuation has probability 1, which greedy decoding gives, and leaves its batch as it was
    empty, berlin = harness_model.loglikelihood(requests([(context, ""), (context, " Berlin")]))
    assert empty == (0.0, True) and berlin == harness_model.loglikelihood(requests([(context, " Berlin")]))[0]


def test_scoring_and_generation_keep_keys_and_values_in_the_cache_dtype_asked_for(harness_model):
    int8 = ev.HarnessModel(harness_model.model, harness_model.tokenizer, "bundled", batch_size=3,
                           kv_cache_dtype=torch.int8)
    scaled = int8.loglikelihood(requests(REQUESTS[:3]))
    assert harness_model.model.layers[0].attention.kv_cache.k_cache.dtype == torch.int8
    full = harness_model.loglikelihood(requests(REQUESTS[:3]))
    for (logprob, _), (reference, _) in zip(scaled, full):
        assert logprob != reference and logprob == pytest.approx(reference, rel=0.05, abs=0.05)
    int8.generate_until(requests([("The capital of France is", {"until": ["\n"], "max_gen_toks": 3})]))
    assert harness_model.model.layers[0].attention.kv_cache.k_cache.dtype == torch.int8


def test_a_context_longer_than_the_model_keeps_its_end(harness_model, hf_model):
    """Truncated requests keep their last max_length tokens; choices of one question whose branches
    together pass max_length go in several rows."""
    long = ev.HarnessModel(harness_model.model, harness_model.tokenizer, "bundled", batch_size=2, max_length=24)
    choices = [" one two three four five six seven eight nine ten", " eleven twelve thirteen fourteen fifteen sixteen",
               " seventeen eighteen nineteen twenty twenty-one twenty-two"]
    pairs = [(" ".join(["word"] * 40) + " and then", " the end"), ("Short", " one")]
    pairs += [("Count with me:", choice) for choice in choices]
    encoded = [long.encode_pair(*pair) for pair in pairs]
    assert len(long.rows({tuple(encoded[2][0]): [(i, c) for i, (_, c) in enumerate(encoded[2:])]})) > 1
    for (context, continuation), (logprob, _) in zip(encoded, long.loglikelihood(requests(pairs))):
        assert logprob == pytest.approx(hf_logprob(hf_model, context, continuation, 24), rel=1e-4, abs=1e-4)


@torch.no_grad()
def test_the_head_a_few_rows_at_a_time_scores_as_all_at_once(monkeypatch):
    """Log-probabilities made a slice of rows at a time (HEAD_SLICE_BYTES: rows shared by several
    requests, and requests across slices) give the same scores and greedy flags as one slice."""
    torch.manual_seed(0)
    model = Transformer(ModelArgs(vocab_size=64, n_layer=2, dim=32, n_head=4, block_size=128)).eval()
    harness = ev.HarnessModel(model, SimpleNamespace(bos_id=0, eos_id=1), "tiny", batch_size=4)
    ids = torch.randint(2, 64, (60,)).tolist()
    greedy = generate(model, torch.tensor(ids[:10]), 5, temperature=0)[10:].tolist()
    pairs = [(ids[:10], greedy), (ids[:10], ids[20:23]), (ids[30:41], ids[41:42]), (ids[:5], ids[50:58])]
    whole = harness.score(pairs)
    monkeypatch.setitem(ev.HEAD_SLICE_BYTES, "cpu", 3 * 4 * 64)  # 3 rows a slice
    sliced = harness.score(pairs)
    assert [hit for _, hit in sliced] == [hit for _, hit in whole] == [True, False, False, False]
    assert [logprob for logprob, _ in sliced] == pytest.approx([logprob for logprob, _ in whole], rel=1e-6, abs=1e-6)


@pytest.mark.parametrize("sliding_window", [None, 16])
@torch.no_grad()
def test_compiled_scoring_is_one_graph_for_every_batch(sliding_window, monkeypatch):
    """HarnessModel(compile=True): batches of other lengths and row counts (the last one short, padded
    with empty rows) go through one graph, and score as the eager forward does. With a sliding window,
    rows longer than the window (no tree, causal by position) take a second one."""
    torch.manual_seed(0)
    model = Transformer(ModelArgs(vocab_size=64, n_layer=2, dim=32, n_head=4, n_local_heads=2, block_size=128,
                                  sliding_window=sliding_window, sliding_layers=[0])).eval()
    ids = torch.randint(2, 64, (200,)).tolist()
    pairs = [(ids[i: i + n], ids[i + n: i + n + m]) for i, (n, m) in enumerate(
        [(30, 1), (25, 1), (20, 3), (12, 1), (9, 2), (5, 1), (3, 1)])]
    pairs += [(ids[:12], [5]), (ids[:12], [7, 8])]  # choices of one question: one row
    graphs = []
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda f, **kwargs: real_compile(
        f, **kwargs, backend=lambda gm, inputs: graphs.append(gm) or gm))
    compiled = ev.HarnessModel(model, SimpleNamespace(bos_id=0, eos_id=1), "tiny", batch_size=3, compile=True)
    batches, make_batches = [], compiled.batches
    monkeypatch.setattr(compiled, "batches", lambda rows: batches.extend(make_batches(rows)) or batches)
    scores = compiled.score(pairs)
    assert len(graphs) == (2 if sliding_window else 1)
    assert len(batches) > 2 and min(len(batch) for batch in batches) < 3
    eager = ev.HarnessModel(model, SimpleNamespace(bos_id=0, eos_id=1), "tiny", batch_size=3)
    for (logprob, greedy), (expected, expected_greedy) in zip(scores, eager.score(pairs), strict=True):
        assert logprob == pytest.approx(expected, rel=1e-5, abs=1e-5) and greedy == expected_greedy


@torch.no_grad()
def test_ragged_requests_of_a_sliding_window_model_score_as_each_alone():
    """Prefixes whose lengths differ by more than a chunk: the short one's padding must not overwrite
    the keys its continuation still reads in the sliding-window ring."""
    torch.manual_seed(0)
    model = Transformer(ModelArgs(vocab_size=64, n_layer=2, dim=32, n_head=4, n_local_heads=2, block_size=512,
                                  sliding_window=4)).eval()
    harness = ev.HarnessModel(model, SimpleNamespace(bos_id=0, eos_id=1), "tiny", batch_size=2)
    ids = torch.randint(2, 64, (320,)).tolist()
    pairs = [(ids[:300], ids[300:304]), (ids[:10], ids[10:14])]
    batched = harness.score(pairs)
    for pair, (logprob, _) in zip(pairs, batched, strict=True):
        assert harness.score([pair])[0][0] == pytest.approx(logprob, rel=1e-5, abs=1e-5)


@torch.no_grad()
def test_choices_of_a_sliding_window_model_share_a_row_within_the_window():
    """Where a question and its choices fit in the window, they are one row (its rings mask as the
    tree does); a longer request has a row of its own; each scores as a plain forward over it."""
    torch.manual_seed(0)
    model = Transformer(ModelArgs(vocab_size=64, n_layer=3, dim=32, n_head=4, n_local_heads=2, block_size=512,
                                  sliding_window=16, sliding_layers=[0, 2])).eval()
    harness = ev.HarnessModel(model, SimpleNamespace(bos_id=0, eos_id=1), "tiny", batch_size=3)
    ids = torch.randint(2, 64, (80,)).tolist()
    question = ids[:6]
    pairs = [(question, ids[6 + 3 * i: 9 + 3 * i]) for i in range(3)]  # a row of 6 + 3 * 2 positions
    pairs += [(ids[:40], ids[40:44]), (ids[50:53], ids[53:55]), (ids[50:53], ids[60:61])]
    choices = [(i, continuation) for i, (_, continuation) in enumerate(pairs[:3])]
    assert [len(members) for _, members in harness.rows({tuple(question): choices})] == [3]  # 12 positions
    assert [len(members) for _, members in harness.rows({tuple(ids[:12]): choices})] == [2, 1]  # 16, then 14
    scored = harness.score(pairs)
    for (context, continuation), (logprob, _) in zip(pairs, scored, strict=True):
        tokens = torch.tensor([context + continuation])
        model.setup_caches(1, tokens.shape[1])
        logits = model(tokens[:, :-1], torch.arange(tokens.shape[1] - 1))[0].float().log_softmax(-1)
        expected = logits[-len(continuation):].gather(-1, torch.tensor(continuation)[:, None]).sum().item()
        assert logprob == pytest.approx(expected, rel=1e-5, abs=1e-5)


@torch.no_grad()
def test_perplexity_is_hf_transformers_loss_over_the_same_windows(harness_model, hf_model):
    """exp of HF's mean loss over the same windows of the bundled model's held-out text; an int8 KV
    cache moves it, a little."""
    from fastllama.quantize import python_docs_text

    tokens = torch.tensor(harness_model.tokenizer.encode(python_docs_text("held-out"))[:3 * 128 + 50])
    windows = tokens[: 3 * 128].view(3, 128)  # the 50 tokens past the last whole window are not scored
    expected = math.exp(hf_model(windows, labels=windows).loss.item())  # the mean over every window's 127
    ours = ev.perplexity(harness_model.model, tokens, seq_len=128, batch_size=2)
    assert ours == pytest.approx(expected, rel=1e-4)
    int8 = ev.perplexity(harness_model.model, tokens, seq_len=128, batch_size=2, kv_cache_dtype=torch.int8)
    assert int8 != ours and int8 == pytest.approx(ours, rel=0.02)


@torch.no_grad()
def test_perplexity_over_windows_that_do_not_fill_the_last_batch():
    torch.manual_seed(0)
    model = Transformer(ModelArgs(vocab_size=64, n_layer=2, dim=32, n_head=4, n_local_heads=2, block_size=64)).eval()
    tokens = torch.randint(0, 64, (3 * 16,))  # 3 windows of 16 in batches of 2
    assert ev.perplexity(model, tokens, seq_len=16, batch_size=2) == pytest.approx(
        ev.perplexity(model, tokens, seq_len=16, batch_size=1), rel=1e-5)
    with pytest.raises(ev.UserError, match="windows of 128 tokens exceed the model's context of 64"):
        ev.perplexity(model, torch.randint(0, 64, (300,)), seq_len=128)


@pytest.mark.usefixtures("bundled_checkpoint")  # the command line's default model
def test_the_perplexity_line_counts_the_tokens_it_scored():
    run = subprocess.run([sys.executable, "eval.py", "--max_tokens", "300", "--seq_len", "128", "--batch_size", "2"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "over 256 tokens in windows of 128 (the last 44, short of a window, not scored)" in run.stdout, run.stdout


def test_rolling_loglikelihood_predicts_every_token_once(harness_model, hf_model):
    pytest.importorskip("lm_eval")
    text = "The quick brown fox jumps over the lazy dog. " * 6
    ids = harness_model.tokenizer.encode(text)
    whole = hf_logprob(hf_model, [harness_model.prefix_token_id], ids, 10**6)
    windowed = ev.HarnessModel(harness_model.model, harness_model.tokenizer, "bundled", max_length=16)
    assert harness_model.loglikelihood_rolling(requests([(text,)]))[0] == pytest.approx(whole, rel=1e-4)
    scored, score = [], windowed.score
    windowed.score = lambda pairs: scored.extend(pairs) or score(pairs)
    total = windowed.loglikelihood_rolling(requests([(text,)]))[0]
    assert [t for _, continuation in scored for t in continuation] == ids  # each token once, in order
    assert all(len(context + continuation) <= 16 + 1 for context, continuation in scored)
    assert total == pytest.approx(sum(hf_logprob(hf_model, c, t, 16) for c, t in scored), rel=1e-4)
    assert total < whole  # less context


def test_generation_stops_before_stop_strings_of_several_tokens(harness_model):
    context = "Once upon a time, in a small village by the sea,"
    prompt = torch.tensor(harness_model.tokenizer.encode_prompt(context))
    output = generate(harness_model.model, prompt, 24, temperature=0)
    text = harness_model.tokenizer.decode(output[len(prompt):].tolist())
    words = text.split(" ")
    stop = " ".join(words[4:6])  # two words, several tokens, in the middle of the greedy text
    assert len(harness_model.tokenizer.encode(stop)) > 1
    settings = {"until": [stop, "never appears"], "max_gen_toks": 24}
    batch = harness_model.generate_until(requests([(context, settings), ("The capital of France is", settings)]))
    assert batch[0] == text[: text.index(stop)]
    assert harness_model.generate_until(requests([(context, settings)])) == batch[:1]


@pytest.mark.parametrize("settings, expected", [
    ({"until": ["\n"]}, (256, dict(temperature=0.0, top_k=None, top_p=None))),
    ({"temperature": 0.7}, (256, dict(temperature=0.7, top_k=50, top_p=None))),  # do_sample unsaid: sampled
    ({"do_sample": True}, (256, dict(temperature=1.0, top_k=50, top_p=None))),
    ({"do_sample": False, "temperature": 0.7}, (256, dict(temperature=0.0, top_k=None, top_p=None))),
    ({"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.9}, (256, dict(temperature=0.6, top_k=20, top_p=0.9))),
    ({"do_sample": True, "top_k": 0, "top_p": 1.0}, (256, dict(temperature=1.0, top_k=None, top_p=None))),  # none
    ({"max_new_tokens": 5, "max_tokens": 7}, (5, dict(temperature=0.0, top_k=None, top_p=None))),
    ({"max_gen_toks": 3, "max_new_tokens": 5}, (3, dict(temperature=0.0, top_k=None, top_p=None))),
])
def test_generation_settings_read_as_the_harness_reads_them(settings, expected):
    assert ev.generation_options(settings) == expected
    normalize = getattr(pytest.importorskip("lm_eval.models.utils"), "normalize_gen_kwargs", None)
    if normalize is not None:  # the harness's own reading, in the versions that have it
        normalized = normalize(settings)
        assert (normalized["max_gen_toks"], bool(normalized["do_sample"])) == (expected[0], expected[1]["temperature"] > 0)


def test_sampling_settings_as_transformers_generate_fills_them_in():
    """A sampled request's temperature, top_k and top_p: its own (a null filter: none, as a keyword
    argument to HF's generate), else the checkpoint's generation_config.json's, else transformers'
    defaults (what HF's generate fills in for the harness's HF backend)."""
    config = {"top_k": 20, "top_p": 0.8, "temperature": 0.6}
    assert ev.generation_options({"temperature": 0.7}, config)[1] == dict(temperature=0.7, top_k=20, top_p=0.8)
    assert ev.generation_options({"temperature": 0.7, "top_k": 5}, config)[1] == dict(temperature=0.7, top_k=5, top_p=0.8)
    assert ev.generation_options({"temperature": 0.7}, {"top_k": None})[1]["top_k"] == 50  # null there: the default
    assert ev.generation_options({"temperature": 0.7, "top_k": None}, config)[1]["top_k"] is None  # in the request: none
    assert ev.generation_options({}, config)[1] == dict(temperature=0.0, top_k=None, top_p=None)  # greedy: no filters
    assert ev.generation_options({"do_sample": True}, config)[1] == dict(temperature=0.6, top_k=20, top_p=0.8)
    assert ev.generation_options({"do_sample": True}, {"temperature": None})[1]["temperature"] == 1.0
    # a null temperature is unsaid (the harness's own normalize_gen_kwargs fails on it, older versions pass it on)
    assert ev.generation_options({"do_sample": True, "temperature": None}, config)[1]["temperature"] == 0.6
    assert ev.generation_options({"temperature": None}, config)[1]["temperature"] == 0.0
    defaults = getattr(pytest.importorskip("transformers").GenerationConfig, "_get_default_generation_params", None)
    if defaults is not None:  # where transformers keeps its defaults apart (5.x)
        assert {name: defaults()[name] for name in ev.HF_FILTERS} == ev.HF_FILTERS


def test_a_task_asking_for_more_tokens_than_the_context_is_one_line(harness_model):
    short = ev.HarnessModel(harness_model.model, harness_model.tokenizer, "bundled", batch_size=1, max_length=64)
    with pytest.raises(UserError, match="a task asks for 64 new tokens, but a request may take 64 positions in all"):
        short.generate_until(requests([("The capital of France is", {"until": ["\n"], "max_gen_toks": 64})]))


def test_the_harness_hf_backend_scores_the_local_task_as_ours(harness_model, hf_model, hf_tokenizer):
    pytest.importorskip("lm_eval")
    from lm_eval.models.huggingface import HFLM

    ours = ev.evaluate_tasks(harness_model, str(CLOZE), limit=40)["results"]["pydoc_cloze"]
    theirs = ev.evaluate_tasks(HFLM(pretrained=hf_model, tokenizer=hf_tokenizer, batch_size=8), str(CLOZE),
                               limit=40)["results"]["pydoc_cloze"]
    assert ours["acc,none"] == theirs["acc,none"] and ours["acc_norm,none"] == theirs["acc_norm,none"]
    assert ours["acc,none"] > 0.4  # four choices: chance is 0.25


def cli(*argv, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "eval.py", *argv], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=env)


@pytest.mark.usefixtures("bundled_checkpoint")
def test_bad_tasks_are_one_line(tmp_path):
    pytest.importorskip("lm_eval")
    broken, nameless = tmp_path / "broken.yaml", tmp_path / "nameless.yaml"
    broken.write_text("task: [unclosed\n")
    nameless.write_text("dataset_path: json\n")
    for argv, message in [(["--tasks", "no_such_task_anywhere"], "unknown task(s) no_such_task_anywhere"),
                          (["--tasks", str(broken)], "does not parse as YAML"),
                          (["--tasks", str(nameless)], "is not a harness task (it names no `task:`)"),
                          (["--tasks", str(tmp_path / "missing.yaml")], "no task file at")]:
        run = cli(*argv, "--limit", "2")
        assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr[-2000:]
        assert run.stderr.strip().splitlines()[-1].startswith("error: ") and message in run.stderr, run.stderr


@pytest.mark.usefixtures("bundled_checkpoint")  # --device is checked as the model loads
@pytest.mark.parametrize("argv, message", [
    (["--seq_len", "1"], "--seq_len must be at least 2 (a window's first token predicts the next)"),
    (["--batch_size", "0"], "--batch_size must be at least 1"),
    (["--tasks", str(CLOZE), "--output", "missing/results.json"], "--output missing/results.json: its folder does not exist"),
    (["--device", "foo"], "--device foo is not a device PyTorch knows: cpu, cuda or cuda:N, for example"),
])
def test_bad_arguments_are_one_line(argv, message):
    run = cli(*argv)
    assert run.returncode == 1 and run.stderr.strip() == f"error: {message}", run.stderr[-2000:]


def test_tasks_without_the_harness_say_what_to_install(tmp_path):
    (tmp_path / "lm_eval").mkdir()  # an installation without the harness
    (tmp_path / "lm_eval" / "__init__.py").write_text('raise ImportError("not installed")\n')
    run = cli("--tasks", str(CLOZE), env=dict(os.environ, PYTHONPATH=str(tmp_path)))
    assert run.returncode == 1 and run.stderr.strip() == \
        "error: --tasks needs EleutherAI's lm-evaluation-harness: pip install -e '.[eval]'"
