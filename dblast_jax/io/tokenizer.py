"""Tokenizers and chat templates without `transformers` at run time.

`Tokenizer` wraps a `tokenizers.Tokenizer` (the Rust library) and renders chat
templates with a sandboxed jinja2 environment that offers the helpers Hugging Face
templates expect (`raise_exception`, `strftime_now`, `tojson`). Two sources:

* `Tokenizer.from_file`: a `tokenizer.json` (+ `tokenizer_config.json` beside it for
  the chat template and special tokens), e.g. Qwen3's.
* `Tokenizer.from_gguf_metadata`: the byte-level BPE described by a GGUF file's
  `tokenizer.ggml.*` metadata, with the pre-tokenizer llama.cpp uses for the file's
  `tokenizer.ggml.pre` kind (SmolLM2: "smollm" = every number character isolated, then
  the GPT-2 split).
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as _Backend

from dblast_jax.io.gguf import read_metadata

# llama.cpp token types (tokenizer.ggml.token_type)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 2, 3, 4

# Tokens that end an assistant turn in the chat formats we use (ChatML, Qwen3).
_TURN_END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>")

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _byte_level(use_regex: bool) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_regex)


def _regex_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                                    _byte_level(False)])


# tokenizer.ggml.pre kind -> (pre-tokenizer factory, ignore_merges)
PRE_TOKENIZERS = {
    # digits isolated one by one (all Unicode number characters), then the GPT-2 split
    "smollm": (lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True), _byte_level(True)]), False),
    "gpt2": (lambda: _byte_level(True), False),
    "default": (lambda: _byte_level(True), False),
    "llama-bpe": (lambda: _regex_then_bytes(_LLAMA3_SPLIT), True),
    "llama3": (lambda: _regex_then_bytes(_LLAMA3_SPLIT), True),
    "qwen2": (lambda: _regex_then_bytes(_QWEN2_SPLIT), False),
}


def bytes_to_unicode() -> dict[int, str]:
    """The GPT-2 byte alphabet: printable bytes stand for themselves, the other bytes are
    shifted to code points from 256 on, in byte order."""
    printable = [b for b in range(256)
                 if ord("!") <= b <= ord("~") or 0xA1 <= b <= 0xAC or 0xAE <= b <= 0xFF]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _token_content(value: Any) -> Optional[str]:
    """tokenizer_config special tokens are a string, None, or an AddedToken dict."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        return value.get("content")
    raise ValueError(f"cannot read a special token from {value!r}")


def _tojson(value, indent=None, separators=None, sort_keys=False, ensure_ascii=False):
    return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys,
                      ensure_ascii=ensure_ascii)


def _raise_exception(message: str):
    from jinja2.exceptions import TemplateError
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _compile_template(source: str):
    from jinja2 import ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class Tokenizer:
    """Text <-> ids plus the chat template of one model."""

    def __init__(self, backend: _Backend, *, chat_template: Optional[str] = None,
                 bos_token: Optional[str] = None, eos_token: Optional[str] = None,
                 pad_token: Optional[str] = None, unk_token: Optional[str] = None,
                 extra_stop_tokens: Sequence[str] = (), name: str = ""):
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token, self.eos_token = bos_token, eos_token
        self.pad_token, self.unk_token = pad_token, unk_token
        self.name = name
        self._extra_stop_tokens = tuple(extra_stop_tokens)
        self._template = None

    # ---- ids ----------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Special-token strings in `text` (e.g. "<|im_start|>") become their single id.

        `add_special_tokens` runs the backend's post-processor (e.g. a BOS prefix); off
        by default because chat templates write their own special tokens.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> Optional[int]:
        return self.backend.token_to_id(token)

    def id_to_token(self, i: int) -> Optional[str]:
        return self.backend.id_to_token(int(i))

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (base vocabulary + added tokens)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def _id(self, token: Optional[str]) -> Optional[int]:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def bos_id(self) -> Optional[int]:
        return self._id(self.bos_token)

    @property
    def eos_id(self) -> Optional[int]:
        return self._id(self.eos_token)

    @property
    def pad_id(self) -> Optional[int]:
        return self._id(self.pad_token)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Ids that end a generated chat turn: eos plus the known turn/document ends."""
        ids = []
        for tok in (self.eos_token, *_TURN_END_TOKENS, *self._extra_stop_tokens):
            i = self._id(tok)
            if i is not None and i not in ids:
                ids.append(i)
        return tuple(ids)

    # ---- chat ---------------------------------------------------------------------
    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            add_generation_prompt: bool = True, enable_thinking: bool = False,
                            **kwargs: Any) -> str:
        """Render a conversation ([{"role": ..., "content": ...}, ...]) to the prompt text.

        `enable_thinking=False` asks templates that support it (Qwen3) for a direct answer
        (an empty think block); templates without it ignore it. Extra keyword arguments
        (e.g. `tools`) are passed to the template as Hugging Face does.
        """
        if not self.chat_template:
            raise ValueError(f"tokenizer {self.name or ''} has no chat template; load one with "
                             "a tokenizer_config.json or pass chat_template=")
        if not messages:
            raise ValueError("apply_chat_template needs at least one message")
        for i, m in enumerate(messages):
            if "role" not in m or "content" not in m:
                raise ValueError(f"message {i} needs 'role' and 'content' keys, got {sorted(m)}")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        context = dict(bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                       pad_token=self.pad_token, unk_token=self.unk_token, tools=None,
                       documents=None)
        context.update(kwargs)
        return self._template.render(messages=[dict(m) for m in messages],
                                     add_generation_prompt=add_generation_prompt,
                                     enable_thinking=enable_thinking, **context)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]],
                    add_generation_prompt: bool = True, enable_thinking: bool = False,
                    **kwargs: Any) -> list[int]:
        """Ids of the rendered conversation (the template supplies all special tokens)."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt,
                                                    enable_thinking, **kwargs))

    # ---- constructors -------------------------------------------------------------
    @classmethod
    def from_file(cls, path: os.PathLike | str, chat_template: Optional[str] = None,
                  tokenizer_config: Optional[os.PathLike | str] = None) -> "Tokenizer":
        """From a folder holding tokenizer.json (or the file itself); tokenizer_config.json
        beside it (or at `tokenizer_config`) supplies the chat template and the special
        tokens when present."""
        path = Path(path)
        tok_json = path / "tokenizer.json" if path.is_dir() else path
        if not tok_json.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {tok_json}")
        try:
            backend = _Backend.from_file(str(tok_json))
        except Exception as e:
            raise ValueError(f"{tok_json} is not a valid tokenizers file: {e}") from e
        config: dict = {}
        cfg_path = Path(tokenizer_config) if tokenizer_config else (
            tok_json.parent / "tokenizer_config.json")
        if tokenizer_config and not cfg_path.is_file():
            raise FileNotFoundError(f"no tokenizer config at {cfg_path}")
        if cfg_path.is_file():
            try:
                config = json.loads(cfg_path.read_text(encoding="utf-8"))
            except ValueError as e:
                raise ValueError(f"{cfg_path} is not valid JSON: {e}") from e
        template = chat_template or config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = tok_json.parent / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        return cls(backend, chat_template=template,
                   bos_token=_token_content(config.get("bos_token")),
                   eos_token=_token_content(config.get("eos_token")),
                   pad_token=_token_content(config.get("pad_token")),
                   unk_token=_token_content(config.get("unk_token")),
                   name=str(tok_json.parent.name))

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any], pre_tokenizer: Optional[str] = None,
                           chat_template: Optional[str] = None) -> "Tokenizer":
        """A byte-level BPE from GGUF `tokenizer.ggml.*` metadata (see `gguf.read_metadata`).

        `pre_tokenizer` overrides the file's `tokenizer.ggml.pre` kind (one of
        `PRE_TOKENIZERS`). Tokens typed CONTROL become special tokens (matched whole in
        text, dropped by `decode(skip_special_tokens=True)`); USER_DEFINED ones become
        plain added tokens.
        """
        kind = metadata.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"GGUF tokenizer model {kind!r} is not supported; only byte-level "
                             "BPE ('gpt2') is")
        try:
            tokens = list(metadata["tokenizer.ggml.tokens"])
            merges = list(metadata["tokenizer.ggml.merges"])
        except KeyError as e:
            raise ValueError(f"GGUF metadata lacks {e.args[0]}") from None
        types = list(metadata.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens))
        if len(types) != len(tokens):
            raise ValueError(f"tokenizer.ggml.token_type has {len(types)} entries for "
                             f"{len(tokens)} tokens")
        pre = pre_tokenizer or metadata.get("tokenizer.ggml.pre") or "default"
        if pre not in PRE_TOKENIZERS:
            raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported; known: "
                             f"{', '.join(sorted(PRE_TOKENIZERS))}")
        make_pre, ignore_merges = PRE_TOKENIZERS[pre]

        alphabet = set(bytes_to_unicode().values())
        spell = bytes_to_unicode()
        vocab: dict[str, int] = {}
        for i, tok in enumerate(tokens):
            if types[i] not in (TOKEN_CONTROL, TOKEN_USER_DEFINED) and not set(tok) <= alphabet:
                tok = "".join(spell[b] for b in tok.encode("utf-8"))  # raw text -> byte alphabet
            vocab.setdefault(tok, i)
        pairs = []
        for m in merges:
            parts = m.split(" ")
            if len(parts) != 2:
                raise ValueError(f"malformed GGUF merge {m!r} (expected 'left right')")
            pairs.append((parts[0], parts[1]))
        backend = _Backend(models.BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges))
        backend.pre_tokenizer = make_pre()
        backend.decoder = decoders.ByteLevel()

        special = [AddedToken(t, special=True, normalized=False)
                   for t, ty in zip(tokens, types) if ty == TOKEN_CONTROL and t in vocab]
        user = [AddedToken(t, special=False, normalized=False)
                for t, ty in zip(tokens, types) if ty == TOKEN_USER_DEFINED]
        if special:
            backend.add_special_tokens(special)
        if user:
            backend.add_tokens(user)

        def tok_of(key):
            i = metadata.get(f"tokenizer.ggml.{key}")
            return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

        bos, eos = tok_of("bos_token_id"), tok_of("eos_token_id")
        if metadata.get("tokenizer.ggml.add_bos_token") and bos is not None:
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                special_tokens=[(bos, tokens.index(bos))])
        if backend.get_vocab_size(with_added_tokens=True) != len(tokens):
            raise ValueError(f"GGUF vocabulary has {len(tokens)} tokens but the rebuilt "
                             f"tokenizer has {backend.get_vocab_size(with_added_tokens=True)} "
                             "(duplicate or mis-typed tokens)")
        return cls(backend, chat_template=chat_template or metadata.get("tokenizer.chat_template"),
                   bos_token=bos, eos_token=eos, pad_token=tok_of("padding_token_id"),
                   unk_token=tok_of("unknown_token_id"),
                   name=str(metadata.get("general.name", "gguf")))

    @classmethod
    def from_gguf(cls, path: os.PathLike | str, **kwargs: Any) -> "Tokenizer":
        """Read only the metadata of a GGUF file and build its tokenizer."""
        return cls.from_gguf_metadata(read_metadata(path), **kwargs)

    def __repr__(self) -> str:
        return (f"Tokenizer({self.name!r}, vocab_size={self.vocab_size}, bos={self.bos_id}, "
                f"eos={self.eos_id}, chat_template={'yes' if self.chat_template else 'no'})")
