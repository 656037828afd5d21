"""The shipped K = 1 drafter is a plain DFlash checkpoint for the real SmolLM2.

`pretrained:smollm2-dflash-k1` (and its re-export by `dblast export pretrained:NAME`)
loads in z-lab's reference package (`dflash==0.1.0`) with no missing or unexpected
tensors, and the reference speculative loop at T = 0, run on transformers' SmolLM2 from
the same GGUF file our loader reads, gives our tokens and, step by step, our acceptance
lengths (the convention is test_dflash_interop.py's: DFlash counts accepted drafts + 1).
"""

from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = [pytest.mark.torch,
              pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")]

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
dfm = pytest.importorskip(
    "dflash.model", reason="z-lab's dflash package is not installed; install it with "
                           "`pip install --no-deps dflash==0.1.0` (README's test command)")

from dblast_jax import cli, generation, pretrained  # noqa: E402
from dblast_jax.config import SamplingConfig  # noqa: E402

NAME = "smollm2-dflash-k1"
NEW_TOKENS = 24
PROMPT = "Give three tips for staying healthy."


@pytest.fixture(autouse=True)
def _cpu_timer(monkeypatch):
    monkeypatch.setattr(dfm, "_cuda_time", time.perf_counter)  # it syncs CUDA otherwise


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """(the shipped folder, its re-export through the CLI)."""
    shipped = str(pretrained.pretrained_folder(NAME, target="smollm2-135m-instruct"))
    out = str(tmp_path_factory.mktemp("reexport") / NAME)
    assert cli.main(["export", f"{pretrained.PREFIX}{NAME}", "--out", out]) == 0
    return shipped, out


def test_shipped_k1_loads_as_dflash_with_every_tensor(exports):
    for folder in exports:
        with open(os.path.join(folder, "config.json")) as fh:
            cfg = json.load(fh)
        assert cfg["architectures"] == ["DFlashDraftModel"]
        assert isinstance(cfg["dflash_config"]["mask_token_id"], int)
        assert "dblast_config" not in cfg  # nothing DBlast-only
        ref, info = dfm.DFlashDraftModel.from_pretrained(folder, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], (folder, info)
        assert not info["mismatched_keys"] and not info["error_msgs"], (folder, info)
        assert ref.mask_token_id == cfg["dflash_config"]["mask_token_id"]


def test_shipped_k1_generates_our_greedy_tokens_in_dflash(exports, smollm2_jax, smollm2_hf):
    import dblast_jax as dj
    from dblast_jax.sampler import cache_size_for, pad_prompts, speculative_generate_tokens

    tc, tp, tok = smollm2_jax
    target = dj.Target(tc, tp, tok, "smollm2-135m-instruct")
    drafter = generation.drafter_from_spec(exports[1], target)
    dc, dp = drafter.config, drafter.params
    prompt = generation.encode_prompts(target, [PROMPT])[0]
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=NEW_TOKENS)
    tokens, lengths = pad_prompts([prompt], multiple=16)
    out, counts, accepted, _ = speculative_generate_tokens(
        tp, dp, jnp.asarray(tokens), jnp.asarray(lengths), jax.random.key(0),
        target_config=tc, drafter_config=dc, sampling=sampling,
        cache_size=cache_size_for(tokens.shape[1], NEW_TOKENS, extra=dc.block_size))
    ours = np.asarray(out)[0, :int(counts[0])].tolist()
    acc = [int(a) for a in np.asarray(accepted)[0] if a >= 0]

    model = smollm2_hf[0]
    ref = dfm.DFlashDraftModel.from_pretrained(exports[1]).eval()
    with torch.no_grad():
        res = dfm.dflash_generate(ref, model, torch.tensor([prompt]), NEW_TOKENS, [],
                                  temperature=0.0, return_stats=True)
    theirs = res.output_ids[0, len(prompt):].tolist()
    assert theirs == ours
    # DFlash's per-step lengths = our accepted + 1 on every step that verified a full block
    # (the last may be cut to the tokens still wanted)
    got, done = list(res.acceptance_lengths), 1
    want = []
    for n in acc:
        if done >= NEW_TOKENS:
            break
        want.append(min(n + 1, NEW_TOKENS - done))
        done += want[-1]
    full = [NEW_TOKENS - d + 1 >= dc.block_size
            for d in np.cumsum([1] + want[:-1])]
    n_full = sum(full)
    assert got[:n_full] == want[:n_full], (got, want)
    assert sum(got) == sum(want) == len(ours) - 1
    assert max(acc) >= 1, acc  # drafts are accepted: a real comparison
