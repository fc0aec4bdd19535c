"""Tokenizers from the Hugging Face files in a checkpoint directory, and chat prompts: rendered from
the checkpoint's own chat template (Jinja, sandboxed, as transformers renders it), or for checkpoints
that ship none, in a hand-written Llama 3 or ChatML format told by the vocabulary."""

import importlib
import json
import re
from datetime import datetime
from pathlib import Path

from .checkpoint import read_json
from .errors import UserError

# Llama 3's tokenizer.model is tiktoken BPE ranks without the split pattern or the special tokens,
# which live in Meta's code; copied from meta-llama/llama-models (the 3.1 names, same ids as 3.0).
LLAMA3_PATTERN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"  # noqa: E501
LLAMA3_SPECIAL_TOKENS = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|eom_id|>", "<|eot_id|>", "<|python_tag|>",  # eom: end of message, eot: end of turn
]
LLAMA3_SPECIAL_TOKENS += [f"<|reserved_special_token_{2 + i}|>" for i in range(256 - len(LLAMA3_SPECIAL_TOKENS))]

END_OF_TURN = {"llama3": "<|eot_id|>", "chatml": "<|im_end|>"}  # of the hand-written formats
# The markers that end a turn in the families' templates (Llama 3, ChatML, Gemma, Phi-3): where a template
# writes one, generation stops at it too, as at the end-of-text token.
TURN_ENDS = ("<|eot_id|>", "<|im_end|>", "<end_of_turn>", "<|end|>")


def _import(module: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        package = module.split(".")[0]
        raise UserError(f"this checkpoint's tokenizer needs {package}: pip install {package}") from None


class _HFTokenizers:
    def __init__(self, path: Path):
        tokenizers = _import("tokenizers")
        try:
            self.tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the library raises a bare Exception for a file it cannot parse
            raise UserError(f"{path} does not read as a tokenizer ({e}): download it again") from None
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

    def id_to_token(self, i: int) -> str:
        return self.tok.id_to_token(i)


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

    def id_to_token(self, i: int) -> str:
        return self.sp.id_to_piece(i)


class _Tiktoken:
    def __init__(self, path: Path):
        tiktoken = _import("tiktoken")
        try:
            ranks = _import("tiktoken.load").load_tiktoken_bpe(str(path))
        except ValueError:
            ranks = {}
        if not ranks:  # not base64 ranks, or none at all (an empty file)
            raise UserError(f"{path} is neither a SentencePiece model nor tiktoken BPE ranks")
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

    def id_to_token(self, i: int) -> str:
        return self.enc.decode_single_token_bytes(i).decode("utf-8", errors="replace")


def _load_tokenizer_model(path: Path):
    sp = _import("sentencepiece").SentencePieceProcessor()
    try:
        sp.Load(str(path))
    except RuntimeError:  # not a SentencePiece protobuf: Llama 3's tiktoken file has the same name
        return _Tiktoken(path)
    return _SentencePiece(sp)


def render_chat_template(template: str, messages: list[dict], special_tokens: dict[str, str]) -> str:
    """The prompt text of a dialog, ending with the assistant's turn opened, as transformers'
    apply_chat_template renders it: a sandboxed Jinja environment with the same options and helpers."""
    ImmutableSandboxedEnvironment = _import("jinja2.sandbox").ImmutableSandboxedEnvironment
    TemplateError = _import("jinja2.exceptions").TemplateError

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f))
    try:
        # tools and documents None, as transformers passes them: a template may test `tools is not none`
        return env.from_string(template).render(messages=messages, tools=None, documents=None,
                                                add_generation_prompt=True, **special_tokens)
    except TemplateError as e:
        raise UserError(f"the checkpoint's chat template cannot render this dialog: {e}") from None


class Tokenizer:
    def __init__(self, backend, bos_id: int | None, eos_id: int, stop_ids: list[int], add_bos: bool,
                 chat_template: str | None = None, special_tokens: dict[str, str] | None = None,
                 chat_format: str | None = None):
        self.backend = backend
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.stop_ids = stop_ids
        self.add_bos = add_bos
        self.chat_template = chat_template  # Jinja, from the checkpoint
        self.special_tokens = special_tokens or {}  # bos_token, eos_token...: what the template may write
        self.chat_format = chat_format  # "llama3" or "chatml", for a checkpoint without a template
        self.vocab_size = backend.vocab_size

    @property
    def can_chat(self) -> bool:
        return self.chat_template is not None or self.chat_format is not None

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
        """Messages as the chat template lays them out, ending with the assistant's turn opened. Special
        tokens come from the rendered text (a template writes its BOS itself), as in transformers."""
        return self.encode_rendered(self.dialog_text(messages))

    def encode_rendered(self, text: str) -> list[int]:
        """Ids of a dialog_text rendering (or a text that begins with one, such as a harness prompt):
        a template's rendering holds its BOS already; the hand-written formats' gets one put before it."""
        return self.encode(text) if self.chat_template is not None else self._bos() + self.encode(text)

    def dialog_text(self, messages: list[dict]) -> str:
        """encode_dialog's text: the template's whole rendering (BOS included), or the hand-written
        format's (without the BOS that encode_dialog puts before it)."""
        if self.chat_template is not None:
            return render_chat_template(self.chat_template, messages, self.special_tokens)
        if self.chat_format == "llama3":
            text = "".join(f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content'].strip()}<|eot_id|>"
                           for m in messages)
            return text + "<|start_header_id|>assistant<|end_header_id|>\n\n"
        if self.chat_format == "chatml":
            text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
            return text + "<|im_start|>assistant\n"
        raise UserError("this model has no chat format (no chat_template in tokenizer_config.json): "
                        "prompt it as plain text, without chat")

    def _bos(self) -> list[int]:
        return [self.bos_id] if self.add_bos else []


class TextPieces:
    """A growing list of token ids as text, a piece at a time. Each add() decodes the new ids with those
    of the add before (a tokenizer spaces a token by its neighbour), not the whole text again, and holds
    back a character split across tokens (U+FFFD) until it is whole; rest() gives what is held."""

    def __init__(self, tokenizer: "Tokenizer", ids: list[int] | None = None):
        self.tokenizer, self.ids = tokenizer, list(ids or [])
        self.start = self.shown = 0  # ids[start:shown] decode to the end of what add() gave

    def add(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        before, after = self._decoded()
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self.start, self.shown = self.shown, len(self.ids)
        return after[len(before):]

    def rest(self) -> str:
        before, after = self._decoded()
        return after[len(before):]

    def _decoded(self) -> tuple[str, str]:
        decode = self.tokenizer.decode
        return decode(self.ids[self.start:self.shown]), decode(self.ids[self.start:])


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
    config = read_json(directory / "tokenizer_config.json")
    if "added_tokens_decoder" not in config:  # an older checkpoint: its special_tokens_map.json wins, as in HF
        config |= read_json(directory / "special_tokens_map.json")
    generation_config = read_json(directory / "generation_config.json")

    # the config files have the last word (Qwen sets bos_token null); the backend's own ids otherwise.
    bos_id = _token_id(backend, config["bos_token"]) if "bos_token" in config else backend.bos_id
    generation_eos = generation_config.get("eos_token_id")  # an id, a list of them, null or missing
    generation_eos = [generation_eos] if isinstance(generation_eos, int) else generation_eos or []
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
    chat_format = None
    if not template:  # guess from the vocabulary's chat markers ("[INST]" is plain text to Llama 2, so it can't tell)
        template, markers = None, {"<|start_header_id|>": "llama3", "<|im_start|>": "chatml"}
        chat_format = next((fmt for marker, fmt in markers.items() if backend.token_to_id(marker) is not None), None)

    turn_ends = [m for m in TURN_ENDS if m in (template or END_OF_TURN.get(chat_format, ""))]
    stop_ids = [eos_id] + [_token_id(backend, m) for m in turn_ends] + generation_eos
    special_tokens = {k: v.get("content") if isinstance(v, dict) else v for k, v in config.items()
                      if k.endswith("_token") and isinstance(v, (str, dict))}
    special_tokens.setdefault("eos_token", backend.id_to_token(eos_id))
    if bos_id is not None:
        special_tokens.setdefault("bos_token", backend.id_to_token(bos_id))
    return Tokenizer(backend, bos_id, eos_id, list(dict.fromkeys(i for i in stop_ids if i is not None)), add_bos,
                     template, special_tokens, chat_format)
