"""Held-out validation: how a drafter does on target text it never trained on.

The training metrics are measured on the batch being fitted, so they cannot show
overfitting (a small corpus is seen many epochs over) and they are noisy (a new batch
every step). Validation reads a fixed held-out set - corpus shards after the training
snapshot, or fresh draws of the synthetic language - with the same anchors every time,
and reports the objective terms, per-position top-1 agreement and, where the data
carry target log-probs, the exact expected accepted drafts per block under
`sampled-branch` and `sampled-mixture` verification at T_v (`al_estimate`,
`al_estimate_mixture`: drafts sampled from q at draft temperature 1). Those are
expectations over the target's own samples, so
comparing two drafters on the same held-out set needs no generation and has far less
noise than tau measured by sampling.

Two entry points share one loop (`mean_metrics`): the trainer validates every
`validate_every` steps into workdir/validation.jsonl, and `validate_drafters` scores
exported drafters (`dblast validate`).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterator, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from dblast_jax.config import DrafterSpec, TargetConfig
from dblast_jax.data import pipeline as pipeline_lib
from dblast_jax.data import records as records_lib
from dblast_jax.data.corpus import Corpus, is_corpus_folder, parse_shard_range, prompt_digests
from dblast_jax.io import paths  # local or gs://
from dblast_jax.models.drafter import tempered_prior_params
from dblast_jax.train.checkpoint import read_log_rows  # a cut last line is skipped
from dblast_jax.train.config import TrainConfig
from dblast_jax.train.step import compiled_eval_step  # the trainer's jitted eval step

__all__ = ["HELD_OUT_SEED_OFFSET", "VALIDATION_FILE", "check_prompts_held_out",
           "make_validation_source", "mean_metrics", "paired_gain", "validate_drafters", "read_validation",
           "validation_table", "plot_prefix_acceptance"]

VALIDATION_FILE = "validation.jsonl"
HELD_OUT_SEED_OFFSET = 1_000_003  # synthetic held-out records: same language, other seed
SUMMARY_KEYS = ("al_estimate", "al_estimate_mixture", "predicted_tau", "nll", "top1_mean",
                "greedy_accepted")


def make_validation_source(config: TrainConfig, target_config: TargetConfig,
                           data: Optional[str] = None, shards: Optional[str] = None):
    """The held-out source of `config` (or of `data` / `shards` given here): corpus shards
    A .. B-1, a .jsonl file, or synthetic records drawn with another seed."""
    data = data if data is not None else (config.validation_data or config.data)
    shards = shards if shards is not None else config.validation_shards
    first, stop = parse_shard_range(shards) if shards else (0, 0)
    seed = config.seed + HELD_OUT_SEED_OFFSET if data == "synthetic" else config.seed
    if data == "synthetic" and shards:
        raise ValueError("shards select part of a corpus folder; synthetic validation data "
                         "are fresh draws")
    if shards and not is_corpus_folder(data):  # local or gs://...
        raise ValueError(f"validation shards {shards!r} need a corpus folder; {data!r} is not "
                         "one")
    if data != config.data and is_corpus_folder(data) and is_corpus_folder(config.data):
        check_prompts_held_out(config.data, config.data_shards, data, first, stop)
    elif data == config.data and stop and 0 < config.data_shards and first < config.data_shards:
        raise ValueError(f"validation shards {shards!r} overlap the training data (shards 0 .. "
                         f"{config.data_shards - 1} of {data}): held-out shards must come "
                         "after data_shards")
    return records_lib.make_source(
        data, vocab_size=target_config.vocab_size, block_size=config.drafter.block_size,
        seq_len=config.seq_len, verify_temperature=config.verify_temperature, seed=seed,
        num_phrases=config.synthetic_num_phrases, phrase_len=config.synthetic_phrase_len,
        logit_scale=config.synthetic_logit_scale, corpus_shards=stop,
        corpus_first_shard=first)


def check_prompts_held_out(train: str, train_shards: int, held_out: str, first: int = 0,
                           stop: int = 0) -> None:
    """ValueError when held-out corpus shards answer prompts the training shards answer.

    A held-out set in another folder (a merged or grown corpus for training, the original
    for validation) is checked by prompt tokens: answers to a training prompt are not
    held out, however they were sampled."""
    train_prompts = prompt_digests(Corpus(train, verify=False, max_shards=train_shards or None))
    held = Corpus(held_out, verify=False, first_shard=first, max_shards=stop or None)
    shared = len(prompt_digests(held) & train_prompts)
    if shared:
        which = f"shards {first} .. {stop - 1} of " if stop else ""
        raise ValueError(f"the held-out data ({which}{held_out}) answer {shared} prompt(s) "
                         f"that the training data ({train}"
                         f"{f', first {train_shards} shards' if train_shards else ''}) also "
                         "answer: acceptance there is not held out; train on shards without "
                         "those prompts (e.g. `dblast data merge` of the training shards only)")


def mean_metrics(batches: Iterator[Mapping[str, np.ndarray]], num_batches: int,
                 run_batch: Callable[[Mapping[str, np.ndarray], jax.Array], Mapping[str, Any]],
                 seed: int = 1234, per_batch: bool = False) -> dict[str, Any]:
    """Mean of `run_batch(batch, rng)` over the first `num_batches` batches; the anchor
    RNG of batch i is fold_in(PRNGKey(seed), i), so every call sees the same anchors.
    per_batch: also return the summary metrics of every batch (`per_batch`) and their
    standard error (`<key>_se`), for paired comparisons of drafters."""
    metrics = []
    for i in range(num_batches):
        local = next(batches)
        metrics.append(_host_metrics(run_batch(local, _anchor_rng(seed, i))))
    return _reduce_metrics(metrics, per_batch)


def _anchor_rng(seed: int, i: int) -> jax.Array:
    return jax.random.fold_in(jax.random.PRNGKey(seed), i)


def _host_metrics(m: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """One batch's metrics as float64 numpy values (float32 / int32 widen exactly)."""
    return {k: np.asarray(v, np.float64) for k, v in jax.device_get(dict(m)).items()}


def _reduce_metrics(metrics: list[Mapping[str, np.ndarray]], per_batch: bool) -> dict[str, Any]:
    """The means (and per-batch rows, SEs) of per-batch metrics, summed in batch order:
    the same numbers, bit for bit, whichever processes computed the batches."""
    num_batches = len(metrics)
    sums: dict[str, Any] = {}
    rows: dict[str, list] = {}
    for m in metrics:
        for k, v in m.items():
            sums[k] = sums.get(k, 0) + v
            if k in SUMMARY_KEYS:
                rows.setdefault(k, []).append(float(v))
    out = {k: (v / num_batches).tolist() for k, v in sums.items()}
    if per_batch:
        out["per_batch"] = rows
        for k, vals in rows.items():
            out[f"{k}_se"] = (float(np.std(vals, ddof=1) / np.sqrt(len(vals)))
                              if len(vals) > 1 else float("nan"))
    return out


def _gather_batch_metrics(mine: Mapping[int, Mapping[str, np.ndarray]], num_batches: int,
                          owner: Callable[[int], int],
                          like: Mapping[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """Every process's per-batch metrics on every process, in batch order. `mine`: this
    process's batches; `like`: one batch's metrics (keys and shapes, the same on every
    process). The float64 values travel as their bits (int32 pairs), so nothing is
    rounded on the way (jax without x64 would narrow a float64 array)."""
    from jax.experimental import multihost_utils
    keys = sorted(like)
    shapes = [np.shape(like[k]) for k in keys]
    sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes]
    table = np.zeros((num_batches, sum(sizes)), np.float64)
    for i, m in mine.items():
        table[i] = np.concatenate([np.ravel(m[k]) for k in keys]) if keys else []
    bits = np.asarray(multihost_utils.process_allgather(table.view(np.int32)))
    every = np.ascontiguousarray(bits.reshape(-1, num_batches, 2 * table.shape[1])) \
        .view(np.float64)  # [process, batch, D]
    out = []
    for i in range(num_batches):
        flat, m, at = every[owner(i), i], {}, 0
        for k, shape, size in zip(keys, shapes, sizes):
            m[k] = flat[at:at + size].reshape(shape)
            at += size
        out.append(m)
    return out


def paired_gain(results: Mapping[str, Any], base: Mapping[str, Any],
                key: str = "al_estimate") -> tuple[float, float]:
    """(relative gain of `key` over `base` in %, its standard error from the per-batch
    differences): both were measured on the same batches and anchors, so the noise of
    the data largely cancels."""
    a = np.asarray(results["per_batch"][key], np.float64)
    b = np.asarray(base["per_batch"][key], np.float64)
    if a.shape != b.shape:
        raise ValueError(f"{key}: {a.size} vs {b.size} batches: not the same validation set")
    mean_b = float(np.mean(b))
    gain = 100.0 * (float(np.mean(a)) / mean_b - 1.0)
    se = (100.0 * float(np.std(a - b, ddof=1) / np.sqrt(a.size)) / mean_b
          if a.size > 1 else float("nan"))
    return gain, se


def _validation_params(name: str, drafter: Any):
    """The drafter's parameters with its `@zt=` setting applied (Z_T changes the branch
    weights both AL estimates average over); other sampling settings are refused, since
    validation always reports sampled-branch and sampled-mixture acceptance at T_v."""
    overrides = dict(getattr(drafter, "sampling_overrides", None) or {})
    zt = overrides.pop("category_temperature", 1.0)
    if overrides:
        raise ValueError(f"drafter {name!r}: settings {sorted(overrides)} do not apply to "
                         "validation (it reports sampled-branch and sampled-mixture acceptance at "
                         "the verify temperature); only zt (Z_T) does")
    return tempered_prior_params(drafter.params, zt)


def validate_drafters(drafters: Mapping[str, Any], target: Any, data: str, *,
                      shards: str = "", num_batches: int = 8, batch_size: int = 8,
                      seq_len: int = 256, anchors_per_sequence: int = 24,
                      verify_temperature: float = 1.0, seed: int = 1234,
                      progress: bool = True,
                      baseline: Optional[str] = None) -> dict[str, dict[str, Any]]:
    """{name: generation.Drafter} -> {name: mean held-out metrics}, every drafter on the
    same batches and anchors. Needs target log-probs in the data for the AL metrics
    (a corpus stores them; otherwise they are computed by the target at T_v). A drafter
    whose `sampling_overrides` set Z_T (`NAME=DIR@zt=0.5`) is scored with its branch
    weights pi' = softmax(prior_logits / Z_T), the law its branch is drawn from.

    With `jax.process_count() > 1` every process calls this with the same arguments:
    batch i is scored by process i % count on its first local device, the per-batch
    metrics are gathered (`process_allgather`, bit-exact) and summed in batch order, so
    every process returns a 1-process run's numbers exactly."""
    if not drafters:
        raise ValueError("no drafter to validate")
    if baseline is not None and baseline not in drafters:  # refuse before any work
        raise ValueError(f"baseline {baseline!r} is not one of the drafters {list(drafters)}")
    # this process's first device: with several processes each scores its share of the
    # batches on its own chip (no collective inside a batch)
    devices = np.array(jax.local_devices()[:1]).reshape(1, 1, 1)
    mesh = Mesh(devices, ("data", "fsdp", "tensor"))
    pid, nproc = jax.process_index(), jax.process_count()
    owner = lambda i: i % nproc  # batch i is scored by process i % nproc
    mine = [i for i in range(num_batches) if owner(i) == pid]
    tparams = target.params
    out: dict[str, dict[str, Any]] = {}
    names = list(drafters)
    bar = None
    params = {name: _validation_params(name, d) for name, d in drafters.items()}
    for name in names:
        d = drafters[name]
        dcfg = d.config
        dparams = params[name]
        cfg = TrainConfig(name=name, target=target.name, data=data, loss="nll",
                          drafter=DrafterSpec(num_categories=dcfg.num_categories,
                                              block_size=dcfg.block_size),
                          batch_size=batch_size, seq_len=seq_len,
                          anchors_per_sequence=anchors_per_sequence,
                          verify_temperature=verify_temperature, track_al=True)
        source = make_validation_source(cfg, target.config, data=data, shards=shards)
        order = pipeline_lib.train_order(source, seq_len=seq_len,
                                         block_size=dcfg.block_size, seed=0)
        with_logp = records_lib.first_has_logp(source, order.usable)
        dataset = pipeline_lib.batch_dataset(order, source, batch_size=batch_size,
                                             seq_len=seq_len, with_logp=with_logp)
        mode = "data" if with_logp else "target"
        if name == names[0]:  # the same data for every drafter: checked once
            records_lib.check_data_for_target(
                source, target.config, getattr(target, "name", target.config.name), tparams,
                uses_logp=mode == "data", log=print if progress and pid == 0 else None,
                what="validation data")
        if progress and pid == 0 and bar is None:  # after the data's checks: a bad --data /
            from tqdm.auto import tqdm               # --shards is one line, without a bar
            bar = tqdm(total=len(names) * len(mine), desc="validate", unit="batch",
                       dynamic_ncols=True)
        fn = compiled_eval_step(cfg, dcfg, target.config, mode, mesh)

        def run_batch(i, dparams=dparams, fn=fn, mode=mode, dataset=dataset):
            local = dataset[i]  # global batch i (random access: any process reads any)
            batch = {k: jnp.asarray(v) for k, v in local.items()
                     if k != "logp" or mode == "data"}
            return _host_metrics(fn(dparams, tparams, batch, _anchor_rng(seed, i),
                                    jnp.int32(0)))

        if nproc == 1:
            metrics = []
            for i in range(num_batches):
                metrics.append(run_batch(i))
                if bar is not None:
                    bar.update(1)
        else:
            got = {}
            for i in mine:
                got[i] = run_batch(i)
                if bar is not None:
                    bar.update(1)
            # the keys and shapes of one batch's metrics; a process without a batch (fewer
            # batches than processes) scores batch 0 once to learn them
            like = got[mine[0]] if mine else run_batch(0)
            metrics = _gather_batch_metrics(got, num_batches, owner, like)
        out[name] = _reduce_metrics(metrics, per_batch=True)
        out[name]["sequences"] = num_batches * batch_size
    if bar is not None:
        bar.close()
    return out


def read_validation(workdir: str) -> list[dict[str, Any]]:
    """The validation rows of a training run (empty when it never validated)."""
    path = paths.join(os.fspath(workdir), VALIDATION_FILE)
    if not paths.exists(path):
        return []
    return read_log_rows(path)[0]


def validation_table(results: Mapping[str, Mapping[str, Any]],
                     baseline: Optional[str] = None) -> str:
    """Markdown: one row per drafter, the summary metrics, and the relative gain of the
    expected accepted drafts over `baseline` (`sampled-branch`, paired by batch). When
    some drafter's `sampled-mixture` estimate differs from its `sampled-branch` one
    (K > 1), a second column pairs the `sampled-mixture` estimates the same way: the
    DBlast gain of a K = 4 drafter over a K = 1 baseline (whose two estimates are equal)."""
    keys = [k for k in SUMMARY_KEYS if any(k in r for r in results.values())]
    mixture = any(_has_mixture(r) for r in results.values())
    gains = [("al_estimate", "AL gain vs {} (paired SE)")]
    if mixture:
        gains.append(("al_estimate_mixture", "mixture AL gain vs {} (paired SE)"))
    head = ["drafter"] + keys + ([title.format(baseline) for _, title in gains]
                                 if baseline else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    if baseline and baseline not in results:
        raise ValueError(f"baseline {baseline!r} is not among {sorted(results)}")
    base = results[baseline] if baseline else None

    def cell(r, k):
        if k not in r:
            return ""
        se = r.get(f"{k}_se")
        return f"{r[k]:.4f}" + (f" ± {se:.4f}" if se is not None and np.isfinite(se) else "")

    def gain_cell(r, key):
        if key in r.get("per_batch", {}) and key in base.get("per_batch", {}):
            gain, se = paired_gain(r, base, key)
            return f"{gain:+.1f}% ± {se:.1f}%" if np.isfinite(se) else f"{gain:+.1f}%"
        if r.get(key) is not None and base.get(key):
            return f"{100 * (r[key] / base[key] - 1):+.1f}%"
        return ""

    for name, r in results.items():
        cells = [name] + [cell(r, k) for k in keys]
        if base is not None:
            cells += [gain_cell(r, key) for key, _ in gains]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _has_mixture(r: Mapping[str, Any]) -> bool:
    """Whether the drafter's `sampled-mixture` estimate is not just its `sampled-branch`
    one (K = 1 drafters have the two equal, up to float32 rounding: the two come from
    different code paths)."""
    a, m = r.get("al_estimate"), r.get("al_estimate_mixture")
    return a is not None and m is not None and not np.isclose(a, m, rtol=1e-5, atol=1e-7)


def plot_prefix_acceptance(results: Mapping[str, Mapping[str, Any]], out: str) -> str:
    """PNG: P(first k drafts accepted) against k for every drafter, `sampled-branch` solid
    and `sampled-mixture` dashed (K > 1 only): where along the block each drafter loses."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, (name, r) in enumerate(results.items()):
        if "accept_prefix" not in r:
            continue
        color = f"C{i % 10}"
        acc = np.asarray(r["accept_prefix"])
        ks = np.arange(1, acc.size + 1)
        ax.plot(ks, acc, "-o", color=color, ms=3, label=f"{name} ({r['al_estimate']:.3f})")
        mix = np.asarray(r.get("accept_prefix_mixture", acc))
        if not np.allclose(mix, acc):
            ax.plot(ks, mix, "--", color=color,
                    label=f"{name}, sampled-mixture ({r['al_estimate_mixture']:.3f})")
    ax.set_yscale("log")
    ax.set_xlabel("k (draft position)")
    ax.set_ylabel("P(first k drafts accepted)")
    ax.set_title("held-out prefix acceptance (legend: expected accepted drafts)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
