"""Why the models' linear layers flatten their input's rows (`layers.RowLinear`).

The drafter's training step applies its projections to [batch, anchors, block, H] arrays.
On XLA's CPU backend the backward pass of such a product with several leading axes
compiles into transposing copies; the same product over rows flattened to 2-D does not.
This times one SwiGLU MLP (SmolLM2's sizes: 576 -> 1536 -> 576) forward + backward on a
flagship training batch's block positions, built once from `nnx.Linear` and once from
`RowLinear` with the same weights, stepped in alternating rounds in one process so that
machine noise hits both, and checks that the two give the same outputs and gradients.

    python benchmarks/bench_row_linear.py --out benchmarks/results_row_linear.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dblast_jax.models.layers import RowLinear


def _mlp(cls, hidden: int, inner: int):
    """loss(weights, x, cotangent) of down(silu(gate(x)) * up(x)) built from `cls`."""
    split = {name: nnx.split(cls(din, dout, use_bias=False, rngs=nnx.Rngs(0)))
             for name, (din, dout) in (("gate", (hidden, inner)), ("up", (hidden, inner)),
                                       ("down", (inner, hidden)))}

    def loss(w, x, ct):  # the layers with the kernels `w` (their only parameter)
        layers = {name: nnx.merge(graph, jax.tree.map(lambda _: w[name], state))
                  for name, (graph, state) in split.items()}
        g, u = layers["gate"](x), layers["up"](x)
        return jnp.sum(layers["down"](jax.nn.silu(g) * u) * ct)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="8,16,8", help="leading axes: batch, anchors, block")
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--inner", type=int, default=1536)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls-per-round", type=int, default=5)
    p.add_argument("--out", default="")
    args = p.parse_args()
    lead = tuple(int(v) for v in args.shape.split(","))
    rng = np.random.default_rng(0)
    h, f = args.hidden, args.inner
    weights = {"gate": rng.normal(0, 0.02, (h, f)), "up": rng.normal(0, 0.02, (h, f)),
               "down": rng.normal(0, 0.02, (f, h))}
    weights = {k: jnp.asarray(v, jnp.float32) for k, v in weights.items()}
    x = jnp.asarray(rng.normal(size=lead + (h,)), jnp.float32)
    ct = jnp.asarray(rng.normal(size=lead + (h,)), jnp.float32)
    fns = {"nnx_linear": _mlp(nnx.Linear, h, f), "row_linear": _mlp(RowLinear, h, f)}
    outs = {name: jax.block_until_ready(fn(weights, x, ct)) for name, fn in fns.items()}
    (va, ga), (vb, gb) = outs["nnx_linear"], outs["row_linear"]
    max_diff = max(float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(a)) + 1e-30))
                   for a, b in zip(jax.tree_util.tree_leaves((va, ga)),
                                   jax.tree_util.tree_leaves((vb, gb))))
    times = {name: [] for name in fns}
    for r in range(args.rounds):
        for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            for _ in range(args.calls_per_round):
                t = time.perf_counter()
                jax.block_until_ready(fns[name](weights, x, ct))
                times[name].append(time.perf_counter() - t)
    med = {name: statistics.median(v) for name, v in times.items()}
    row = {"shape": list(lead) + [h], "inner": f,
           "nnx_linear_ms": med["nnx_linear"] * 1e3, "row_linear_ms": med["row_linear"] * 1e3,
           "speedup": med["nnx_linear"] / med["row_linear"],
           "max_relative_difference": max_diff, "calls_timed": len(times["row_linear"])}
    print("| input | nnx.Linear ms | RowLinear ms | speedup | max relative difference |")
    print("|---|---|---|---|---|")
    print(f"| {'x'.join(map(str, row['shape']))} | {row['nnx_linear_ms']:.1f} | "
          f"{row['row_linear_ms']:.1f} | {row['speedup']:.2f}x | {max_diff:.1e} |")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"settings": vars(args), "rows": [row]}, fh, indent=1)
        print(f"written to {args.out}")


if __name__ == "__main__":
    main()
