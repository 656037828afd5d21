"""TrainConfig / DemoConfig hold the drafter's shape as one DrafterSpec; the flat fields of
before (train_config.json of older runs, scripts, command lines) still mean the same."""

from __future__ import annotations

import dataclasses
import json

import pytest

from dblast_jax.config import DrafterSpec, TargetConfig
from dblast_jax.demo import DemoConfig, _old_settings, parse_demo_overrides
from dblast_jax.train import config as TC

# runs/budget/taps5/train_config.json as the code of before DrafterSpec wrote it (flat)
FLAT_TRAIN_CONFIG = json.loads("""
{"adam_b1": 0.9, "adam_b2": 0.95, "anchors_per_sequence": 16, "batch_size": 8,
"block_size": 8, "checkpoint_every": 50, "data": "corpora/smollm2_t1", "data_shards": 68,
"distill_topk": 64, "distill_weight": 0.0, "drafter_init": "random",
"drafter_intermediate_size": 0, "drafter_layers": 1, "end_lr_fraction": 0.0,
"expander_width": -1, "export": false, "feature_cache": "runs/budget/features",
"feature_cache_dtype": "float32", "gamma": 4.0, "grad_accum_steps": 1, "grad_clip": 1.0,
"keep_checkpoints": 2, "lam": 1.0, "lam_delay_fraction": 0.0, "lam_warmup_fraction": 0.1,
"learning_rate": 0.001, "log_every": 1, "logits_chunk_size": 8192,
"logits_row_chunk_size": 0, "logp_source": "auto", "loss": "dflash", "mask_token_id": 16,
"max_skipped_steps": 10, "mesh": [-1, 1, 1], "name": "smollm2_dflash_baseline",
"nll_position_decay": false, "nonfinite_policy": "error", "num_categories": 1,
"num_steps": 1000, "param_dtype": "float32", "seed": 0, "seq_len": 256,
"synthetic_logit_scale": 3.0, "synthetic_num_phrases": 4, "synthetic_phrase_len": 3,
"target": "smollm2-135m-instruct", "target_layer_ids": [1, 7, 14, 20, 27], "tau_end":
0.0, "tau_start": 0.0, "tau_transition_fraction": 0.5, "tensorboard": true, "track_al":
true, "validate_every": 0, "validation_batches": 4, "validation_data": "",
"validation_shards": "", "verify_temperature": 1.0, "wandb_project": "",
"wandb_run_name": "", "warmup_fraction": 0.04, "weight_decay": 0.01}
""")
# ... and the drafter_config of that run's experiment.json
RECORDED_DRAFTER = dict(block_size=8, expander_width=0, head_dim=64, hidden_size=576,
                        intermediate_size=1536, mask_token_id=16, num_categories=1,
                        num_heads=9, num_kv_heads=3, num_layers=1, num_target_layers=30,
                        rms_norm_eps=1e-05, rope_theta=100000.0,
                        target_layer_ids=(1, 7, 14, 20, 27), vocab_size=49152)
SMOLLM2 = TargetConfig.smollm2_135m()


def test_flat_train_config_json_loads_as_the_nested_config():
    old = TC.TrainConfig.from_dict(FLAT_TRAIN_CONFIG)
    # the same run as today's code records it (nested), and as its command line makes it
    nested = {k: v for k, v in FLAT_TRAIN_CONFIG.items() if k not in TC.LEGACY_DRAFTER_FIELDS}
    nested["drafter"] = {"num_layers": 1, "block_size": 8, "num_categories": 1,
                         "target_layer_ids": [1, 7, 14, 20, 27], "mask_token_id": 16,
                         "expander_width": None, "intermediate_size": None}
    # fields added since: absent -> their defaults
    nested.update(tap_rms_scaling=False, train_head_tokens=0, train_head_sampled=1024)
    new = TC.TrainConfig.from_dict(nested)
    assert old == new and hash(old) == hash(new)
    nested["drafter"].update(correction="none", correction_rank=None,  # written since
                             block_attention="bidirectional")
    nested.update(schedule_steps=0, schedule_offset=0)  # written since
    assert json.loads(old.to_json()) == json.loads(json.dumps(nested, sort_keys=True))
    assert TC.TrainConfig.from_dict(json.loads(new.to_json())) == new
    launched = TC.get_experiment("smollm2_dflash_baseline", [
        "data=corpora/smollm2_t1", "data_shards=68", "checkpoint_every=50",
        "keep_checkpoints=2", "export=false", "feature_cache=runs/budget/features"])
    # the recipe took the sampled training head since that run (docs/research_log.md section 4.6)
    assert launched == old.replace(**TC.SMOLLM2_SAMPLED_HEAD)
    # ... and so do the SmolLM2 mixtures since docs/research_log.md section 4.7; Qwen3's keep the full head
    for name in ("smollm2_k1_al", "smollm2_dblast_k4_al", "smollm2_dblast_k4_nll"):
        assert TC.get_experiment(name).train_head_tokens == 4096, name
    assert TC.get_experiment("qwen3_dblast_k4_al").train_head_tokens == 0
    dc = old.drafter_config(SMOLLM2)
    assert dataclasses.asdict(dc) == dict(RECORDED_DRAFTER, name="smollm2_dflash_baseline",
                                          correction="none", correction_rank=0,
                                          block_attention="bidirectional")
    # ... and the run's identity is the recorded one (the correction fields only when on)
    from dblast_jax.train.checkpoint import experiment_identity
    recorded = {k: list(v) if isinstance(v, tuple) else v for k, v in RECORDED_DRAFTER.items()}
    assert experiment_identity(dc, "t", "dflash")["drafter_config"] == recorded
    # the placeholders of before: learned mask, automatic expander, the target's MLP, the
    # default taps
    baseline = TC.TrainConfig.from_dict(dict(FLAT_TRAIN_CONFIG, mask_token_id=-1,
                                             target_layer_ids=[]))
    assert baseline.drafter == DrafterSpec(num_layers=1, block_size=8)
    assert baseline.drafter_config(SMOLLM2).target_layer_ids == (15,)
    assert baseline.drafter_config(SMOLLM2).mask_token_id is None
    with pytest.raises(ValueError, match="give them in 'drafter' only"):
        TC.TrainConfig.from_dict(dict(nested, block_size=8))
    with pytest.raises(ValueError, match=r"unknown drafter fields \['layers'\]"):
        TC.TrainConfig.from_dict(dict(nested, drafter={"layers": 2}))


@pytest.mark.parametrize("flat, dotted", [
    ("num_categories=4", "drafter.num_categories=4"),
    ("drafter_layers=2", "drafter.num_layers=2"),
    ("block_size=8", "drafter.block_size=8"),
    ("target_layer_ids=0,2", "drafter.target_layer_ids=0,2"),
    ("target_layer_ids=", "drafter.target_layer_ids=none"),
    ("mask_token_id=16", "drafter.mask_token_id=16"),
    ("mask_token_id=-1", "drafter.mask_token_id=none"),
    ("expander_width=-1", "drafter.expander_width=none"),
    ("expander_width=32", "drafter.expander_width=32"),
    ("drafter_intermediate_size=0", "drafter.intermediate_size=none"),
    ("drafter_intermediate_size=64", "drafter.intermediate_size=64"),
])
def test_flat_override_names_are_aliases_of_the_dotted_ones(flat, dotted):
    base = TC.get_experiment("tiny_dblast_k4_nll")
    a, b = TC.apply_overrides(base, [flat]), TC.apply_overrides(base, [dotted])
    assert a == b
    key, value = flat.split("=")
    field = TC.LEGACY_DRAFTER_FIELDS[key]
    assert a == base.replace(**{key: TC._coerce(  # replace() takes the flat names too
        TC.typing.get_type_hints(DrafterSpec)[field], value, key)})
    assert getattr(a.drafter, field) == getattr(b.drafter, field)


def test_drafter_override_errors_are_clear():
    cfg = TC.get_experiment("tiny_dflash")
    with pytest.raises(ValueError, match="K = 1 loss; drafter.num_categories is 4"):
        TC.apply_overrides(cfg, ["drafter.num_categories=4"])
    with pytest.raises(ValueError, match="the drafter has no field 'layers'.*drafter.num_layers"):
        TC.apply_overrides(cfg, ["drafter.layers=2"])
    with pytest.raises(ValueError, match=r"drafter.mask_token_id must be an integer >= 0 or "
                                         r"none \(a learned mask\), got -1"):
        TC.apply_overrides(cfg, ["drafter.mask_token_id=-1"])
    with pytest.raises(ValueError, match="drafter.num_layers must be an integer >= 1, got 0"):
        TC.apply_overrides(cfg, ["drafter_layers=0"])
    with pytest.raises(ValueError, match="expected an integer"):
        TC.apply_overrides(cfg, ["drafter.block_size=big"])
    with pytest.raises(ValueError, match="no field 'drafter'"):
        TC.apply_overrides(cfg, ["drafter=1"])
    with pytest.raises(ValueError, match="cannot hold a block of drafter.block_size 64"):
        TC.apply_overrides(cfg, ["block_size=64"])
    assert "drafter.num_categories=4" in TC.describe(TC.get_experiment("tiny_dblast_k4_al"))


def test_demo_config_holds_one_drafter_and_takes_both_override_forms():
    base = DemoConfig()
    assert base.drafter == DrafterSpec(num_layers=1, block_size=8, mask_token_id=16)
    assert DemoConfig.tiny().drafter.block_size == 4
    old = parse_demo_overrides(["block_size=6", "drafter_layers=2", "target_layer_ids=3,9"],
                               base)
    new = parse_demo_overrides(["drafter.block_size=6", "drafter.num_layers=2",
                                "drafter.target_layer_ids=3,9"], base)
    assert old == new == base.replace(block_size=6, drafter_layers=2, target_layer_ids=(3, 9))
    assert new.drafter == base.drafter.replace(block_size=6, num_layers=2,
                                               target_layer_ids=(3, 9))
    assert parse_demo_overrides(["target_layer_ids="], base) == base
    for bad in (["drafter.num_categories=4"], ["num_categories=4"], ["drafter.nope=1"],
                ["drafter.block_size=1"], ["drafter=1"]):
        with pytest.raises(ValueError, match="demo override"):
            parse_demo_overrides(bad, base)
    # a demo_config.json of before (flat) reads as the same demo, so it resumes
    flat = base.settings()
    del flat["drafter"]
    flat.update(block_size=8, drafter_layers=1, target_layer_ids=[])
    assert _old_settings(flat) == base.settings()
    assert _old_settings(dict(flat, block_size=4)) != base.settings()
