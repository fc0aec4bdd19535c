"""Generation: batches, compiled decoding, sampling, and what the CLI says to bad input."""

import io
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fastllama import cpu_decode, decode, generate as gen, model
from fastllama.checkpoint import CONFIG_NAME
from fastllama.decode import logits_to_probs, sample
from fastllama.errors import UserError, run_cli
from fastllama.generate import generate, get_tokenizer, load_model
from fastllama.model import ModelArgs, Transformer

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["The capital of France is", "Water boils at", "Once upon a time, in a small village by the sea,"]


def encode(checkpoint, texts):
    tokenizer = get_tokenizer(checkpoint)
    return [torch.tensor(tokenizer.encode(t)) for t in texts]


def test_batch_of_different_prompts_equals_each_alone(model_fp32, bundled_checkpoint):
    prompts = encode(bundled_checkpoint, PROMPTS)
    assert len({len(p) for p in prompts}) == len(prompts)
    batch = generate(model_fp32, prompts, 16, temperature=0)
    for prompt, row in zip(prompts, batch):
        alone = generate(model_fp32, prompt, 16, temperature=0)
        assert row.tolist() == alone.tolist()
        assert row[: len(prompt)].tolist() == prompt.tolist()


def test_per_row_positions_match_each_row_alone(model_fp32):
    """forward with input_pos (B, T), the rows at different positions, equals each row run alone."""
    ids = torch.randint(0, 1000, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model_fp32.setup_caches(1, 64)
        alone = [model_fp32(ids[r: r + 1], torch.arange(6))[0] for r in range(2)]
        model_fp32.setup_caches(2, 64)
        model_fp32(ids[:, :3], torch.arange(3))
        # row 0 goes on at positions 3..5; row 1 rewrites 1..2 with the same tokens and goes on to 3
        positions = torch.tensor([[3, 4, 5], [1, 2, 3]])
        per_row = model_fp32(ids.gather(1, positions), positions)
    # fp32, summed over other splits of the sequence: equal up to rounding
    torch.testing.assert_close(per_row[0], alone[0][3:6], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(per_row[1], alone[1][1:4], atol=2e-4, rtol=1e-4)


def test_compiled_decode_equals_eager(bundled_checkpoint):
    model = load_model(bundled_checkpoint, "cpu", "bf16")
    prompt = encode(bundled_checkpoint, PROMPTS[2:])[0]
    eager = generate(model, prompt, 24, temperature=0)
    assert type(model.output) is cpu_decode.FewRowLinear  # load_model gave the model its CPU forms
    steps = gen.compiled_steps()
    assert gen.compiled_steps(dynamic_prefill=False) is steps  # as a benchmark's second rung asks: compiled already
    compiled = generate(model, prompt, 24, temperature=0, steps=steps)
    assert compiled.tolist() == eager.tolist()
    # a second call reuses the compiled graph and the cache
    assert generate(model, prompt, 24, temperature=0, steps=steps).tolist() == eager.tolist()


@torch.no_grad()
def test_compiled_steps_leave_decode_plain_and_give_eager_tokens():
    """generate.compiled_steps() is a value and rebinds nothing: decode's functions stay the plain ones (what
    `from fastllama.decode import decode_one_token` reads is what runs), and generate() runs the compiled steps only
    when given them, with the default's tokens (a tiny random model, fp32)."""
    plain = decode.decode_one_token
    steps = gen.compiled_steps()
    assert decode.decode_one_token is plain and decode.EAGER.decode_one_token is plain
    assert steps.decode_one_token is not plain
    torch.manual_seed(0)
    model = Transformer(ModelArgs(vocab_size=64, n_layer=2, n_head=4, n_local_heads=2, dim=32, block_size=128)).eval()
    cpu_decode.apply(model)  # as load_model gives it
    prompt = torch.randint(0, 64, (7,))
    eager = generate(model, prompt, 6, temperature=0)
    assert generate(model, prompt, 6, temperature=0, steps=steps).tolist() == eager.tolist()


@torch.no_grad()
def test_compiled_steps_see_what_changed_in_the_model_since_their_last_call():
    """However dynamo checks its guards (by dict tags from Python 3.12 on, as compiled_steps sets it), a
    change to the model between calls reaches the compiled step: a layer's attribute the graph took as a
    constant, a weight put in another's place, and caches made anew in another format. After each change the
    compiled steps give the eager tokens (the first two changes change them)."""
    steps = gen.compiled_steps()
    torch.manual_seed(0)
    model = Transformer(ModelArgs(vocab_size=64, n_layer=2, n_head=4, n_local_heads=2, dim=32, block_size=128)).eval()
    cpu_decode.apply(model)
    prompt = torch.randint(0, 64, (7,))

    def tokens(kv_cache_dtype=None):
        eager = generate(model, prompt, 12, temperature=0, kv_cache_dtype=kv_cache_dtype)
        compiled = generate(model, prompt, 12, temperature=0, kv_cache_dtype=kv_cache_dtype, steps=steps)
        assert compiled.tolist() == eager.tolist()
        return eager.tolist()

    seen = [tokens()]
    for layer in model.layers:  # Gemma's form of the norm, x scaled by 1 + weight: a constant in the graph
        layer.attention_norm.offset = layer.ffn_norm.offset = 1.0
    seen.append(tokens())
    w2 = model.layers[1].feed_forward.w2
    w2.weight = torch.nn.Parameter(w2.weight * -4, requires_grad=False)
    seen.append(tokens())
    assert seen[0] != seen[1] != seen[2]
    tokens(torch.int8)  # new cache modules, holding int8 levels and their scales


@torch.no_grad()
def test_chunked_prefill_equals_one_forward(model_fp32):
    """Prompts prefilled 8 positions a forward (3 forwards for 17: 8, 7 and 2, since a last chunk of
    one position takes one more) leave the logits and the cache of one forward over all of them (fp32),
    with rows ending before, on and after chunk boundaries."""
    lengths = torch.tensor([7, 8, 9, 17])
    idx = torch.randint(0, 1000, (4, 17), generator=torch.Generator().manual_seed(0))
    forwards = []
    counted = decode.Steps(prefill_chunk=lambda model, ids, *args: forwards.append(ids.shape[1]) or
                           decode.prefill_chunk(model, ids, *args))
    results = []
    for chunk in (8, 64):
        model_fp32.setup_caches(4, 64, chunk)
        logits = decode.prefill_logits(model_fp32, idx, lengths, counted)
        caches = [layer.attention.kv_cache.k_cache.clone() for layer in model_fp32.layers[::10]]
        results.append((logits, [[c[row, :, :n] for row, n in enumerate(lengths)] for c in caches]))
    (chunked, chunked_caches), (whole, whole_caches) = results
    assert forwards == [8, 7, 2, 17]
    assert ((chunked - whole).abs().max() / whole.abs().max()).item() <= 1e-5
    for chunked_rows, whole_rows in zip(chunked_caches, whole_caches):
        for a, b in zip(chunked_rows, whole_rows):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attention_softcap", [None, 50.0])  # soft-capped scores: attention written out
def test_compiled_prefill_compiles_once_for_prompts_of_any_length(attention_softcap):
    """compiled_steps(dynamic_prefill=True) compiles prefill's forward of one chunk with dynamic
    shapes: prompts of several lengths, each filled in chunks, share one graph, chunks of a few rows
    (which one-row products and verify attention treat apart when their count is static) included, and
    prompts of one token and last chunks of one position (a dynamic size of 1 would be specialized: a
    second graph), plain and speculative."""
    from fastllama import cpu_decode, speculative
    from fastllama.model import ModelArgs, Transformer

    model = Transformer(ModelArgs(vocab_size=64, n_layer=2, dim=32, n_head=4, n_local_heads=2, block_size=128,
                                  attention_softcap=attention_softcap))
    cpu_decode.apply(model.eval())  # as load_model does
    graphs = []
    steps = decode.Steps(prefill_chunk=torch.compile(  # as compiled_steps(dynamic_prefill=True)'s, graphs counted
        decode.prefill_chunk, fullgraph=True, dynamic=True, backend=lambda gm, inputs: graphs.append(gm) or gm))
    lengths = (1, 10, 13, 17, 20, 30, 33, 40)  # chunks of 16, and last chunks of 1 to 14
    drafters = (None, speculative.PromptLookup())
    outputs = [generate(model, torch.arange(n) % 64, 3, temperature=0, prefill_chunk=16, drafter=drafter, steps=steps)
               for n in lengths for drafter in drafters]
    assert len(graphs) == 1
    assert [o.tolist() for o in outputs] == [generate(model, torch.arange(n) % 64, 3, temperature=0, prefill_chunk=16,
                                                      drafter=drafter).tolist() for n in lengths for drafter in drafters]


@torch.no_grad()
def test_int8_kv_cache_stays_near_the_full_precision_one(model_fp32, bundled_checkpoint):
    """An int8 cache (a scale per token and head) against fp32's: logits over a prefill and 32 decode
    steps within 5% of the largest logit (measured: 2.8%), and the same greedy 64 tokens on a prompt
    whose greedy path has clear margins, in bf16."""
    prompt = encode(bundled_checkpoint, ["The capital of France is"])[0]
    text = torch.cat([prompt, generate(model_fp32, prompt, 32, temperature=0)[len(prompt):]])
    logits = {}
    for dtype in (None, torch.int8):
        model_fp32.setup_caches(1, 64, kv_cache_dtype=dtype)
        steps = [model_fp32(text[None, : len(prompt)], torch.arange(len(prompt)))[0]]
        steps += [model_fp32(text[None, t: t + 1], torch.tensor([t]))[0] for t in range(len(prompt), len(text))]
        logits[dtype] = torch.cat(steps)
    error = ((logits[torch.int8] - logits[None]).abs().amax(-1) / logits[None].abs().amax(-1)).max().item()
    assert error <= 5e-2, error
    from fastllama import speculative  # verify steps write and read the int8 cache as single steps do

    plain = generate(model_fp32, text, 24, temperature=0, kv_cache_dtype=torch.int8)
    assert generate(model_fp32, text, 24, temperature=0, kv_cache_dtype=torch.int8,
                    drafter=speculative.PromptLookup()).tolist() == plain.tolist()
    model = load_model(bundled_checkpoint, "cpu", "bf16")
    prompt = encode(bundled_checkpoint, ["1, 2, 3, 4, 5, 6, 7,"])[0]
    assert (generate(model, prompt, 64, temperature=0, kv_cache_dtype=torch.int8).tolist()
            == generate(model, prompt, 64, temperature=0).tolist())


def test_a_stop_token_ends_the_answer(model_fp32, bundled_checkpoint):
    tokenizer = get_tokenizer(bundled_checkpoint)
    prompt = torch.tensor(tokenizer.encode_prompt("What is 2+2?", chat=True))
    full = generate(model_fp32, prompt, 64, temperature=0)
    stopped = generate(model_fp32, prompt, 64, temperature=0, stop_ids=tokenizer.stop_ids)
    new = stopped[len(prompt):].tolist()
    assert new[-1] in tokenizer.stop_ids and not set(new[:-1]) & set(tokenizer.stop_ids)
    assert full[: len(stopped)].tolist() == stopped.tolist()


def test_sampling_filters():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    assert sample(logits, temperature=0).item() == 0
    probs = logits_to_probs(logits, temperature=1.0, top_k=2)
    assert (probs[0, 2:] == 0).all() and probs[0, :2].sum().item() == pytest.approx(1.0)
    full = logits.softmax(-1)[0]
    # nucleus: the smallest prefix of the sorted tokens whose mass reaches top_p
    probs = logits_to_probs(logits, temperature=1.0, top_p=float(full[:2].sum()) + 1e-3)
    assert (probs[0, :3] > 0).all() and (probs[0, 3:] == 0).all()
    probs = logits_to_probs(logits, temperature=1.0, top_p=1e-6)
    assert probs[0, 0] == 1.0
    for greedy in (logits_to_probs(logits, temperature=1.0, top_p=0.0), logits_to_probs(logits, temperature=0.0)):
        assert greedy[0].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]  # no NaN: the top token always stays


def test_a_tiny_temperature_is_greedy():
    near_tie = torch.tensor([[2.0, 2.0 - 4e-7, -1.0]]).repeat(4000, 1)
    assert (sample(near_tie, temperature=1e-9) == 0).all()  # not the ~52/48 a clamped temperature gives


def test_a_filtered_token_is_never_drawn(monkeypatch):
    """argmax(p / Exp(1)) with an exponential draw of exactly 0: 0 / 0 must not make a NaN that argmax picks."""
    monkeypatch.setattr(torch.Tensor, "exponential_", lambda self, *args, **kwargs: self.zero_())
    probs = torch.tensor([[0.0, 0.3, 0.0, 0.7]])
    assert decode.sample_from(probs).item() in (1, 3)


def test_sampling_follows_the_distribution():
    torch.manual_seed(0)
    logits = torch.tensor([[1.0, 0.0, -1.0, 2.0]]).repeat(20000, 1)
    counts = torch.bincount(sample(logits, temperature=1.0)[:, 0], minlength=4).float()
    torch.testing.assert_close(counts / counts.sum(), logits[0].softmax(-1), atol=0.015, rtol=0)


def test_seeded_sampling_is_reproducible(model_fp32, bundled_checkpoint):
    prompt = encode(bundled_checkpoint, PROMPTS[:1])[0]
    outs = []
    for _ in range(2):
        torch.manual_seed(123)
        outs.append(generate(model_fp32, prompt, 12, temperature=0.8, top_k=50, top_p=0.95).tolist())
    assert outs[0] == outs[1]


def test_streamed_tokens_are_each_rows_text_and_end_at_its_stop(model_fp32, bundled_checkpoint):
    """callback sees every row's new tokens up to and including its stop token, and nothing after:
    not the tokens a finished row keeps decoding while the batch goes on."""
    tokenizer = get_tokenizer(bundled_checkpoint)
    prompts = [torch.tensor(tokenizer.encode_prompt(q, chat=True)) for q in ("What is 2+2?", "Name a color.",
                                                                                "Write a long poem about the sea.")]
    streamed = [[] for _ in prompts]

    def callback(rows):
        for seen, new in zip(streamed, rows):
            seen.extend(new)

    outputs = generate(model_fp32, prompts, 40, temperature=0, stop_ids=tokenizer.stop_ids, callback=callback)
    for prompt, output, seen in zip(prompts, outputs, streamed):
        assert seen == output[len(prompt):].tolist()
    ended = [seen[-1] in tokenizer.stop_ids for seen in streamed]
    assert ended[0] and not ended[2]  # one short answer ended early while the poem went on


def test_generate_rejects_bad_arguments(model_fp32):
    prompt = torch.tensor([1, 2, 3])
    for kwargs, message in [(dict(temperature=-1.0), "temperature"), (dict(temperature=float("nan")), "got nan"),
                            (dict(top_p=1.5), "top_p"),
                            (dict(top_k=0), "top_k"), (dict(prefill_chunk=0), "prefill chunk must be at least 1"),
                            (dict(kv_cache_dtype=torch.float8_e4m3fn), "fp8 KV cache needs a GPU"),
                            (dict(kv_cache_dtype=torch.int16), "KV cache of torch.int16 is not supported")]:
        with pytest.raises(UserError, match=message):
            generate(model_fp32, prompt, 4, **kwargs)
    for bad in (torch.tensor([], dtype=torch.long), [1, 2, 3]):  # empty; token ids not in a tensor
        with pytest.raises(UserError, match="non-empty 1-D tensor"):
            generate(model_fp32, bad, 4)
    with pytest.raises(UserError, match="outside this model's vocabulary"):
        generate(model_fp32, [prompt, torch.tensor([model_fp32.config.vocab_size])], 4)
    with pytest.raises(UserError, match="unknown precision 'bfloat16'"):
        load_model(None, "cpu", "bfloat16")
    with pytest.raises(UserError, match="context length"):
        generate(model_fp32, prompt, model_fp32.config.block_size)


def test_caches_are_made_anew_for_a_new_dtype_or_outside_inference_mode():
    """Caches kept from an earlier call are not reused when the model's dtype changed since (model.to)
    or when they were made under torch.inference_mode (inference tensors no later call may write)."""
    torch.manual_seed(0)
    model = Transformer(ModelArgs(vocab_size=64, n_layer=2, n_head=4, dim=32, block_size=256)).eval()
    prompt = torch.randint(0, 64, (10,))
    with torch.inference_mode():
        first = generate(model, prompt, 5, temperature=0)
    assert generate(model, prompt, 5, temperature=0).tolist() == first.tolist()
    model.to(torch.bfloat16)
    assert len(generate(model, prompt, 5, temperature=0)) == 15


# ---------------------------------------------------------------------------------------------
# The CLI: one line, exit code != 0, no traceback


def cli_error(argv) -> str:
    with pytest.raises(SystemExit) as exc:
        run_cli(gen.main, gen.parse_args(argv))
    assert isinstance(exc.value.code, str) and exc.value.code.startswith("error: ")
    assert "\n" not in exc.value.code
    return exc.value.code


def test_cli_errors_are_one_line(tmp_path, bundled_checkpoint):
    assert "no checkpoint at" in cli_error(["--checkpoint_path", str(tmp_path / "missing.safetensors")])
    (tmp_path / "model.safetensors").write_bytes(bundled_checkpoint.read_bytes()[:1000])
    assert f"{CONFIG_NAME} is missing" in cli_error(["--checkpoint_path", str(tmp_path / "model.safetensors")])
    (tmp_path / CONFIG_NAME).write_text((bundled_checkpoint.parent / CONFIG_NAME).read_text())
    assert "not a readable safetensors file" in cli_error(["--checkpoint_path", str(tmp_path / "model.safetensors")])
    assert "prompt is empty" in cli_error(["--prompt", ""])
    assert "context length" in cli_error(["--prompt", "hi " * 9000, "--max_new_tokens", "10"])
    assert "batch_size" in cli_error(["--batch_size", "0"])
    assert "fp8 KV cache needs a GPU with fp8" in cli_error(["--kv_cache_dtype", "fp8", "--device", "cpu"])
    assert "temperature" in cli_error(["--temperature", "-0.5", "--max_new_tokens", "2"])
    assert "--temperature must be a number >= 0, got nan" in cli_error(["--temperature", "nan"])
    assert "--top_k must be >= 0 (0: no filter)" in cli_error(["--top_k", "-1"])
    assert "is a folder: give the trace's file name" in cli_error(["--profile", str(tmp_path)])
    assert "--prefill_chunk must be at least 1" in cli_error(["--prefill_chunk", "0"])
    assert "--max_new_tokens must be at least 1" in cli_error(["--max_new_tokens", "0"])
    assert "its folder does not exist" in cli_error(["--profile", str(tmp_path / "missing" / "trace.json")])
    assert "leave out --prompt, --ignore_eos" in cli_error(["--interactive", "--prompt", "hi", "--ignore_eos"])
    assert "--speculate_k goes with a drafter" in cli_error(["--speculate_k", "3"])
    assert "--speculate_k must be at least 1" in cli_error(["--draft", "prompt-lookup", "--speculate_k", "0"])
    tokenizer_file = bundled_checkpoint.parent / "tokenizer.json"
    assert f"give its directory, {bundled_checkpoint.parent}, which holds one" in cli_error(
        ["--checkpoint_path", str(tokenizer_file)])
    if not torch.cuda.is_available():
        assert "no CUDA device" in cli_error(["--device", "cuda"])


def test_corrupt_model_config_is_one_line(tmp_path, bundled_checkpoint):
    for name in ("tokenizer.json", "tokenizer_config.json", bundled_checkpoint.name):
        (tmp_path / name).symlink_to((bundled_checkpoint.parent / name).resolve())
    config = json.loads((bundled_checkpoint.parent / CONFIG_NAME).read_text())
    # cut short, not an object, a field this version does not know (a misspelled variant is never dropped)
    for text in ('{"dim": 576,', "[576]", json.dumps({**config, "sliding_windw": 128})):
        (tmp_path / CONFIG_NAME).write_text(text)
        assert "not a readable model config" in cli_error(["--checkpoint_path", str(tmp_path)])


@pytest.mark.usefixtures("bundled_checkpoint")  # the command line's default model
def test_cli_stops_at_the_end_of_the_answer(capsys):
    """The README's first command: the answer ends at the stop token, unless --ignore_eos."""
    argv = ["--prompt", "What is 2+2? Answer with one number.", "--temperature", "0", "--max_new_tokens", "60",
            "--precision", "fp32"]
    tokenizer = get_tokenizer()
    prompt_len = len(tokenizer.encode_prompt("What is 2+2? Answer with one number.", chat=True))
    for extra in ([], ["--batch_size", "2"], ["--draft", "prompt-lookup"]):
        outputs = gen.main(gen.parse_args(argv + extra))
        for row in outputs:
            assert row[-1].item() in tokenizer.stop_ids and len(row) < prompt_len + 60, extra
        printed, said = capsys.readouterr()
        assert "system" not in printed and "user" not in printed, printed
        assert "stopped at --max_new_tokens" not in said
        if "--batch_size" in extra:  # every row printed, labelled
            assert "[1/2] " in printed and "[2/2] " in printed
    outputs = gen.main(gen.parse_args(argv + ["--ignore_eos"]))
    assert len(outputs[0]) == prompt_len + 60
    assert "stopped at --max_new_tokens" not in capsys.readouterr().err  # as asked: no note
    gen.main(gen.parse_args(["--temperature", "0", "--max_new_tokens", "3", "--precision", "fp32"]))  # "Paris"
    assert "(1 of 1 rows stopped at --max_new_tokens 3, not at the end of the answer)" in capsys.readouterr().err


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        gen.parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the lines
    assert "(default: bf16)" in out and "(default: a chat answer's end of turn, within 4096 positions" in out


def test_the_cpu_time_of_our_own_children_is_ours():
    """A CPU kernel built at first use compiles in child processes: their time is this process's own, not
    other processes' load (on 2 cores fit_threads took it for a busy core, and decoded on one thread)."""
    before = gen.cpu_clock()
    subprocess.run([sys.executable, "-c", "import time\nwhile time.process_time() < 1: pass"], check=True)
    assert gen.cpu_clock()[2] - before[2] >= 0.9


def test_decoding_threads_fit_the_cores_other_processes_leave(monkeypatch, capsys):
    """A process spinning on one of our cores is seen as one busy core; the CLI then decodes on the cores
    left (OpenMP's team would wait on its thread that shares a core), unless OMP_NUM_THREADS says, and says
    what to do where a load came later."""
    core = min(os.sched_getaffinity(0))
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                            preexec_fn=lambda: os.sched_setaffinity(0, {core}))
    try:
        time.sleep(0.5)  # started
        clock = gen.cpu_clock()
        time.sleep(1)
        assert gen.busy_cores(clock) >= 0.8  # more where other processes run too
    finally:
        spin.kill()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        gen.fit_threads(0.1)
        assert torch.get_num_threads() == 2 and capsys.readouterr().err == ""
        gen.note_if_crowded(1.0)
        assert "if this sample ran slowly, run with OMP_NUM_THREADS=1" in capsys.readouterr().err
        gen.fit_threads(1.0)
        assert torch.get_num_threads() == 1 and "busy: decoding on 1 thread(s)" in capsys.readouterr().err
        torch.set_num_threads(2)
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        gen.fit_threads(1.0)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


def test_a_flag_is_never_taken_by_its_abbreviation(capsys):
    """--max_new_token is a typo to point out, not --max_new_tokens (argparse's allow_abbrev)."""
    with pytest.raises(SystemExit) as exc:
        gen.parse_args(["--max_new_token", "5"])
    assert exc.value.code == 2 and "unrecognized arguments: --max_new_token" in capsys.readouterr().err


@pytest.mark.parametrize("top_p", ["2", "-0.1", "nan"])
def test_top_p_is_refused_before_anything_loads(top_p):
    with pytest.raises(SystemExit, match=r"--top_p must be in \[0, 1\] \(1: no filter\)"):
        gen.parse_args(["--top_p", top_p])


def test_a_file_that_is_not_a_checkpoint_is_named_with_what_to_give(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a file in the current folder, as README.md in the repository's
    (tmp_path / "README.md").write_text("# not weights")
    said = cli_error(["--checkpoint_path", "README.md"])
    assert said == ("error: README.md is not a checkpoint (a .safetensors file): give a converted checkpoint's "
                    "directory, one holding fastllama.safetensors and model_config.json, or that "
                    "fastllama.safetensors itself")


@pytest.mark.usefixtures("bundled_checkpoint")  # the command line's default model
@pytest.mark.parametrize("argv, budget", [
    ([], gen.ANSWER_POSITIONS),  # a chat answer: to its end of turn, within 4096 positions with the prompt
    (["--no-chat"], gen.DEFAULT_NEW_TOKENS),  # a continuation has no end of turn: 200, as before
    (["--ignore_eos"], gen.DEFAULT_NEW_TOKENS),
    (["--max_new_tokens", "7"], 7),
])
def test_the_default_answer_is_whole(monkeypatch, capsys, argv, budget):
    """Without --max_new_tokens the README's first command, `python generate.py`, prints a whole answer:
    the budget reaches ANSWER_POSITIONS, not 200 new tokens that end mid-sentence (generation faked: the
    bundled model's answer, its end of turn and no more)."""
    tokenizer = get_tokenizer()
    budgets = []

    def answer(model, prompts, max_new_tokens, stop_ids, callback=None, **options):
        budgets.append(max_new_tokens)
        tokens = tokenizer.encode("Paris is the capital of France.") + tokenizer.stop_ids[:1]
        for token in tokens if callback else []:
            callback([[token]])
        return [torch.cat([p, torch.tensor(tokens)]) for p in prompts]

    monkeypatch.setattr(gen, "generate", answer)
    outputs = gen.main(gen.parse_args(["--precision", "fp32", *argv]))
    prompt_length = len(outputs[0]) - len(tokenizer.encode("Paris is the capital of France.")) - 1
    assert budgets == [budget - prompt_length if budget == gen.ANSWER_POSITIONS else budget]
    out, err = capsys.readouterr()
    assert out.endswith("Paris is the capital of France.\n") and "stopped at" not in err


@pytest.mark.usefixtures("bundled_checkpoint")  # the command line's default model
@pytest.mark.parametrize("recommended, argv, expected, said", [
    (None, [], gen.SAMPLING, None),  # no generation_config.json: gpt-fast's defaults
    ({"eos_token_id": 2}, [], gen.SAMPLING, None),  # one without sampling settings
    ({"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}, [],
     dict(temperature=0.7, top_k=20, top_p=0.8), "temperature 0.7, top_k 20, top_p 0.8"),  # Qwen2.5-Instruct's
    ({"do_sample": True, "temperature": 0.6, "top_p": 0.9}, ["--top_k", "5"],
     dict(temperature=0.6, top_k=5, top_p=0.9), "temperature 0.6, top_p 0.9"),
    ({"temperature": 0.6, "top_k": 0, "top_p": 1.0}, [],  # how the file says "no filter"
     dict(temperature=0.6, top_k=None, top_p=None), "temperature 0.6, top_k none, top_p none"),
    ({"do_sample": False, "temperature": 0.6}, [], dict(temperature=0.0, top_k=200, top_p=None), "temperature 0.0"),
    ({"do_sample": False}, ["--temperature", "1.0"], dict(temperature=1.0, top_k=200, top_p=None), None),
    (None, ["--top_k", "0", "--top_p", "1"], dict(temperature=0.8, top_k=None, top_p=None), None),  # as the file says none
])
def test_sampling_defaults_come_from_the_checkpoints_generation_config(tmp_path, recommended, argv, expected, said,
                                                                        capsys):
    if recommended is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(recommended))
    assert gen.sampling_options(gen.parse_args(argv), tmp_path / "fastllama.safetensors") == expected
    err = capsys.readouterr().err
    assert (f"generation_config.json recommends: {said}\n" in err) if said else err == ""


def test_a_generation_config_that_is_not_json_is_one_line(tmp_path):
    (tmp_path / "generation_config.json").write_text("{temperature: 0.6")
    with pytest.raises(UserError, match="generation_config.json is not valid JSON"):
        gen.sampling_options(gen.parse_args([]), tmp_path / "fastllama.safetensors")


def test_cli_runs_and_reports(tmp_path):
    """The README's command end to end, in a subprocess: text, then tok/s, bandwidth and memory. Started
    from another folder, it finds the bundled model converted in the repository, not a second copy."""
    result = subprocess.run([sys.executable, str(REPO / "generate.py"), "--prompt", "Tell me about Paris", "--max_new_tokens", "8",
                             "--temperature", "0", "--profile", "trace.json"],
                            capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "converting" not in result.stderr and not (tmp_path / "checkpoints").exists()
    assert "Paris" in result.stdout
    assert "tok/s" in result.stderr and "GB/s" in result.stderr and "peak memory" in result.stderr
    assert (tmp_path / "trace.json").stat().st_size > 0


def test_cli_error_has_no_traceback(tmp_path):
    result = subprocess.run([sys.executable, "generate.py", "--checkpoint_path", str(tmp_path / "nope.safetensors")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert result.stderr.startswith("error: no checkpoint at") and "Traceback" not in result.stderr


@pytest.mark.usefixtures("bundled_checkpoint")  # the command line's default model
def test_interactive_chat_streams_answers_up_to_their_end():
    """Each answer ends at the model's end of turn: nothing of the template after it is printed or
    kept in the dialog (greedy fp32 "What is 2+2?" answers in ~10 tokens, then would go on with
    "system", "user" and an invented request)."""
    result = subprocess.run([sys.executable, "generate.py", "--interactive", "--temperature", "0", "--precision",
                             "fp32", "--max_new_tokens", "48"], input="What is the capital of France?\nWhat is 2+2?\n",
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    answers = result.stdout.split("Assistant: ")[1:]
    assert len(answers) == 2 and "Paris" in answers[0] and "4" in answers[1]
    for answer in answers:
        assert "system" not in answer and "user" not in answer and "<|im" not in answer, answer


@pytest.mark.usefixtures("bundled_checkpoint")  # the command line's default model
def test_piped_interactive_chat_echoes_what_it_read(monkeypatch, capsys):
    """From a pipe, nothing echoes the question a terminal would: the chat prints it, so that the answer
    starts on a line of its own, not as "You: Assistant: ..."."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("What is the capital of France?\n"))
    gen.run(gen.parse_args(["--interactive", "--temperature", "0", "--precision", "fp32", "--max_new_tokens", "4"]))
    out = capsys.readouterr().out
    assert out.startswith("You: What is the capital of France?\nAssistant: ") and out.endswith("\nYou: \n"), out


@pytest.mark.usefixtures("bundled_checkpoint")  # the command line's default model
def test_streamed_text_is_the_decoded_text(capsys):
    """Token by token, characters split across tokens and spaces that depend on the token before come out
    as the whole text decodes."""
    tokenizer = get_tokenizer()
    ids = tokenizer.encode("Café 🙂 naïve — déjà vu, 東京タワー!\n  Indented 🇫🇷 end")
    stream = gen.TextStream(tokenizer)
    for token in ids:
        stream([[token]])
    assert capsys.readouterr().out == stream.text == tokenizer.decode(ids)


@pytest.mark.usefixtures("bundled_checkpoint")  # the command line's default model
def test_ctrl_c_keeps_the_streamed_answer_and_says_so():
    """Plain generation streams its answer; Ctrl-C keeps what was printed, ends its line, says so on
    stderr, and exits with 130."""
    # SIGINT as a terminal's shell leaves it: a background job's ignored SIGINT would be inherited
    proc = subprocess.Popen([sys.executable, "generate.py", "--temperature", "0", "--ignore_eos",
                             "--max_new_tokens", "4000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        # within a minute of the start: today's bundled model decodes ~15 tokens a second on 2 cores
        assert select.select([proc.stdout], [], [], 60)[0], "no text on stdout before the end of generation"
        time.sleep(0.5)  # a few more tokens
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    words = out.decode().split()
    assert len(words) >= 3 and out.endswith(b"\n"), out
    assert err.decode().splitlines()[-1] == "generation interrupted, the text so far above", err


@pytest.mark.usefixtures("bundled_checkpoint")  # the command line's default model
def test_interactive_chat_decodes_with_the_drafter_asked_for(monkeypatch, capsys):
    from fastllama import speculative

    drafters, plain = [], speculative.speculative_generate
    monkeypatch.setattr(speculative, "speculative_generate",
                        lambda *args, **kwargs: drafters.append(args[3]) or plain(*args, **kwargs))
    turns = ["What is the capital of France?"]

    def user(prompt: str) -> str:  # one turn, then the end of the input
        if not turns:
            raise EOFError
        return turns.pop()

    monkeypatch.setattr("builtins.input", user)
    gen.run(gen.parse_args(["--interactive", "--draft", "prompt-lookup", "--temperature", "0", "--precision", "fp32",
                            "--max_new_tokens", "16"]))
    assert len(drafters) == 1 and isinstance(drafters[0], speculative.PromptLookup)
    assert "Paris" in capsys.readouterr().out


@pytest.mark.usefixtures("bundled_checkpoint")  # the command line's default model
def test_an_answer_cut_inside_a_character_keeps_what_was_printed(monkeypatch, capsys):
    tokenizer = gen.get_tokenizer(None)
    cut = tokenizer.encode("Hi") + tokenizer.encode("🙂")[:1]  # the emoji's first token of two
    dialogs, encode = [], tokenizer.encode_dialog
    monkeypatch.setattr(gen, "get_tokenizer", lambda path: tokenizer)
    monkeypatch.setattr(tokenizer, "encode_dialog", lambda messages: dialogs.append(list(messages)) or encode(messages))

    def cut_short(model, prompt, budget, callback, **options):  # an answer that max_new_tokens ends mid-emoji
        for token in cut:
            callback([[token]])

    monkeypatch.setattr(gen, "generate", cut_short)
    turns = ["Say hi", "Again"]

    def user(prompt: str) -> str:  # two turns, then the end of the input
        if not turns:
            raise EOFError
        return turns.pop(0)

    monkeypatch.setattr("builtins.input", user)
    gen.run(gen.parse_args(["--interactive", "--precision", "fp32"]))
    assert dialogs[-1][1] == {"role": "assistant", "content": "Hi"}  # no U+FFFD for the half emoji
    assert capsys.readouterr().out.count("Assistant: Hi\n") == 2


@pytest.mark.usefixtures("bundled_checkpoint")  # the command line's default model
def test_interactive_chat_keeps_to_its_context(monkeypatch, capsys):
    turns = []

    def user(prompt: str) -> str:  # the same question, len(turns) times, then the end of the input
        if not turns:
            raise EOFError
        return turns.pop()

    monkeypatch.setattr("builtins.input", user)
    turns[:] = ["What is the capital of France?"]
    with pytest.raises(UserError, match="--context must be between 1"):
        gen.run(gen.parse_args(["--interactive", "--context", "0", "--precision", "fp32"]))
    with pytest.raises(UserError, match=r"this message takes \d+ positions in the chat template, which leaves no room "
                                        r"for an answer in --context 20: raise --context or write less"):
        gen.run(gen.parse_args(["--interactive", "--context", "20", "--precision", "fp32"]))
    with pytest.raises(UserError, match="--context sizes the cache of --interactive"):
        gen.run(gen.parse_args(["--context", "64"]))
    with pytest.raises(UserError, match="--interactive is one dialog"):
        gen.run(gen.parse_args(["--interactive", "--batch_size", "2"]))
    # a context that is not a multiple of 64, with room for one question and less than a whole answer of
    # --max_new_tokens: each later turn forgets the exchange before it, and the cache made at the first
    # turn is kept
    made, make = [], model.KVCache.__init__
    monkeypatch.setattr(model.KVCache, "__init__", lambda self, *args: made.append(args) or make(self, *args))
    turns[:] = ["What is the capital of France?"] * 3
    capsys.readouterr()
    gen.run(gen.parse_args(["--interactive", "--context", "100", "--precision", "fp32", "--max_new_tokens", "200",
                            "--temperature", "0"]))
    out, err = capsys.readouterr()
    assert err.count("(the dialog would pass --context 100 positions: its 1 oldest exchange forgotten)") == 2, err
    # each answer's line: stdin is no terminal here, so the next question is echoed on the line after it
    answers = [answer.splitlines()[0].strip() for answer in out.split("Assistant: ")[1:]]
    assert len(answers) == 3 and answers[0] == answers[1] == answers[2] and "Paris" in answers[0], answers
    assert len(made) == gen.load_config(gen.find_checkpoint(None)).n_layer, [args[1] for args in made]


@pytest.mark.usefixtures("bundled_checkpoint")  # the command line's default model
def test_cli_speculative_prints_acceptance():
    for drafter in (["--draft", "prompt-lookup"], ["--draft", "self-int4", "--draft_alternatives", "2"]):
        result = subprocess.run([sys.executable, "generate.py", *drafter, "--temperature", "0",
                                 "--max_new_tokens", "16", "--prompt", "Repeat: red green blue red green blue"],
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        assert "acceptance rate" in result.stderr and "tok/s" in result.stderr
        assert ("ending in an alternative" in result.stderr) == ("--draft_alternatives" in drafter)


@pytest.mark.usefixtures("bundled_checkpoint")  # the command line's default model
def test_compiled_runs_of_other_lengths_share_one_cache_length(monkeypatch):
    """--compile sizes the cache to a power of two of at least 1024 positions: runs with other prompts
    and --max_new_tokens then find the graphs an earlier run compiled (the compiling left out here)."""
    monkeypatch.setattr(gen, "compiled_steps", lambda dynamic_prefill=False: decode.EAGER)
    made, make = [], model.KVCache.__init__
    monkeypatch.setattr(model.KVCache, "__init__", lambda self, *args: made.append(args[1]) or make(self, *args))
    for prompt, n in (("Hi", "8"), ("Tell me a story about a dragon and a knight.", "40")):
        gen.main(gen.parse_args(["--compile", "--prompt", prompt, "--max_new_tokens", n, "--precision", "fp32"]))
    assert set(made) == {1024 + 1}  # every layer's cache, in both runs: its slot past the end never written
