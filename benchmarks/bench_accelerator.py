"""One-command accelerator benchmark (issue 15): random weights, bfloat16, one device.

  plain decode : per-step time and tok/s of the on-device decode step (the sampler's
                 `_plain_body` in a `fori_loop`, prefill excluded) at batch 1 / 8 / 32
                 for the SmolLM2-135M and Qwen3-8B shapes.
  spec step    : one speculative step (the sampler's `_spec_body`: draft + b-token verify
                 + drafter context update) relative to one plain decode step, K = 1 and
                 K = 4 drafters, b = 16, greedy-branch and sampled-mixture verification;
                 predicted speedup at tau = 2 / 4 / 6 is tau * t_plain / t_spec.
  train step   : one drafter train step (trainer.make_train_step, live frozen target) of
                 the Qwen3-8B experiment shape at batch 4 x 2048 tokens, 256 anchors: time,
                 tokens/s and MFU (FLOP formula in `train_flops`; peak from PEAK_BF16).
                 If it does not fit one device, the target is cut to fewer layers (stated).
  overheads    : compile time of every compiled function, process peak device memory
                 after each stage (device.memory_stats()['peak_bytes_in_use'] if any).

Weights are drawn on the device in bfloat16 by one jitted function per model (nothing
is materialised on the host). Compile is excluded from step times (AOT lower/compile,
reported separately); step times are the median of --repeats timed calls, each ended by
jax.block_until_ready.

    python benchmarks/bench_accelerator.py --out benchmarks/results_accelerator.json
    python benchmarks/bench_accelerator.py --tiny --out /tmp/tiny.json   # CPU smoke test
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import time
from typing import Any, Optional

if __name__ == "__main__" and "--tiny" in sys.argv[1:]:
    # a smoke test: XLA's cheapest code generation makes the many small compiles fast
    # (set before JAX starts its backend; the numbers of a --tiny run are not results)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization"
                               "_level=0 --xla_llvm_disable_expensive_passes=true").strip()

import jax
import jax.numpy as jnp

from dblast_jax import sampler
from dblast_jax.config import SamplingConfig, TargetConfig
from dblast_jax.io.atomic import atomic_write_text
from dblast_jax.models import drafter as drafter_lib
from dblast_jax.models import target as target_lib
from dblast_jax.train import get_experiment
from dblast_jax.train.trainer import TrainState, make_optimizer, make_train_step

# Dense (no sparsity) peak bfloat16 FLOP/s per device, from the vendors' data sheets.
# Matched as substrings of jax's device_kind, first match wins (so "H100 PCIe" and
# "TPU v5 lite" come before "H100" and "TPU v5"). Unknown devices: MFU is omitted.
PEAK_BF16 = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("GH200", 989e12),
    ("H200", 989e12),
    ("H100", 989e12),
    ("A100", 312e12),
    ("L4", 121e12),
    ("TPU v6 lite", 918e12),
    ("TPU v6e", 918e12),
    ("TPU v5 lite", 197e12),
    ("TPU v5e", 197e12),
    ("TPU v5p", 459e12),
    ("TPU v5", 459e12),
    ("TPU v4", 275e12),
)

# Peak HBM bandwidth in bytes/s per device (data sheets), same matching as PEAK_BF16.
PEAK_HBM = (
    ("H100 PCIe", 2.0e12),
    ("H100 NVL", 3.9e12),
    ("GH200", 4.0e12),
    ("H200", 4.8e12),
    ("H100", 3.35e12),
    ("A100", 2.0e12),
    ("L4", 0.3e12),
    ("TPU v6 lite", 1.64e12),
    ("TPU v6e", 1.64e12),
    ("TPU v5 lite", 0.819e12),
    ("TPU v5e", 0.819e12),
    ("TPU v5p", 2.765e12),
    ("TPU v5", 2.765e12),
    ("TPU v4", 1.2e12),
)

# (label, full-size target, tiny stand-in, experiment-name prefix in train/config.py)
MODELS = (
    ("smollm2-135m", TargetConfig.smollm2_135m, TargetConfig.tiny_llama, "smollm2"),
    ("qwen3-8b", TargetConfig.qwen3_8b, TargetConfig.tiny_qwen3, "qwen3"),
)
TAUS = (2, 4, 6)


def _lookup(table, device_kind: str) -> Optional[float]:
    for key, value in table:
        if key.lower() in device_kind.lower():
            return value
    return None


def peak_flops(device_kind: str) -> Optional[float]:
    return _lookup(PEAK_BF16, device_kind)


def peak_bandwidth(device_kind: str) -> Optional[float]:
    return _lookup(PEAK_HBM, device_kind)


def decode_step_bytes(tc: TargetConfig, batch: int, cache_size: int, n_params: int,
                      bytes_per_value: int = 2) -> int:
    """HBM bytes one plain decode step must read at least: every weight once, plus the
    whole K/V buffer of every sequence (decode attends over the full cache buffer)."""
    kv = batch * cache_size * tc.num_layers * 2 * tc.num_kv_heads * tc.head_dim
    return bytes_per_value * (n_params + kv)


# ---- random weights on the device ------------------------------------------------------

def _leaf_name(path) -> str:
    return "/".join(str(getattr(k, "key", k)) for k in path)


def _random_like(abstract, seed: int, std_for):
    """A jitted draw of a parameter pytree: norm scales 1, prior head 0, kernels and
    embeddings normal(std_for(name)), all straight in the abstract leaves' dtype."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)

    def build():
        key = jax.random.key(seed, impl="rbg")
        leaves = []
        for i, (path, a) in enumerate(flat):
            name = _leaf_name(path)
            if name.endswith("scale"):
                leaves.append(jnp.ones(a.shape, a.dtype))
            elif name.startswith("prior/"):
                leaves.append(jnp.zeros(a.shape, a.dtype))
            else:
                x = jax.random.normal(jax.random.fold_in(key, i), a.shape, a.dtype)
                leaves.append(x * jnp.asarray(std_for(name), a.dtype))
        return jax.tree_util.tree_unflatten(treedef, leaves)

    return jax.jit(build)()


def random_target(tc: TargetConfig, dtype, seed: int = 0):
    return _random_like(target_lib.abstract_params(tc, dtype), seed, lambda name: 0.02)


def random_drafter(dcfg, tc: TargetConfig, dtype, seed: int = 1):
    h, e = dcfg.hidden_size, max(dcfg.expander_width, 1)
    stds = {"expander/in_kernel": 1.0 / math.sqrt(h),
            "expander/out_kernel": drafter_lib.EXPANDER_INIT_OFFSET_RMS / math.sqrt(e)}
    return _random_like(drafter_lib.abstract_drafter_params(dcfg, tc, dtype), seed,
                        lambda name: stds.get(name, 0.02))


# ---- measurement helpers ------------------------------------------------------------------

def compile_fn(fn, *args):
    """AOT lower + compile; returns (compiled, seconds)."""
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    return compiled, time.perf_counter() - t0


def median_seconds(call, repeats: int) -> float:
    jax.block_until_ready(call())  # warm-up (first execution allocations), not timed
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def peak_bytes() -> Optional[int]:
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 - some backends raise instead of returning None
        return None
    if not stats or "peak_bytes_in_use" not in stats:
        return None
    return int(stats["peak_bytes_in_use"])


def bytes_limit() -> Optional[int]:
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001
        return None
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def memory_analysis(compiled) -> Optional[dict[str, int]]:
    try:
        m = compiled.memory_analysis()
        out = {k: int(getattr(m, f"{k}_size_in_bytes"))
               for k in ("temp", "argument", "output", "alias")}
    except Exception:  # noqa: BLE001 - not every backend implements it
        return None
    # donated arguments alias outputs: count that memory once
    out["total"] = out["temp"] + out["argument"] + out["output"] - out["alias"]
    return out


def xla_flops(compiled) -> Optional[float]:
    try:
        cost = compiled.cost_analysis()
        if isinstance(cost, (list, tuple)):
            cost = cost[0]
        flops = float(cost["flops"])
    except Exception:  # noqa: BLE001
        return None
    return flops if flops > 0 else None


def is_oom(e: BaseException) -> bool:
    text = str(e)
    return "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text


class Budget:
    def __init__(self, seconds: float):
        self.start, self.seconds = time.perf_counter(), seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def over(self, reserve: float = 0.0) -> bool:
        return self.elapsed() > self.seconds - reserve


# ---- plain decode and the speculative step ------------------------------------------------

def plain_state(tparams, tokens, lengths, rng, *, tc, sampling, cache_size):
    """The sampler's plain loop state after prefill (as generate_tokens builds it)."""
    logits, _, cache = target_lib.prefill(tparams, tokens, lengths, config=tc,
                                          cache_size=cache_size, last_logits_only=True)
    first = jnp.argmax(logits[:, 0], -1).astype(jnp.int32)
    b, n = tokens.shape[0], sampling.max_new_tokens
    return sampler.PlainState(
        step=jnp.int32(1), last=first, positions=lengths.astype(jnp.int32),
        done=jnp.zeros((b,), bool), num_generated=jnp.ones((b,), jnp.int32),
        out=jnp.full((b, n), sampler.PAD_ID, jnp.int32).at[:, 0].set(first), cache=cache,
        rng=rng)


def plain_steps(state, tparams, *, tc, sampling, steps):
    body = functools.partial(sampler._plain_body, params=tparams, config=tc, sampling=sampling)
    return jax.lax.fori_loop(0, steps, lambda i, s: body(s), state).out


def spec_steps(state, tparams, dparams, *, tc, dcfg, sampling, steps):
    body = functools.partial(sampler._spec_body, tparams=tparams, dparams=dparams, tcfg=tc,
                             dcfg=dcfg, sampling=sampling)
    final = jax.lax.fori_loop(0, steps, lambda i, s: body(s), state)
    return final.out, final.accepted


def prompt_batch(batch: int, prompt_len: int, vocab: int):
    tokens = jax.random.randint(jax.random.key(7), (batch, prompt_len), 0, vocab, jnp.int32)
    return tokens, jnp.full((batch,), prompt_len, jnp.int32)


def measure_plain(name, tc, tparams, batch, args, rec):
    tokens, lengths = prompt_batch(batch, args.prompt_len, tc.vocab_size)
    sampling = SamplingConfig(temperature=args.temperature, max_new_tokens=args.plain_steps + 2)
    init = jax.jit(functools.partial(plain_state, tc=tc, sampling=sampling,
                                     cache_size=args.cache_size))
    state = jax.block_until_ready(init(tparams, tokens, lengths, jax.random.key(0)))
    fn = functools.partial(plain_steps, tc=tc, sampling=sampling, steps=args.plain_steps)
    compiled, compile_s = compile_fn(fn, state, tparams)
    t = median_seconds(lambda: compiled(state, tparams), args.repeats) / args.plain_steps
    row = {"model": name, "batch": batch, "step_ms": 1e3 * t, "tok_s": batch / t,
           "compile_s": compile_s, "peak_bytes_in_use": peak_bytes()}
    bw = rec["device"].get("peak_hbm_bytes_per_s")
    if bw:
        n_params = sum(math.prod(a.shape) for a in jax.tree.leaves(tparams))
        need = decode_step_bytes(tc, batch, args.cache_size, n_params)
        row["roofline_step_ms"] = 1e3 * need / bw
        row["pct_of_bandwidth_roofline"] = 100.0 * (need / bw) / t
    rec["plain_decode"].append(row)
    print(json.dumps(row), flush=True)
    return row


def drafter_config_for(prefix: str, k: int, tc: TargetConfig, args):
    exp = f"{prefix}_k1_al" if k == 1 else f"{prefix}_dblast_k{k}_al"
    over = [f"block_size={args.block}"]
    if args.tiny:  # the tiny stand-ins have 3 layers: DFlash's default tap, not the recipe's
        over += ["drafter_layers=1", "mask_token_id=-1", "drafter.target_layer_ids=none"]
    return get_experiment(exp, over).drafter_config(tc)


def measure_spec(name, prefix, tc, tparams, batch, k, mode, plain_row, args, rec):
    dcfg = drafter_config_for(prefix, k, tc, args)
    dparams = random_drafter(dcfg, tc, tparams["final_norm"]["scale"].dtype)
    tokens, lengths = prompt_batch(batch, args.prompt_len, tc.vocab_size)
    sampling = SamplingConfig(temperature=args.temperature, verify_mode=mode,
                              max_new_tokens=args.spec_steps * args.block + 2)
    init = jax.jit(functools.partial(sampler._spec_init, tcfg=tc, dcfg=dcfg, sampling=sampling,
                                     cache_size=args.cache_size))
    state = jax.block_until_ready(init(tparams, dparams, tokens, lengths, jax.random.key(0)))
    fn = functools.partial(spec_steps, tc=tc, dcfg=dcfg, sampling=sampling,
                           steps=args.spec_steps)
    compiled, compile_s = compile_fn(fn, state, tparams, dparams)
    t = median_seconds(lambda: compiled(state, tparams, dparams), args.repeats) / args.spec_steps
    t_plain = plain_row["step_ms"] / 1e3
    row = {"model": name, "batch": batch, "K": k, "verify_mode": mode, "block_size": args.block,
           "drafter_layers": dcfg.num_layers, "temperature": args.temperature,
           "spec_step_ms": 1e3 * t, "plain_step_ms": 1e3 * t_plain,
           "spec_over_plain": t / t_plain,
           "predicted_speedup": {str(tau): tau * t_plain / t for tau in TAUS},
           "compile_s": compile_s, "peak_bytes_in_use": peak_bytes()}
    rec["speculative"].append(row)
    print(json.dumps(row), flush=True)
    del dparams, state
    return row


# ---- the training step ------------------------------------------------------------------------

def train_flops(config, dcfg, tc: TargetConfig, logp_from_target: bool) -> dict[str, float]:
    """Model FLOPs of one train step (matmuls only; norms, softmax, RoPE, the optimizer
    and the anchor sampling are ignored). B = batch, T = seq_len, A = anchors, b = block,
    K = categories, H = hidden, V = vocab, Nq / Nkv = heads, D = head_dim, F = MLP width:

      target (frozen, forward only; attention dense over T x T as implemented):
        L_t * (2 * B*T * P_layer_t + 4 * B * T^2 * Nq*D)  [+ 2 * B*T * H*V  target log-probs]
      drafter (trainable: forward + backward = 3x forward):
        3 * [ 2 * B*T * (n_taps*H*H)                          fc on the context features
            + L_d * 2 * B*T * 2*H*Nkv*D                       context K / V
            + L_d * (2 * B*A*b * P_layer_d + 4 * B*A*b * (T + b) * Nq*D)   the blocks
            + 2 * B*A*K*(b-1) * 2*H*E ]                       category expander
      branch LM head (frozen weight: forward + input gradient = 2x forward):
        2 * 2 * B*A*K*(b-1) * H*V
    with P_layer = H*(Nq + 2*Nkv)*D + Nq*D*H + 3*H*F."""
    bsz, t, a, b = config.batch_size, config.seq_len, config.anchors_per_sequence, dcfg.block_size
    k, h, v = dcfg.num_categories, tc.hidden_size, tc.vocab_size

    def layer_params(hid, nq, nkv, d, f):
        return hid * (nq + 2 * nkv) * d + nq * d * hid + 3 * hid * f

    p_t = layer_params(h, tc.num_heads, tc.num_kv_heads, tc.head_dim, tc.intermediate_size)
    target = tc.num_layers * (2 * bsz * t * p_t + 4 * bsz * t * t * tc.num_heads * tc.head_dim)
    if logp_from_target:
        target += 2 * bsz * t * h * v
    p_d = layer_params(h, dcfg.num_heads, dcfg.num_kv_heads, dcfg.head_dim,
                       dcfg.intermediate_size)
    rows = bsz * a * b
    n_taps = len(dcfg.target_layer_ids)
    drafter_fwd = (2 * bsz * t * n_taps * h * h
                   + dcfg.num_layers * 2 * bsz * t * 2 * h * dcfg.num_kv_heads * dcfg.head_dim
                   + dcfg.num_layers * (2 * rows * p_d
                                        + 4 * rows * (t + b) * dcfg.num_heads * dcfg.head_dim)
                   + 2 * bsz * a * k * (b - 1) * 2 * h * dcfg.expander_width)
    head = 2 * 2 * bsz * a * k * (b - 1) * h * v
    return {"target": float(target), "drafter": float(3 * drafter_fwd), "branch_head": float(head),
            "total": float(target + 3 * drafter_fwd + head)}


def train_batch(config, vocab: int):
    bsz, t = config.batch_size, config.seq_len
    tokens = jax.random.randint(jax.random.key(3), (bsz, t), 1, vocab, jnp.int32)
    prompt = max(t // 8, 1)  # the first eighth is "prompt": no loss, no anchors
    loss_mask = jnp.broadcast_to(jnp.arange(t) >= prompt, (bsz, t))
    return {"tokens": tokens, "loss_mask": loss_mask, "lengths": jnp.full((bsz,), t, jnp.int32)}


def try_train(config, tc, tparams_full, layers, args):
    """Compile and time the train step on a target cut to `layers` layers (raises
    MemoryError when XLA's memory analysis exceeds the device's limit)."""
    tc_cut = tc.replace(num_layers=layers) if layers != tc.num_layers else tc
    tparams = dict(tparams_full)
    tparams["layers"] = {i: tparams_full["layers"][i] for i in range(layers)}
    dcfg = config.drafter_config(tc_cut)
    dtype = tparams["final_norm"]["scale"].dtype
    mode = "target" if (config.uses_al or config.track_al) else None
    step_fn = make_train_step(config, dcfg, tc_cut, mode)
    tx, _ = make_optimizer(config)
    dparams = random_drafter(dcfg, tc_cut, dtype)
    state = TrainState(step=jnp.int32(0), params=dparams, opt_state=jax.jit(tx.init)(dparams),
                       rng=jax.random.PRNGKey(config.seed))
    batch = train_batch(config, tc.vocab_size)
    t0 = time.perf_counter()
    compiled = jax.jit(step_fn, donate_argnums=(0,)).lower(state, tparams, batch).compile()
    compile_s = time.perf_counter() - t0
    mem = memory_analysis(compiled)
    limit = bytes_limit()
    if mem is not None and limit is not None and mem["total"] > limit:
        raise MemoryError(f"XLA's memory analysis: needs {_size(mem['total'])} > "
                          f"{_size(limit)}")
    state, metrics = compiled(state, tparams, batch)  # warm-up step
    jax.block_until_ready(metrics)
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        state, metrics = compiled(state, tparams, batch)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    loss = float(metrics["loss"])
    flops = train_flops(config, dcfg, tc_cut, mode == "target")
    return {"step_s": step_s, "compile_s": compile_s, "memory_analysis": mem,
            "flops": flops, "xla_flops": xla_flops(compiled), "loss": loss,
            "drafter_layers": dcfg.num_layers, "target_layer_ids": list(dcfg.target_layer_ids),
            "num_categories": dcfg.num_categories, "block_size": dcfg.block_size}


def measure_train(tc, tparams, args, rec, device_kind):
    over = list(args.train_overrides)
    if args.tiny:
        over += ["drafter_layers=1", "mask_token_id=-1", "logits_chunk_size=64",
                 "logits_row_chunk_size=0", "drafter.target_layer_ids=none"]
    config = get_experiment(args.train_experiment,
                            over + [f"grad_accum_steps={args.train_accum}"])
    # What does not fit one device is retried, in this order: the same step (same
    # FLOPs and tokens) in 2 then 4 micro-batches (grad_accum_steps), then the target
    # cut to half its layers, repeatedly. Every fallback is written into the row's notes.
    layers, notes = tc.num_layers, []
    while True:
        try:
            res = try_train(config, tc, tparams, layers, args)
            break
        except Exception as e:  # noqa: BLE001 - fall back on out-of-memory only
            if not (isinstance(e, MemoryError) or is_oom(e)):
                raise
            what = (f"{layers}/{tc.num_layers} target layers, grad_accum_steps "
                    f"{config.grad_accum_steps}")
            notes.append(f"{what}: does not fit one device ({str(e).splitlines()[0][:160]})")
            print(notes[-1], flush=True)
            accum = config.grad_accum_steps * 2
            if accum <= min(4, config.batch_size) and config.batch_size % accum == 0:
                config = config.replace(grad_accum_steps=accum)
            elif layers > 1:
                layers = max(layers // 2, 1)
            else:
                raise
    tokens = config.batch_size * config.seq_len
    peak = peak_flops(device_kind)
    row = {"experiment": config.name, "model": tc.name, "target_layers": layers,
           "full_target": layers == tc.num_layers, "batch": config.batch_size,
           "seq_len": config.seq_len, "anchors": config.anchors_per_sequence,
           "grad_accum_steps": config.grad_accum_steps,
           "param_dtype": config.param_dtype, **res, "tokens_per_s": tokens / res["step_s"],
           "flops_per_step": res["flops"]["total"],
           "model_flops_per_s": res["flops"]["total"] / res["step_s"],
           "flop_formula": "train_flops() in benchmarks/bench_accelerator.py (matmuls only)",
           "notes": notes, "peak_bytes_in_use": peak_bytes()}
    if peak is not None:
        row["peak_bf16_flops"] = peak
        row["mfu"] = row["model_flops_per_s"] / peak
    rec["train"] = row
    print(json.dumps(row), flush=True)
    return row


# ---- the table ------------------------------------------------------------------------------

def _size(x: int) -> str:
    return f"{x / 2**30:.2f} GiB" if x >= 2**30 else f"{x / 2**20:.1f} MiB"


def _gib(x) -> str:
    return "-" if x is None else f"{x / 2**30:.2f}"


def table(rec) -> str:
    lines = ["| stage | model | setting | step ms | result | compile s | peak GiB |",
             "|---|---|---|---|---|---|---|"]
    for name, secs in rec["overheads"]["init_s"].items():
        lines.append(f"| init weights | {name} | bf16, on device | - | "
                     f"{rec['overheads']['target_params'][name] / 1e6:.1f} M params | "
                     f"{secs:.1f} (incl. run) | - |")
    for r in rec["plain_decode"]:
        roof = (f", {r['pct_of_bandwidth_roofline']:.0f}% of HBM roofline"
                if "pct_of_bandwidth_roofline" in r else "")
        lines.append(f"| plain decode | {r['model']} | B={r['batch']} | {r['step_ms']:.3f} | "
                     f"{r['tok_s']:.1f} tok/s{roof} | {r['compile_s']:.1f} | "
                     f"{_gib(r['peak_bytes_in_use'])} |")
    for r in rec["speculative"]:
        sp = " / ".join(f"{v:.2f}x" for v in r["predicted_speedup"].values())
        lines.append(f"| spec step | {r['model']} | B={r['batch']} K={r['K']} b={r['block_size']}"
                     f" {r['verify_mode']} | {r['spec_step_ms']:.3f} | "
                     f"{r['spec_over_plain']:.2f}x plain step; speedup at tau 2/4/6: {sp} | "
                     f"{r['compile_s']:.1f} | {_gib(r['peak_bytes_in_use'])} |")
    r = rec.get("train")
    if r:
        cut = ("" if r["full_target"] else
               f", TARGET CUT TO {r['target_layers']} LAYERS (full step does not fit)")
        mfu = f", MFU {100 * r['mfu']:.1f}%" if "mfu" in r else ", MFU - (unknown device)"
        accum = f" accum={r['grad_accum_steps']}" if r["grad_accum_steps"] > 1 else ""
        lines.append(f"| train step | {r['model']} | {r['experiment']} B={r['batch']} "
                     f"T={r['seq_len']} A={r['anchors']} K={r['num_categories']}{accum}{cut} | "
                     f"{1e3 * r['step_s']:.1f} | {r['tokens_per_s']:.0f} tok/s, "
                     f"{r['model_flops_per_s'] / 1e12:.2f} TFLOP/s{mfu} | "
                     f"{r['compile_s']:.1f} | {_gib(r['peak_bytes_in_use'])} |")
    for s in rec["skipped"]:
        lines.append(f"| skipped | {s['model']} | {s['what']} | - | {s['why']} | - | - |")
    return "\n".join(lines)


# ---- main -----------------------------------------------------------------------------------

def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true",
                   help="tiny test presets (tiny-llama / tiny-qwen3) and small shapes: "
                   "the same code paths in seconds on a CPU")
    p.add_argument("--models", nargs="+", default=[m[0] for m in MODELS],
                   choices=[m[0] for m in MODELS])
    p.add_argument("--batch", type=int, nargs="+", default=None,
                   help="plain decode batches (default 1 8 32; --tiny: 1 2)")
    p.add_argument("--spec-batch", type=int, nargs="+", default=None,
                   help="speculative-step batches, each also in --batch (default 1 8; "
                   "--tiny: 1)")
    p.add_argument("--categories", type=int, nargs="+", default=[1, 4])
    p.add_argument("--verify-modes", nargs="+", default=["greedy-branch", "sampled-mixture"])
    p.add_argument("--spec-combos", nargs="+", default=None, metavar="K:MODE",
                   help="speculative (K, verify mode) pairs instead of --categories x "
                   "--verify-modes (--tiny default: 1:greedy-branch 4:sampled-mixture, each "
                   "K and each mode once)")
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--temperature", type=float, default=1.0,
                   help="plain and speculative decoding temperature (sampled verification)")
    p.add_argument("--prompt-len", type=int, default=None, help="default 128; --tiny: 16")
    p.add_argument("--plain-steps", type=int, default=None,
                   help="decode steps per timed call (default 32; --tiny: 8)")
    p.add_argument("--spec-steps", type=int, default=None,
                   help="speculative steps per timed call (default 16; --tiny: 4)")
    p.add_argument("--repeats", type=int, default=None, help="timed calls (default 5; --tiny 2)")
    p.add_argument("--train-experiment", default="qwen3_dblast_k4_al")
    p.add_argument("--train-overrides", nargs="*", default=None,
                   help="key=value TrainConfig overrides (default batch_size=4 seq_len=2048 "
                   "anchors_per_sequence=256; --tiny: batch 2, seq 64, 8 anchors)")
    p.add_argument("--train-accum", type=int, default=1,
                   help="grad_accum_steps to try first (the step's batch and FLOPs do not "
                   "change); a step that does not fit retries with 2, then 4, then half the "
                   "target's layers")
    p.add_argument("--no-train", action="store_true")
    p.add_argument("--budget-s", type=float, default=450.0,
                   help="start no measurement after this many seconds (the skipped ones "
                   "are listed); the train step is always attempted, and the stages "
                   "before it stop --train-reserve-s earlier to leave it room")
    p.add_argument("--train-reserve-s", type=float, default=180.0)
    p.add_argument("--out", default=None,
                   help="JSON file (default benchmarks/results_accelerator.json; --tiny: "
                   "none, so a smoke run never overwrites results)")
    args = p.parse_args(argv)
    tiny = args.tiny
    if args.out is None:
        args.out = "" if tiny else "benchmarks/results_accelerator.json"
    args.batch = args.batch or ([1, 2] if tiny else [1, 8, 32])
    args.spec_batch = args.spec_batch or ([1] if tiny else [1, 8])
    args.prompt_len = args.prompt_len or (16 if tiny else 128)
    args.plain_steps = args.plain_steps or (8 if tiny else 32)
    args.spec_steps = args.spec_steps or (4 if tiny else 16)
    args.repeats = args.repeats or (2 if tiny else 5)
    if args.train_overrides is None:
        args.train_overrides = (["batch_size=2", "seq_len=64", "anchors_per_sequence=8"] if tiny
                                else ["batch_size=4", "seq_len=2048", "anchors_per_sequence=256"])
    # one KV cache size for plain and speculative steps: decode attends over the whole
    # buffer, so equal sizes make the two step times comparable
    need = max(args.prompt_len + args.plain_steps + 2,
               args.prompt_len + (args.spec_steps + 1) * args.block)
    args.cache_size = int(math.ceil(need / 64) * 64)
    if args.spec_combos is None and tiny:
        args.spec_combos = ["1:greedy-branch", "4:sampled-mixture"]
    if args.spec_combos is None:
        args.combos = [(k, m) for k in args.categories for m in args.verify_modes]
    else:
        try:
            args.combos = [(int(c.split(":")[0]), c.split(":", 1)[1]) for c in args.spec_combos]
        except (ValueError, IndexError):
            p.error(f"--spec-combos takes K:MODE pairs, got {args.spec_combos}")
    missing = sorted(set(args.spec_batch) - set(args.batch))
    if missing:
        p.error(f"--spec-batch {missing} must also be in --batch (the plain step is the "
                "reference)")
    return args


def main(argv=None) -> dict[str, Any]:
    args = parse_args(argv)
    budget = Budget(args.budget_s)
    dev = jax.devices()[0]
    kind = dev.device_kind
    dtype = jnp.bfloat16
    rec: dict[str, Any] = {
        "device": {"platform": dev.platform, "device_kind": kind,
                   "num_devices": jax.device_count(), "peak_bf16_flops": peak_flops(kind),
                   "peak_hbm_bytes_per_s": peak_bandwidth(kind),
                   "bytes_limit": bytes_limit()},
        "settings": {k: v for k, v in vars(args).items()},
        "plain_decode": [], "speculative": [], "train": None,
        "overheads": {"init_s": {}, "target_params": {}}, "skipped": []}
    print(f"device: {kind} ({dev.platform}, {jax.device_count()} devices); "
          f"peak bf16 {peak_flops(kind)}", flush=True)
    models = [m for m in MODELS if m[0] in args.models]
    loaded = {}  # label -> (target config, params); SmolLM2's bf16 weights are ~0.3 GB
    later = []  # speculative rows past the first spec batch: run after the train step
    for label, full, tiny_cfg, prefix in models:
        tc = tiny_cfg() if args.tiny else full()
        name = tc.name if args.tiny else label
        n_params = sum(math.prod(a.shape) for a in jax.tree.leaves(
            target_lib.abstract_params(tc, dtype)))
        limit = bytes_limit()
        if limit is not None and 2 * n_params > 0.85 * limit:
            rec["skipped"].append({"model": name, "what": "all stages",
                                   "why": f"{2 * n_params / 2**30:.1f} GiB of bf16 weights "
                                   f"do not fit one device ({limit / 2**30:.1f} GiB)"})
            continue
        t0 = time.perf_counter()
        tparams = jax.block_until_ready(random_target(tc, dtype))
        rec["overheads"]["init_s"][name] = time.perf_counter() - t0
        rec["overheads"]["target_params"][name] = n_params
        loaded[label] = (tc, tparams)
        plain_rows = {}
        reserve = 0.0 if args.no_train else args.train_reserve_s
        for batch in args.batch:
            if budget.over(reserve):
                rec["skipped"].append({"model": name, "what": f"plain decode B={batch}",
                                       "why": "time budget"})
                continue
            plain_rows[batch] = measure_plain(name, tc, tparams, batch, args, rec)
            save_partial(rec, args)
        for i, batch in enumerate(args.spec_batch):
            for k, mode in args.combos:
                job = (label, name, prefix, tc, batch, k, mode, plain_rows.get(batch))
                if i == 0:
                    run_spec(job, loaded, budget, args, rec, reserve)
                else:
                    later.append(job)
    if not args.no_train:
        if "qwen3-8b" in loaded:
            tc, tparams = loaded["qwen3-8b"]
        else:
            tc = TargetConfig.tiny_qwen3() if args.tiny else TargetConfig.qwen3_8b()
            tparams = jax.block_until_ready(random_target(tc, dtype))
        measure_train(tc, tparams, args, rec, kind)
        save_partial(rec, args)
        del tparams
    for job in later:
        run_spec(job, loaded, budget, args, rec)
    rec["total_s"] = budget.elapsed()
    rec["final_peak_bytes_in_use"] = peak_bytes()
    print()
    print(table(rec))
    print(f"\ntotal {rec['total_s']:.0f} s", flush=True)
    if args.out:
        save_partial(rec, args)
        print(f"written to {args.out}")
    return rec


def save_partial(rec, args) -> None:
    """Rewrite --out after every measurement (temp file + rename), so a run cut off by a
    lease or a wall-clock limit still leaves every finished row."""
    if not args.out:
        return
    atomic_write_text(args.out, json.dumps(rec, indent=1, default=str))


def run_spec(job, loaded, budget, args, rec, reserve=0.0):
    label, name, prefix, tc, batch, k, mode, plain_row = job
    what = f"spec step B={batch} K={k} {mode}"
    if plain_row is None or budget.over(reserve):
        rec["skipped"].append({"model": name, "what": what,
                               "why": "time budget" if plain_row is not None
                               else "no plain step at this batch"})
        return
    measure_spec(name, prefix, tc, loaded[label][1], batch, k, mode, plain_row, args, rec)
    save_partial(rec, args)


if __name__ == "__main__":
    main(sys.argv[1:])
