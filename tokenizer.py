"""Tokenizers from the Hugging Face files in a checkpoint directory, and chat prompt formats."""

import importlib
import json
import re
from pathlib import Path

from model import UserError

# Llama 3's tokenizer.model is tiktoken BPE ranks without the split pattern or the special tokens,
# which live in Meta's code; copied from meta-llama/llama-models (the 3.1 names, same ids as 3.0).
LLAMA3_PATTERN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"  # noqa: E501
LLAMA3_SPECIAL_TOKENS = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|eom_id|>", "<|eot_id|>", "<|python_tag|>",  # eom: end of message, eot: end of turn
]
LLAMA3_SPECIAL_TOKENS += [f"<|reserved_special_token_{2 + i}|>" for i in range(256 - len(LLAMA3_SPECIAL_TOKENS))]

END_OF_TURN = {"llama3": "<|eot_id|>", "chatml": "<|im_end|>"}


def _import(module: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        package = module.split(".")[0]
        raise UserError(f"this checkpoint's tokenizer needs {package}: pip install {package}") from None


class _HFTokenizers:
    def __init__(self, path: Path):
        self.tok = _import("tokenizers").Tokenizer.from_file(str(path))
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        # tokenizer.json's post-processor says whether (and which) BOS the model expects.
        with_special = self.tok.encode("a", add_special_tokens=True).ids
        self.adds_bos = with_special[:1] != self.encode("a")[:1]
        self.bos_id = with_special[0] if self.adds_bos else None
        self.eos_id = None  # only tokenizer_config.json / generation_config.json know it

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)


class _SentencePiece:
    def __init__(self, sp):
        self.sp = sp
        self.vocab_size = sp.vocab_size()
        self.adds_bos = True  # Llama 2 and other SentencePiece models are trained with BOS
        self.bos_id = sp.bos_id() if sp.bos_id() >= 0 else None
        self.eos_id = sp.eos_id() if sp.eos_id() >= 0 else None
        # SentencePiece never parses control symbols (<s>, </s>) out of text; split them out ourselves.
        controls = [sp.id_to_piece(i) for i in range(self.vocab_size) if sp.is_control(i)]
        self.controls = re.compile("(" + "|".join(map(re.escape, controls)) + ")") if controls else None

    def encode(self, text: str) -> list[int]:
        ids = []
        for n, part in enumerate(self.controls.split(text) if self.controls else [text]):
            ids += [self.sp.piece_to_id(part)] if n % 2 else self.sp.encode(part)  # text, control, text, ...
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode(ids)

    def token_to_id(self, token: str) -> int | None:
        i = self.sp.piece_to_id(token)  # unknown pieces map to the unk id
        return i if self.sp.id_to_piece(i) == token else None


class _Tiktoken:
    def __init__(self, path: Path):
        tiktoken = _import("tiktoken")
        try:
            ranks = _import("tiktoken.load").load_tiktoken_bpe(str(path))
        except ValueError:
            raise UserError(f"{path} is neither a SentencePiece model nor tiktoken BPE ranks") from None
        self.num_base_tokens = len(ranks)
        self.special_tokens = {token: self.num_base_tokens + i for i, token in enumerate(LLAMA3_SPECIAL_TOKENS)}
        self.enc = tiktoken.Encoding(path.name, pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks,
                                     special_tokens=self.special_tokens)
        self.vocab_size = self.enc.n_vocab
        self.adds_bos = True
        self.bos_id = self.special_tokens["<|begin_of_text|>"]
        self.eos_id = self.special_tokens["<|end_of_text|>"]

    def encode(self, text: str) -> list[int]:
        return self.enc.encode(text, allowed_special="all")

    def decode(self, ids: list[int]) -> str:
        return self.enc.decode([i for i in ids if i < self.num_base_tokens])  # drop special tokens

    def token_to_id(self, token: str) -> int | None:
        return self.special_tokens.get(token)  # only special tokens are looked up by name


def _load_tokenizer_model(path: Path):
    sp = _import("sentencepiece").SentencePieceProcessor()
    try:
        sp.Load(str(path))
    except RuntimeError:  # not a SentencePiece protobuf: Llama 3's tiktoken file has the same name
        return _Tiktoken(path)
    return _SentencePiece(sp)


def chat_format_from_template(template: str | None) -> str | None:
    markers = {"<|start_header_id|>": "llama3", "<|im_start|>": "chatml", "[INST]": "llama2"}
    return next((chat_format for marker, chat_format in markers.items() if marker in (template or "")), None)


def _default_system(template: str | None) -> str | None:
    """The system message a ChatML template inserts when the dialog has none (SmolLM2, Qwen2)."""
    # Matches '<|im_start|>system\n...<|im_end|>' written as one Jinja string literal;
    # the \n is a real newline or a Jinja escape, depending on how the template was saved.
    match = re.search(r"<\|im_start\|>system(?:\n|\\n)([^'\"{}]+?)<\|im_end\|>", template or "")
    return match.group(1) if match else None


class Tokenizer:
    def __init__(self, backend, bos_id: int | None, eos_id: int, stop_ids: list[int], add_bos: bool,
                 chat_format: str | None, default_system: str | None = None):
        self.backend = backend
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.stop_ids = stop_ids
        self.add_bos = add_bos
        self.chat_format = chat_format
        self.default_system = default_system
        self.vocab_size = backend.vocab_size

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text)

    def decode(self, ids: list[int]) -> str:
        """Text of ids, without special tokens (BOS, EOS, chat markers)."""
        return self.backend.decode(ids)

    def encode_prompt(self, text: str, chat: bool = False, system: str | None = None) -> list[int]:
        if chat:
            messages = [{"role": "system", "content": system}] if system is not None else []
            return self.encode_dialog(messages + [{"role": "user", "content": text}])
        if system is not None:
            raise UserError("a system prompt needs chat mode")
        return self._bos() + self.encode(text)

    def encode_dialog(self, messages: list[dict]) -> list[int]:
        """Messages as the chat template lays them out, ending with the assistant's turn opened."""
        if self.chat_format == "llama2":
            return self._llama2_dialog(messages)
        if self.chat_format == "llama3":
            text = "".join(f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content'].strip()}<|eot_id|>"
                           for m in messages)
            return self._bos() + self.encode(text + "<|start_header_id|>assistant<|end_header_id|>\n\n")
        if self.chat_format == "chatml":
            if self.default_system is not None and (not messages or messages[0]["role"] != "system"):
                messages = [{"role": "system", "content": self.default_system}] + messages
            text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
            return self._bos() + self.encode(text + "<|im_start|>assistant\n")
        raise UserError("this model has no chat format (no chat_template in tokenizer_config.json): "
                        "prompt it as plain text, without chat")

    def _llama2_dialog(self, messages: list[dict]) -> list[int]:
        # As Meta's llama reference code: the system prompt is folded into the first user message,
        # and each finished exchange is its own BOS ... EOS sequence.
        system = messages[0]["content"] if messages and messages[0]["role"] == "system" else None
        turns = messages[1:] if system is not None else messages
        if [m["role"] for m in turns] != ["user", "assistant"] * (len(turns) // 2) + ["user"]:
            raise UserError("Llama 2 chat needs user and assistant messages in turn, ending with a user message")
        contents = [m["content"] for m in turns]
        if system is not None:
            contents[0] = f"<<SYS>>\n{system}\n<</SYS>>\n\n{contents[0]}"
        ids = []
        for user, answer in zip(contents[::2], contents[1::2]):
            ids += self._bos() + self.encode(f"[INST] {user.strip()} [/INST] {answer.strip()} ") + [self.eos_id]
        return ids + self._bos() + self.encode(f"[INST] {contents[-1].strip()} [/INST]")

    def _bos(self) -> list[int]:
        return [self.bos_id] if self.add_bos else []


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_id(backend, token: str | dict | None) -> int | None:
    """Id of a tokenizer_config.json token entry: a string, or an AddedToken dict with a "content" key."""
    if isinstance(token, dict):
        token = token.get("content")
    return backend.token_to_id(token) if token else None


def load_tokenizer(checkpoint_dir) -> Tokenizer:
    directory = Path(checkpoint_dir)
    if (directory / "tokenizer.json").is_file():
        backend = _HFTokenizers(directory / "tokenizer.json")
    elif (directory / "tokenizer.model").is_file():
        backend = _load_tokenizer_model(directory / "tokenizer.model")
    else:
        raise UserError(f"no tokenizer in {directory}: it has neither tokenizer.json nor tokenizer.model; "
                        "download the checkpoint with: python scripts/download.py --repo_id <org>/<model>")
    config = _read_json(directory / "tokenizer_config.json")
    generation_config = _read_json(directory / "generation_config.json")

    # tokenizer_config.json has the last word (Qwen sets bos_token null); the backend's own ids otherwise.
    bos_id = _token_id(backend, config["bos_token"]) if "bos_token" in config else backend.bos_id
    generation_eos = generation_config.get("eos_token_id", [])
    generation_eos = [generation_eos] if isinstance(generation_eos, int) else generation_eos
    eos_id = _token_id(backend, config.get("eos_token"))
    if eos_id is None:
        eos_id = generation_eos[0] if generation_eos else backend.eos_id
    if eos_id is None:
        raise UserError(f"cannot tell the end-of-text token of the tokenizer in {directory}: "
                        "tokenizer_config.json has no eos_token")
    add_bos = bool(config.get("add_bos_token", backend.adds_bos)) and bos_id is not None

    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if template is None and (directory / "chat_template.jinja").is_file():
        template = (directory / "chat_template.jinja").read_text()
    if template:
        chat_format = chat_format_from_template(template)
    else:  # guess from the vocabulary's chat markers ("[INST]" is plain text to Llama 2, so it can't tell)
        markers = {"<|start_header_id|>": "llama3", "<|im_start|>": "chatml"}
        chat_format = next((fmt for marker, fmt in markers.items() if backend.token_to_id(marker) is not None), None)

    end_of_turn = _token_id(backend, END_OF_TURN.get(chat_format))
    stop_ids = [eos_id] + ([end_of_turn] if end_of_turn is not None else []) + generation_eos
    return Tokenizer(backend, bos_id, eos_id, list(dict.fromkeys(stop_ids)), add_bos, chat_format,
                     _default_system(template) if chat_format == "chatml" else None)
