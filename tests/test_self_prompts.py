"""Training prompts the target writes itself (`dblast data self-prompts`) and answering a
prompt file (`dblast data regenerate --prompts-file`): the filters, the resume, the
refusals, and the real sampler on the tiny SmolLM2 preset."""

import json

import jax
import numpy as np
import pytest

from dblast_jax import cli
from dblast_jax.data import self_prompts as sp
from dblast_jax.data.cli_commands import run_regenerate
from dblast_jax.data.sources import Prompt
from dblast_jax.generation import load_target

# a toy tokenizer for the scripted sampler: id i is WORDS[i]; 0 ends a query, 9 is special
WORDS = ["<end>", "how", "do", "I", "bake", "bread", "fix", "a", "bike", "<special>",
         "what", "is", "rain", "tell", "me", "why", "sky", "blue", "write", "poem"]
STOP, SPECIAL, WIDTH = 0, 9, 8
QUERIES = [  # what the scripted target may write; the filters' fate in the comment
    [1, 2, 3, 4, 5],          # kept (the first time), then a duplicate
    [1, 2, 3, 6, 7, 8],       # kept
    [10, 11, 12],             # a known prompt ("what is rain") -> dropped
    [13, 14],                 # two words -> too short
    [15, 11, 16, 17],         # kept
    [18, 7, 19, 9, 12],       # holds a special token
    [1, 2, 3, 4, 5, 6, 7, 8, 10],  # runs past WIDTH -> unfinished
    [18, 7, 19, 12],          # kept
    [10, 11, 7, 8],           # kept
]


def decode(ids, skip_special_tokens=True):
    return " ".join(WORDS[i] for i in ids if not (skip_special_tokens and i == SPECIAL))


def scripted_sampler(key, batch):
    """QUERIES in an order the key picks (the same key gives the same batch; a batch of 9
    holds every one)."""
    rng = np.random.default_rng(np.asarray(jax.random.key_data(key)).astype(np.uint64).sum())
    order = rng.permutation(len(QUERIES))
    tokens = np.full((batch, WIDTH), 0, np.int32)
    num = np.zeros(batch, np.int32)
    for b in range(batch):
        q = QUERIES[order[b % len(QUERIES)]] + [STOP]
        n = min(len(q), WIDTH)
        tokens[b, :n], num[b] = q[:n], n
    return tokens, num


scripted_sampler.stop_tokens = (STOP,)
KNOWN = [Prompt(id="1", source="eval", turns=("What is rain?",))]


def _sample(folder, count, **kw):
    kw.setdefault("cfg", sp.SelfPromptConfig(batch_size=4))
    return sp.sample_self_prompts(folder, count, scripted_sampler, decode, known=KNOWN,
                                  progress=False, **kw)


def test_filters_keep_only_new_finished_plain_queries(tmp_path):
    summary = _sample(tmp_path / "p", 5, cfg=sp.SelfPromptConfig(batch_size=9))
    kept = [p.turns[0] for p in sp.read_prompt_file(tmp_path / "p")]
    assert sorted(kept) == sorted(["how do I bake bread", "how do I fix a bike",
                                   "why is sky blue", "write a poem rain", "what is a bike"])
    d = summary["dropped"]
    assert set(d) == {"unfinished", "special_tokens", "too_short", "duplicate", "known_prompt"}
    assert summary == dict(summary, kept=5, batches=1, sampled=9)
    assert d == dict(unfinished=1, special_tokens=1, too_short=1, duplicate=0, known_prompt=1)
    state = json.loads((tmp_path / "p" / "state.json").read_text())
    assert state["kept"] == 5 and state["settings"]["batch_size"] == 9


def test_a_killed_run_resumes_to_what_an_unbroken_one_writes(tmp_path):
    _sample(tmp_path / "whole", 4)
    with pytest.raises(ValueError, match=r"only \d of 4 queries kept after 1 batches"):
        _sample(tmp_path / "broken", 4, max_batches=1)
    _sample(tmp_path / "broken", 4)
    assert ((tmp_path / "broken" / "prompts.jsonl").read_text()
            == (tmp_path / "whole" / "prompts.jsonl").read_text())
    # a larger count extends the folder and keeps what it held
    _sample(tmp_path / "whole", 5)
    lines = (tmp_path / "whole" / "prompts.jsonl").read_text().splitlines()
    assert len(lines) == 5 and "\n".join(lines[:4]) + "\n" == \
        (tmp_path / "broken" / "prompts.jsonl").read_text()


def test_an_uncommitted_batch_is_sampled_again(tmp_path):
    _sample(tmp_path / "p", 2)
    before = (tmp_path / "p" / "prompts.jsonl").read_text()
    # a kill between prompts.jsonl and state.json leaves extra lines: they are dropped
    with open(tmp_path / "p" / "prompts.jsonl", "a") as f:
        f.write(json.dumps({"id": "x", "source": "self", "turns": ["an orphan line here"]}) + "\n")
    _sample(tmp_path / "p", 2)
    assert (tmp_path / "p" / "prompts.jsonl").read_text() == before


def test_refusals(tmp_path):
    _sample(tmp_path / "p", 2)
    with pytest.raises(ValueError, match=r"other settings \(seed"):
        _sample(tmp_path / "p", 2, cfg=sp.SelfPromptConfig(batch_size=4, seed=1))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="holds other files"):
        _sample(tmp_path / "other", 2)
    (tmp_path / "p" / "prompts.jsonl").write_text("")
    with pytest.raises(ValueError, match="was edited"):
        _sample(tmp_path / "p", 3)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        sp.SelfPromptConfig(temperature=0)
    with pytest.raises(ValueError, match="count must be >= 1"):
        _sample(tmp_path / "q", 0)


def test_read_prompt_file(tmp_path):
    f = tmp_path / "mine.jsonl"
    f.write_text('{"prompt": "one"}\n\n{"id": "b", "source": "s", "turns": ["two", "three"]}\n')
    a, b = sp.read_prompt_file(f)
    assert (a.id, a.source, a.turns) == ("1", "mine", ("one",))
    assert (b.id, b.source, b.turns) == ("b", "s", ("two", "three"))
    for text, message in [('{"prompt": "x"}\nnot json\n', r"mine.jsonl:2: not valid JSON"),
                          ('{"prompt": "x", "turns": ["y"]}\n', "'turns' .* or 'prompt'"),
                          ('{"turns": "x"}\n', "must be a list of strings"),
                          ('{"turns": [""]}\n', "non-empty text turns"),
                          ("\n", "holds no prompts")]:
        f.write_text(text)
        with pytest.raises(ValueError, match=message):
            sp.read_prompt_file(f)
    with pytest.raises(FileNotFoundError, match="no prompt file at"):
        sp.read_prompt_file(tmp_path / "absent.jsonl")


@pytest.fixture(scope="module")
def tiny():
    return load_target("tiny-smollm2")


def test_pre_query_tokens_start_every_conversation(tiny):
    tok = tiny.tokenizer
    for system in (None, "Be brief."):
        ids = sp.pre_query_tokens(tok, system)
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": "Hello there"}]
        full = tok.encode_chat(messages)
        assert full[:len(ids)] == ids
        assert tok.decode(ids, skip_special_tokens=False).endswith("<|im_start|>user\n")
        assert "Hello" in tok.decode(full[len(ids):])


def test_the_target_sampler_on_the_tiny_preset(tiny, tmp_path):
    cfg = sp.SelfPromptConfig(max_query_tokens=5, batch_size=3)
    sample = sp.target_batch_sampler(tiny, cfg)
    tokens, num = sample(jax.random.PRNGKey(0), 3)
    assert tokens.shape == (3, 5) and num.shape == (3,)
    assert 2 in sample.stop_tokens  # <|im_end|> ends a user turn
    again, _ = sample(jax.random.PRNGKey(0), 3)
    np.testing.assert_array_equal(tokens, again)
    # random weights never end a query: the run stops with a clear line, nothing kept
    with pytest.raises(ValueError, match="rarely ends a query"):
        sp.sample_self_prompts(tmp_path / "p", 2, sample, tiny.tokenizer.decode, cfg=cfg,
                               known=[], max_batches=1, progress=False)
    assert json.loads((tmp_path / "p" / "state.json").read_text())["dropped"]["unfinished"] == 3


def test_cli_self_prompts_then_regenerate_answers_them(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sp, "target_batch_sampler", lambda target, cfg: scripted_sampler)
    monkeypatch.setattr(sp, "_known_prompts", lambda: KNOWN)
    monkeypatch.setattr(type(tiny.tokenizer), "decode",
                        lambda self, ids, skip_special_tokens=True: decode(ids,
                                                                           skip_special_tokens))
    out = tmp_path / "prompts"
    assert cli.main(["data", "self-prompts", "--model", "tiny-smollm2", "--out", str(out),
                     "--count", "3", "--batch-size", "4", "--no-progress"]) == 0
    said = capsys.readouterr().out
    assert f"{out}: 3 prompts from" in said and "known_prompt" in said
    monkeypatch.undo()
    corpus = tmp_path / "corpus"
    assert cli.main(["data", "regenerate", "--model", "tiny-smollm2", "--out", str(corpus),
                     "--prompts-file", str(out), "--max-new-tokens", "4", "--shard-size", "2",
                     "--batch-size", "2", "--verify-temperatures", "none",
                     "--no-progress"]) == 0
    manifest = json.loads((corpus / "manifest.json").read_text())
    assert manifest["prompts"]["count"] == 3 and manifest["complete"]
    assert manifest["prompts"]["sources"] == {"self": 3}
    with pytest.raises(ValueError, match="give one"):
        run_regenerate("tiny-smollm2", str(tmp_path / "c2"), prompts_file=str(out),
                       prompts_from=f"{corpus}:0:1")
