"""Every training recipe uses a mask TOKEN (as DFlash does), one its text never contains.

A K = 1 drafter trained with a token mask exports as a plain DFlash checkpoint (loadable
by z-lab's `dflash` package and vLLM: test_dflash_interop.py); the learned mask
embedding (`drafter.mask_token_id=none`, or the flat `mask_token_id=-1`) stays available
as an override.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from dblast_jax.config import TargetConfig
from dblast_jax.io import dflash
from dblast_jax.train import config as TC

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPORA = ("smollm2_t1", "smollm2_heldout_t15", "smollm2_t0", "smollm2_t0_heldout", "smollm2_t1_more")


def test_every_recipe_trains_with_a_mask_token():
    by_family = {"tiny": TC.TINY_MASK_TOKEN_ID, "smollm2": TC.SMOLLM2_MASK_TOKEN_ID,
                 "qwen3": TC.QWEN3_MASK_TOKEN_ID}
    for name in TC.list_experiments():
        cfg = TC.get_experiment(name)
        assert cfg.drafter.mask_token_id >= 0, name
        want = by_family.get(name.split("_")[0])
        assert want is None or cfg.drafter.mask_token_id == want, name
    assert {n.split("_")[0] for n in TC.list_experiments()} >= set(by_family)
    dc = TC.get_experiment("smollm2_dflash_baseline").drafter_config(TargetConfig.smollm2_135m())
    assert dc.mask_token_id == 16 and not dflash.needs_dblast_extras(dc)  # a DFlash export
    assert dflash.dflash_config_dict(dc)["dflash_config"]["mask_token_id"] == 16
    # the learned mask is still one override away
    for override in ("drafter.mask_token_id=none", "mask_token_id=-1"):
        learned = TC.get_experiment("smollm2_dflash_baseline", [override])
        assert learned.drafter_config(TargetConfig.smollm2_135m()).mask_token_id is None


def test_demo_drafters_use_the_mask_token(tmp_path):
    from dblast_jax.demo import DemoConfig, _train_config
    for demo in (DemoConfig(), DemoConfig.tiny()):
        for _, experiment in demo.drafters:
            cfg = _train_config(demo, experiment, tmp_path / "corpus")
            assert cfg.drafter.mask_token_id == TC.SMOLLM2_MASK_TOKEN_ID, (demo.model, experiment)


@pytest.mark.parametrize("corpus", CORPORA)
def test_smollm2_mask_token_never_occurs_in_the_corpora(corpus):
    from dblast_jax.data.corpus import Corpus
    folder = os.path.join(ROOT, "corpora", corpus)
    if not os.path.isdir(folder):
        pytest.skip(f"{folder} is not in this checkout")
    data = Corpus(folder)
    seen = 0
    for k in range(len(data.shards)):
        tokens = data.shard(k)["tokens"]
        seen += tokens.size
        assert not np.any(tokens == TC.SMOLLM2_MASK_TOKEN_ID), (corpus, k)
    assert seen > 10_000


def test_tiny_mask_token_never_occurs_in_synthetic_records():
    from dblast_jax.train.batches import SyntheticMultiModal
    cfg = TC.get_experiment("tiny_dflash")
    lang = SyntheticMultiModal(TargetConfig.tiny_llama().vocab_size,
                               block_size=cfg.drafter.block_size, seq_len=cfg.seq_len, temperature=cfg.verify_temperature)
    for i in range(200):
        assert TC.TINY_MASK_TOKEN_ID not in lang[i]["tokens"]


@pytest.mark.real_model
def test_smollm2_mask_token_is_a_reserved_special_token():
    from dblast_jax.io import fetch
    from dblast_jax.io.gguf import read_metadata
    from dblast_jax.io.presets import PRESETS
    from dblast_jax.io.tokenizer import Tokenizer
    meta = read_metadata(fetch.fetch(PRESETS["smollm2-135m-instruct"]))
    i = TC.SMOLLM2_MASK_TOKEN_ID
    assert meta["tokenizer.ggml.tokens"][i] == "<empty_output>"
    assert meta["tokenizer.ggml.token_type"][i] == 3  # control token
    tok = Tokenizer.from_gguf_metadata(meta)
    assert i not in tok.stop_ids
    chat = tok.encode_chat([{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": "Write a Python function."},
                            {"role": "assistant", "content": "def f():\n    return 1"}])
    assert i not in chat
