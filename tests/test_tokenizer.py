import base64
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from pydoc_data.topics import topics

from fastllama.checkpoint import copy_companions
from fastllama.errors import UserError
from fastllama.tokenizer import load_tokenizer

TEXT = [line for topic in topics.values() for line in topic.splitlines() if line.strip()][:800]
MIXED = "Hello, world! The 3 quick foxes: naïve café, 日本語 🙂\n\tindented  two  spaces "

# Chat templates as they read after json.load of the model repos' tokenizer_config.json.
LLAMA2_TEMPLATE = (  # meta-llama/Llama-2-7b-chat-hf
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)
LLAMA3_TEMPLATE = (  # meta-llama/Meta-Llama-3-8B-Instruct
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
SMOLLM2_TEMPLATE = (  # HuggingFaceTB/SmolLM2-135M-Instruct
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
QWEN25_TEMPLATE = (  # Qwen/Qwen2.5-0.5B-Instruct, without its tools branches
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n{%- else %}\n"
    "    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}\n{%- endif %}\n{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\") %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- endif %}\n{%- endfor %}\n{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

DIALOG = [
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": " Hello! How can I help? "},
    {"role": "user", "content": "Tell me a joke."},
]


def render(template: str, messages: list[dict], **tokens) -> str:
    """The prompt text transformers' apply_chat_template renders."""
    jinja2 = pytest.importorskip("jinja2.sandbox")

    def raise_exception(message):
        raise ValueError(message)

    env = jinja2.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, add_generation_prompt=True, **tokens)


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data))


@pytest.fixture(autouse=True)
def no_tiktoken_cache(monkeypatch):
    # load_tiktoken_bpe caches every file it reads under /tmp, keyed by path: no stale copies, no leftovers.
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")


@pytest.fixture(scope="session")
def sentencepiece_model(tmp_path_factory) -> Path:
    spm = pytest.importorskip("sentencepiece")
    prefix = tmp_path_factory.mktemp("sp") / "tokenizer"
    # Llama 2's settings: BPE, byte fallback, text kept as is.
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXT), model_prefix=str(prefix), vocab_size=400, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        split_digits=True, minloglevel=2,
    )
    return prefix.with_suffix(".model")


@pytest.fixture(scope="session")
def tiktoken_model(tmp_path_factory) -> Path:
    """Llama-3-style tokenizer.model: base64 token and rank per line, the 256 bytes then a few merges."""
    tokens = [bytes([b]) for b in range(256)] + [b"th", b"the", b" t", b" the", b"in", b"ing", b" a"]
    path = tmp_path_factory.mktemp("tiktoken") / "tokenizer.model"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(tokens)))
    return path


@pytest.fixture(scope="session")
def hf_tokenizer_json(tmp_path_factory) -> Path:
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(TEXT, trainer)
    path = tmp_path_factory.mktemp("hf") / "tokenizer.json"
    tok.save(str(path))
    return path


def checkpoint(tmp_path: Path, tokenizer_file: Path, **configs: dict) -> Path:
    """A checkpoint directory with a copy of tokenizer_file and the given {name}.json files."""
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / tokenizer_file.name).write_bytes(tokenizer_file.read_bytes())
    for name, data in configs.items():
        write_json(tmp_path / f"{name}.json", data)
    return tmp_path


def test_sentencepiece(tmp_path, sentencepiece_model):
    tok = load_tokenizer(checkpoint(tmp_path, sentencepiece_model))
    assert (tok.bos_id, tok.eos_id, tok.stop_ids, tok.add_bos, tok.chat_format) == (1, 2, [2], True, None)
    assert tok.vocab_size == 400
    ids = tok.encode(MIXED)
    assert tok.bos_id not in ids and tok.decode(ids) == MIXED
    assert tok.encode("Hi<s>there</s>") == tok.encode("Hi") + [1] + tok.encode("there") + [2]
    assert tok.encode_prompt("Hi") == [1] + tok.encode("Hi")
    with pytest.raises(UserError, match="no chat format"):
        tok.encode_prompt("Hi", chat=True)
    with pytest.raises(UserError, match="a system prompt needs chat mode"):
        tok.encode_prompt("Hi", system="Be brief")


def test_llama2_chat(tmp_path, sentencepiece_model):
    config = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "chat_template": LLAMA2_TEMPLATE}
    tok = load_tokenizer(checkpoint(tmp_path, sentencepiece_model, tokenizer_config=config))
    assert tok.chat_template == LLAMA2_TEMPLATE and tok.stop_ids == [2]

    ids = tok.encode_prompt("Hi there ", chat=True, system="Be brief.")
    assert ids == [1] + tok.encode("[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi there [/INST]")
    assert ids == tok.encode(render(LLAMA2_TEMPLATE, [{"role": "system", "content": "Be brief."},
                                                      {"role": "user", "content": "Hi there "}],
                                    bos_token="<s>", eos_token="</s>"))

    ids = tok.encode_dialog(DIALOG)
    first = [1] + tok.encode("[INST] Hi there [/INST] Hello! How can I help? ") + [2]
    assert ids == first + [1] + tok.encode("[INST] Tell me a joke. [/INST]")
    assert ids == tok.encode(render(LLAMA2_TEMPLATE, DIALOG, bos_token="<s>", eos_token="</s>"))
    with pytest.raises(UserError, match="chat template cannot render this dialog: Conversation roles must alternate"):
        tok.encode_dialog(DIALOG[1:])


def test_a_harness_chat_context_is_encoded_as_its_dialog(tmp_path, sentencepiece_model):
    """eval.py with --apply_chat_template: the harness hands over the template's rendering, which holds
    its BOS already; encoded as a plain prompt, it would get a second one."""
    from fastllama import eval as ev

    config = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "chat_template": LLAMA2_TEMPLATE}
    tok = load_tokenizer(checkpoint(tmp_path, sentencepiece_model, tokenizer_config=config))
    model = SimpleNamespace(config=SimpleNamespace(block_size=256, sliding_window=None), hidden_states=None)
    context, _ = ev.HarnessModel(model, tok, "chat", chat=True).encode_pair(tok.dialog_text(DIALOG), " Sure")
    assert context == tok.encode_dialog(DIALOG) and context.count(tok.bos_id) == 2  # one a user turn
    plain, _ = ev.HarnessModel(model, tok, "plain").encode_pair("Hi there", " Sure")
    assert plain == tok.encode_prompt("Hi there")


def test_tiktoken_llama3(tmp_path, tiktoken_model):
    n = 263  # 256 bytes + 7 merges
    generation_config = {"eos_token_id": [n + 1, n + 8, n + 9]}  # as Llama-3.1-Instruct's 128001, 128008, 128009
    tok = load_tokenizer(checkpoint(tmp_path, tiktoken_model, generation_config=generation_config))
    enc = tok.backend.enc
    assert tok.vocab_size == n + 256
    assert [enc.encode_single_token(t) for t in
            ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|start_header_id|>",
             "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|reserved_special_token_2|>",
             "<|reserved_special_token_246|>"]] == [n, n + 1, n + 2, n + 6, n + 7, n + 8, n + 9, n + 11, n + 255]
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.chat_format) == (n, n + 1, True, "llama3")
    assert tok.stop_ids == [n + 1, n + 9, n + 8]  # eos, <|eot_id|>, the rest of generation_config's

    ids = tok.encode(MIXED)
    assert max(ids) < n and tok.decode(ids) == MIXED
    assert enc.decode(tok.encode("the thing")) == "the thing" and len(tok.encode("the thing")) < len("the thing")
    assert tok.encode("a<|eot_id|>b") == [ord("a"), n + 9, ord("b")]
    assert tok.decode([ord("a"), n + 9, ord("b")]) == "ab"

    system = {"role": "system", "content": "Be brief."}
    ids = tok.encode_prompt(" Hi there\n", chat=True, system="Be brief.")
    expected = render(LLAMA3_TEMPLATE, [system, {"role": "user", "content": " Hi there\n"}],
                      bos_token="<|begin_of_text|>")
    assert enc.decode(ids) == expected == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert ids == tok.encode(expected) and ids.count(n + 6) == 3
    assert enc.decode(tok.encode_dialog(DIALOG)) == render(LLAMA3_TEMPLATE, DIALOG, bos_token="<|begin_of_text|>")


def test_chatml_smollm2(tmp_path, hf_tokenizer_json):
    config = {"bos_token": {"content": "<|im_start|>", "special": True}, "eos_token": "<|im_end|>",
              "chat_template": SMOLLM2_TEMPLATE}
    tok = load_tokenizer(checkpoint(tmp_path, hf_tokenizer_json, tokenizer_config=config))
    im_start, im_end = tok.encode("<|im_start|><|im_end|>")
    assert (im_start, im_end) == (1, 2)
    assert (tok.bos_id, tok.eos_id, tok.stop_ids, tok.add_bos) == (1, 2, [2], False)
    assert (tok.chat_template, tok.chat_format) == (SMOLLM2_TEMPLATE, None)
    assert tok.vocab_size == 400

    ids = tok.encode(MIXED)
    assert tok.decode(ids) == MIXED
    assert tok.encode_prompt("Hi") == tok.encode("Hi")  # SmolLM2 takes no BOS
    assert tok.decode(tok.encode("x<|im_end|>y")) == "xy"

    def text(ids):
        return tok.backend.tok.decode(ids, skip_special_tokens=False)

    ids = tok.encode_prompt("Hi", chat=True)
    assert text(ids) == render(SMOLLM2_TEMPLATE, [{"role": "user", "content": "Hi"}]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.encode_prompt("Hi", chat=True, system="Be brief.")
    assert ids == tok.encode("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                             "<|im_start|>assistant\n")
    assert ids.count(im_start) == 3 and ids.count(im_end) == 2
    assert text(tok.encode_dialog(DIALOG)) == render(SMOLLM2_TEMPLATE, DIALOG)


def test_chatml_without_tokenizer_config(tmp_path, hf_tokenizer_json):
    tok = load_tokenizer(checkpoint(tmp_path, hf_tokenizer_json, generation_config={"eos_token_id": 0}))
    assert (tok.bos_id, tok.eos_id, tok.stop_ids, tok.add_bos, tok.chat_format) == (None, 0, [0, 2], False, "chatml")
    assert tok.backend.tok.decode(tok.encode_prompt("Hi", chat=True), skip_special_tokens=False) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"  # no default system message
    )
    with pytest.raises(UserError, match="end-of-text"):
        load_tokenizer(checkpoint(tmp_path / "no_eos", hf_tokenizer_json))
    tok = load_tokenizer(checkpoint(tmp_path / "null_eos", hf_tokenizer_json, generation_config={"eos_token_id": None},
                                    tokenizer_config={"eos_token": "<|endoftext|>"}))
    assert (tok.eos_id, tok.stop_ids) == (0, [0, 2])


@pytest.mark.parametrize("added_tokens_decoder", [False, True])
def test_special_tokens_map_as_transformers_reads_it(tmp_path, hf_tokenizer_json, added_tokens_decoder):
    """An older checkpoint keeps its special tokens in special_tokens_map.json, which overrides
    tokenizer_config.json's; a newer one (its tokenizer_config.json lists added_tokens_decoder) is read
    without it. Both as transformers' AutoTokenizer reads them."""
    transformers = pytest.importorskip("transformers")
    config = {"eos_token": "<|endoftext|>", "tokenizer_class": "PreTrainedTokenizerFast"}
    if added_tokens_decoder:
        config["added_tokens_decoder"] = {str(i): dict(content=token, special=True, lstrip=False, rstrip=False,
                                                       normalized=False, single_word=False)
                                          for i, token in enumerate(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])}
    path = checkpoint(tmp_path, hf_tokenizer_json, tokenizer_config=config,
                      special_tokens_map={"bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>"}})
    ours, theirs = load_tokenizer(path), transformers.AutoTokenizer.from_pretrained(path)
    assert (ours.eos_id, ours.bos_id) == (theirs.eos_token_id, theirs.bos_token_id)
    assert ours.eos_id == (0 if added_tokens_decoder else 2)


def test_weights_written_into_another_folder_keep_the_tokenizer(tmp_path, hf_tokenizer_json):
    """quantize.py --output into another folder copies the files the tokenizer reads: an older
    checkpoint's special_tokens_map.json included, or its end of text would change."""
    source = checkpoint(tmp_path / "source", hf_tokenizer_json, tokenizer_config={"eos_token": "<|endoftext|>"},
                        special_tokens_map={"eos_token": "<|im_end|>"})
    (tmp_path / "copy").mkdir()
    copy_companions(source / "fastllama.safetensors", tmp_path / "copy")
    assert load_tokenizer(tmp_path / "copy").eos_id == load_tokenizer(source).eos_id == 2


def test_template_from_chat_template_jinja(tmp_path, hf_tokenizer_json):
    """Qwen2.5's template writes its default system message; newer transformers save the template to
    chat_template.jinja rather than into tokenizer_config.json."""
    (tmp_path / "chat_template.jinja").write_text(QWEN25_TEMPLATE)
    tok = load_tokenizer(checkpoint(tmp_path, hf_tokenizer_json, tokenizer_config={"eos_token": "<|im_end|>"}))
    assert tok.chat_template == QWEN25_TEMPLATE
    text = tok.backend.tok.decode(tok.encode_dialog(DIALOG), skip_special_tokens=False)
    assert text == render(QWEN25_TEMPLATE, DIALOG)
    assert text.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")


def test_bos_from_tokenizer_json_post_processor(tmp_path, hf_tokenizer_json):
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer.from_file(str(hf_tokenizer_json))
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    tok.save(str(tmp_path / "tokenizer.json"))
    write_json(tmp_path / "tokenizer_config.json", {"eos_token": "<|endoftext|>"})
    tok = load_tokenizer(tmp_path)
    assert (tok.bos_id, tok.add_bos) == (0, True)
    assert tok.encode_prompt("Hi") == [0] + tok.encode("Hi")

    write_json(tmp_path / "tokenizer_config.json", {"eos_token": "<|endoftext|>", "add_bos_token": False})
    assert load_tokenizer(tmp_path).encode_prompt("Hi") == tok.encode("Hi")


def test_tokenizer_json_preferred(tmp_path, hf_tokenizer_json, sentencepiece_model):
    (tmp_path / "tokenizer.model").write_bytes(sentencepiece_model.read_bytes())
    tok = load_tokenizer(checkpoint(tmp_path, hf_tokenizer_json, tokenizer_config={"eos_token": "<|im_end|>"}))
    assert tok.encode("<|im_start|>") == [1]


def test_a_template_that_does_not_render_is_one_line(tmp_path, hf_tokenizer_json):
    config = {"eos_token": "<|im_end|>", "chat_template": "{% for m in messages %}{{ m.content | nosuchfilter }}"}
    tok = load_tokenizer(checkpoint(tmp_path, hf_tokenizer_json, tokenizer_config=config))
    with pytest.raises(UserError, match="chat template cannot render") as error:
        tok.encode_prompt("Hi", chat=True)
    assert "\n" not in str(error.value)


def test_a_template_sees_no_tools_as_none(tmp_path, hf_tokenizer_json):
    """transformers renders with tools=None and documents=None: a template may test `is not none`."""
    template = "{% if tools is not none or documents is not none %}TOOLS{% endif %}{{ messages[0]['content'] }}"
    config = {"eos_token": "<|im_end|>", "chat_template": template}
    tok = load_tokenizer(checkpoint(tmp_path, hf_tokenizer_json, tokenizer_config=config))
    assert tok.backend.tok.decode(tok.encode_prompt("Hi", chat=True)) == "Hi"


def test_missing_tokenizer(tmp_path):
    write_json(tmp_path / "config.json", {})
    with pytest.raises(UserError, match="no tokenizer") as error:
        load_tokenizer(tmp_path)
    assert str(tmp_path) in str(error.value) and "scripts/download.py" in str(error.value)


@pytest.mark.parametrize("content", [b"\x0a\x03not a model\nnor base64 ranks\n", b""])
def test_unreadable_tokenizer_model(tmp_path, content):
    (tmp_path / "tokenizer.model").write_bytes(content)
    with pytest.raises(UserError, match="neither a SentencePiece model nor tiktoken"):
        load_tokenizer(tmp_path)


LFS_POINTER = "version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 123\n"


def test_unreadable_tokenizer_json_or_config_is_one_line(tmp_path, hf_tokenizer_json):
    pytest.importorskip("tokenizers")
    (tmp_path / "tokenizer.json").write_text(LFS_POINTER)
    with pytest.raises(UserError, match="does not read as a tokenizer"):
        load_tokenizer(tmp_path)
    path = checkpoint(tmp_path / "config", hf_tokenizer_json)
    for name in ("tokenizer_config.json", "generation_config.json"):
        (path / name).write_text('{"eos_token": ')
        with pytest.raises(UserError, match=f"{name} is not valid JSON"):
            load_tokenizer(path)
        (path / name).unlink()


@pytest.mark.parametrize("module, fixture", [
    ("tokenizers", "hf_tokenizer_json"), ("tiktoken", "tiktoken_model"), ("sentencepiece", "sentencepiece_model"),
])
def test_missing_optional_library(tmp_path, monkeypatch, request, module, fixture):
    path = checkpoint(tmp_path, request.getfixturevalue(fixture), tokenizer_config={"eos_token": "<|im_end|>"})
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(UserError, match=f"pip install {module}"):
        load_tokenizer(path)


# ---------------------------------------------------------------------------------------------
# Each family's kind of tokenizer.json and chat template, against transformers' AutoTokenizer

GEMMA_TEMPLATE = (  # google/gemma-2-2b-it
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)
PHI3_TEMPLATE = (  # microsoft/Phi-3-mini-4k-instruct
    "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + "
    "'<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)
MULTILINGUAL = MIXED + " Ceci est un texte français. Привет, мир! مرحبا بالعالم. 中文文本。 Ελληνικά 😀👍🏽 ₂∑"
TOKENIZER_KINDS = {  # transformers' class for the family's tokenizer.json, its special tokens, its template
    "qwen (byte-level BPE)": ("Qwen2Tokenizer", dict(eos_token="<|im_end|>", pad_token="<|endoftext|>"),
                              ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], QWEN25_TEMPLATE, "<|im_end|>"),
    "gemma (SentencePiece-style BPE)": ("GemmaTokenizer", {}, ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>",
                                                               "<start_of_turn>", "<end_of_turn>"],
                                        GEMMA_TEMPLATE, "<end_of_turn>"),
    "phi-3 / mistral (SentencePiece-style BPE)": ("LlamaTokenizer", {}, ["<unk>", "<s>", "</s>", "<|user|>",
                                                                         "<|assistant|>", "<|system|>", "<|end|>"],
                                                  PHI3_TEMPLATE, "<|end|>"),
}


@pytest.fixture(scope="module", params=TOKENIZER_KINDS)
def family_tokenizer(request, tmp_path_factory):
    """(our tokenizer, transformers' AutoTokenizer, end-of-turn token) of a checkpoint directory that
    transformers itself wrote: a BPE trained here on Python's docs, in the family's pipeline."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, pre_tokenizers, trainers

    class_name, tokens, specials, template, end_of_turn = TOKENIZER_KINDS[request.param]
    cls = getattr(transformers, class_name)
    pipeline = json.loads(cls(**tokens)._tokenizer.to_str())  # the family's normalizer, pre-tokenizer, decoder
    pipeline["added_tokens"] = []
    backend = Tokenizer.from_str(json.dumps(pipeline))
    alphabet = pre_tokenizers.ByteLevel.alphabet() if class_name == "Qwen2Tokenizer" else []
    backend.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=600, special_tokens=specials,
                                                          initial_alphabet=alphabet, show_progress=False))
    model = json.loads(backend.to_str())["model"]
    vocab = model["vocab"]
    if model.get("byte_fallback"):  # SentencePiece-style: unknown characters become their UTF-8 bytes
        vocab.update({f"<0x{b:02X}>": len(vocab) + b for b in range(256)})
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    hf = cls(vocab=vocab, merges=merges, **tokens)
    hf.add_special_tokens({"additional_special_tokens": [t for t in specials if t not in hf.all_special_tokens]})
    hf.chat_template = template
    directory = tmp_path_factory.mktemp(class_name)
    hf.save_pretrained(directory)
    return load_tokenizer(directory), transformers.AutoTokenizer.from_pretrained(directory), end_of_turn


def test_family_tokenizer_matches_transformers(family_tokenizer):
    ours, hf, end_of_turn = family_tokenizer
    assert ours.encode(MULTILINGUAL) == hf.encode(MULTILINGUAL, add_special_tokens=False)
    assert ours.encode_prompt(MULTILINGUAL) == hf(MULTILINGUAL)["input_ids"]  # BOS as the checkpoint says
    assert ours.decode(ours.encode(MULTILINGUAL)) == hf.decode(hf.encode(MULTILINGUAL), skip_special_tokens=True)
    assert ours.backend.token_to_id(end_of_turn) in ours.stop_ids and ours.eos_id in ours.stop_ids


def test_family_chat_prompts_match_apply_chat_template(family_tokenizer):
    ours, hf, _ = family_tokenizer
    for messages in (DIALOG, DIALOG[:1]):
        expected = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert ours.encode_dialog(messages) == list(expected)
    assert ours.encode_prompt("Hi", chat=True) == list(hf.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=True, return_dict=False))
