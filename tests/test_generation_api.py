"""The user-facing API (`dj.load_target`, `dj.generate`, `dj.speculative_generate`) and CLI."""

import json

import jax
import numpy as np
import pytest

import dblast_jax as dj
from dblast_jax import cli
from dblast_jax.generation import acceptance_stats, init_drafter, speculative_generate


def test_acceptance_stats_by_hand():
    accepted = np.array([[2, 0, -1], [3, 1, 0]])
    expected = np.array([[1.5, 0.5, 0.0], [2.0, 1.0, 0.5]])
    s = acceptance_stats(accepted, expected, block_size=4)
    assert s["steps"] == 5
    assert s["tau"] == pytest.approx(np.mean([2, 0, 3, 1, 0]) + 1)
    assert s["tau_expected"] == pytest.approx(np.mean([1.5, 0.5, 2.0, 1.0, 0.5]) + 1)
    assert s["histogram"] == [2, 1, 1, 1]
    # P(accept 1 | reached 1) = 3/5; P(accept 2 | accepted 1) = 2/3; P(3 | 2) = 1/2
    assert s["per_position_acceptance"] == pytest.approx([3 / 5, 2 / 3, 1 / 2])


def test_generate_and_speculative_generate_on_token_prompts():
    target = dj.load_target("tiny-qwen3")
    assert target.tokenizer is None
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    greedy = dj.SamplingConfig(temperature=0.0, max_new_tokens=6, stop_tokens=(10**6,))
    plain = dj.generate(target, prompts, greedy)
    assert [len(t) for t in plain.tokens] == [6, 6] and plain.text == [None, None]
    drafter = init_drafter(target, dj.DrafterConfig.for_target(target.config, block_size=4,
                                                               num_categories=2))
    spec = speculative_generate(target, drafter, prompts, greedy)
    assert spec.tokens == plain.tokens
    assert spec.stats["steps"] >= 1 and 1.0 <= spec.stats["tau"] <= 4.0
    assert spec.timing["new_tokens"] == 12


def test_bad_inputs_are_named():
    target = dj.load_target("tiny-llama")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        dj.generate(target, [[1, 2, 10**6]])
    with pytest.raises(ValueError, match="no tokenizer"):
        dj.generate(target, ["text needs a tokenizer"])
    with pytest.raises(ValueError, match="empty prompt"):
        dj.generate(target, [[]])
    with pytest.raises(FileNotFoundError, match="neither a known preset"):
        dj.load_target("/nonexistent/model")
    with pytest.raises(ValueError, match="exceed the model's context"):
        dj.generate(target, [[1, 2, 3]], dj.SamplingConfig(max_new_tokens=10**5))
    with pytest.raises(ValueError, match="verify_mode"):
        dj.SamplingConfig(verify_mode="bogus")


def test_cli_fetch_rejects_unknown_names(capsys):
    assert cli.main(["fetch", "no-such-file"]) == 2
    assert "unknown file" in capsys.readouterr().err


def test_cli_generate_errors_cleanly(capsys):
    assert cli.main(["generate", "--model", "/nonexistent", "--prompt", "hi"]) == 2
    assert "neither a known preset" in capsys.readouterr().err


@pytest.mark.real_model
def test_cli_generate_real_model_json_with_random_drafter(capsys):
    code = cli.main(["generate", "--prompt", "Say hi.", "--max-new-tokens", "6", "--json",
                     "--drafter", "random"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == "smollm2-135m-instruct"
    assert 1 <= len(out["tokens"][0]) <= 6 and isinstance(out["text"][0], str)
    assert out["stats"]["steps"] >= 1


def test_cli_train_resume_and_export_round_trip(tmp_path, capsys):
    workdir, out = str(tmp_path / "run"), str(tmp_path / "export")
    common = ["--override", "batch_size=2", "--override", "seq_len=24",
              "--override", "anchors_per_sequence=2"]
    assert cli.main(["train", "--workdir", workdir, "--experiment", "tiny_dflash",
                     "--override", "num_steps=3", "--stop-at", "2"] + common) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step"] == 2
    # the workdir alone resumes the run to its end
    assert cli.main(["train", "--workdir", workdir]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step"] == 3
    assert cli.main(["export", workdir, "--out", out]) == 0
    drafter = dj.load_drafter(out, dj.load_target("tiny-llama"))
    assert drafter.config.block_size >= 2
    assert json.loads(open(f"{out}/config.json").read())["torch_dtype"] == "float32"
    # --dtype applies to a workdir as well (it was silently ignored there)
    assert cli.main(["export", workdir, "--out", out + "_bf16", "--dtype", "bfloat16"]) == 0
    assert json.loads(open(f"{out}_bf16/config.json").read())["torch_dtype"] == "bfloat16"
    half = dj.load_drafter(out + "_bf16", dj.load_target("tiny-llama"))
    for a, b in zip(jax.tree.leaves(half.params), jax.tree.leaves(drafter.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-2, atol=1e-2)


def test_cli_eval_needs_named_drafters(capsys):
    assert cli.main(["eval", "--model", "tiny-llama", "--drafter", "nameless"]) == 2
    assert "NAME=FOLDER" in capsys.readouterr().err


def test_warmup_compiles_once_per_shape_and_matches_an_unwarmed_call():
    """An evaluation over many prompts compiles each padded shape once, ahead of time (no
    extra untimed generation), and the compiled executable gives the tokens a plain jitted
    call gives, for plain, trained-drafter and n-gram speculative generation."""
    import dblast_jax.generation as gen
    target = gen.load_target("tiny-llama", seed=5)
    # settings no other test uses, so no earlier test compiled this signature
    sampling = dj.SamplingConfig(temperature=0.9, top_k=13, max_new_tokens=4)
    first = gen.generate(target, [[5, 6, 7]], sampling, rng=1, warmup=True)
    # another prompt in the same length bucket: same shapes, no second compile
    second = gen.generate(target, [[9, 8, 7, 6]], sampling, rng=2, warmup=True)
    other = gen.generate(target, [list(range(1, 40))], sampling, rng=3, warmup=True)
    assert first.timing["warmup_seconds"] > 0
    assert second.timing["warmup_seconds"] == 0.0
    assert other.timing["warmup_seconds"] > 0  # a new bucket compiles again
    assert second.tokens == gen.generate(target, [[9, 8, 7, 6]], sampling, rng=2).tokens
    drafters = [init_drafter(target, dj.DrafterConfig.for_target(
        target.config, block_size=4, num_categories=2)), gen.ngram_drafter(block_size=4, max_n=3)]
    for drafter in drafters:
        runs = [speculative_generate(target, drafter, [[5, 6, 7, 5, 6]], sampling, rng=4,
                                     warmup=w) for w in (True, True, False)]
        assert runs[0].timing["warmup_seconds"] > 0 and runs[1].timing["warmup_seconds"] == 0
        assert runs[0].tokens == runs[1].tokens == runs[2].tokens
        assert runs[0].stats["tau"] == runs[2].stats["tau"]
    assert [gen.prompt_bucket(n) for n in (1, 64, 65, 512, 513)] == [16, 16, 64, 64, 256]
