"""Corpus report: size, response lengths, and the target's per-token entropy.

The entropy of the target's predictive distribution on its own answers is what makes
high verification temperatures hard for a drafter (many plausible next tokens), so the
report shows it per verification temperature, over response tokens only.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import numpy as np

from dblast_jax.data.corpus import Corpus, temperature_key

__all__ = ["corpus_stats", "format_stats"]


def corpus_stats(folder: os.PathLike | str, bins: Optional[Sequence[int]] = None,
                 verify: bool = True) -> dict:
    """Counts, response-length histogram and mean response entropy / log-prob per T."""
    c = Corpus(folder, verify=verify)
    temps = [temperature_key(t) for t in c.temperatures]
    seq_lens, prompt_lens, resp_lens, stopped, gen_t = [], [], [], [], []
    ent_sum = {t: 0.0 for t in temps}
    logp_sum = {t: 0.0 for t in temps}
    for k in range(len(c.shards)):
        a = c.shard(k)
        lens = np.diff(a["offsets"])
        seq_lens.append(lens)
        prompt_lens.append(a["prompt_lengths"])
        resp_lens.append(lens - a["prompt_lengths"])
        stopped.append(a["stopped"])
        gen_t.append(a["gen_temperature"])
        mask = a["response_mask"].astype(bool)
        for t in temps:
            ent_sum[t] += float(a[f"entropy_{t}"][mask].astype(np.float64).sum())
            logp_sum[t] += float(a[f"logp_{t}"][mask].astype(np.float64).sum())
    seq = np.concatenate(seq_lens)
    resp = np.concatenate(resp_lens)
    n_resp = int(resp.sum())
    if bins is None:
        top = max(int(resp.max()), 1)
        edges = [0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
        bins = [e for e in edges if e < top] + [top + 1]
    hist, edges = np.histogram(resp, bins=np.asarray(bins))
    gen = np.concatenate(gen_t)
    return {
        "folder": str(folder),
        "target": c.manifest["target"]["name"],
        "complete": bool(c.manifest.get("complete")),
        "shards": len(c.shards),
        "sequences": int(seq.size),
        "tokens": int(seq.sum()),
        "prompt_tokens": int(np.concatenate(prompt_lens).sum()),
        "response_tokens": n_resp,
        "mean_response_length": float(resp.mean()) if resp.size else 0.0,
        "stopped_fraction": float(np.concatenate(stopped).mean()) if seq.size else 0.0,
        "gen_temperatures": {temperature_key(t): int((gen == t).sum()) for t in np.unique(gen)},
        "response_length_histogram": {"edges": [int(e) for e in edges],
                                      "counts": [int(h) for h in hist]},
        "mean_entropy": {t: ent_sum[t] / max(n_resp, 1) for t in temps},
        "mean_logp": {t: logp_sum[t] / max(n_resp, 1) for t in temps},
    }


def format_stats(s: dict) -> str:
    lines = [
        f"corpus {s['folder']} (target {s['target']}, "
        f"{'complete' if s['complete'] else 'incomplete'}, {s['shards']} shards)",
        f"  sequences        {s['sequences']:>10,}",
        f"  tokens           {s['tokens']:>10,}  (prompt {s['prompt_tokens']:,}, "
        f"response {s['response_tokens']:,})",
        f"  mean response    {s['mean_response_length']:>10.1f} tokens; "
        f"{100 * s['stopped_fraction']:.1f}% ended with a stop token",
        f"  answers per generation temperature: {s['gen_temperatures']}",
        "  response length histogram:",
    ]
    e, counts = s["response_length_histogram"]["edges"], s["response_length_histogram"]["counts"]
    peak = max(counts) if counts and max(counts) else 1
    for i, n in enumerate(counts):
        lines.append(f"    [{e[i]:>5}, {e[i + 1]:>5})  {n:>8,}  " + "#" * round(30 * n / peak))
    lines.append("  per response token, target at verification temperature T:")
    lines.append("    T        mean entropy (nats)   mean log p")
    for t in s["mean_entropy"]:
        lines.append(f"    {t:<8} {s['mean_entropy'][t]:>19.4f} {s['mean_logp'][t]:>12.4f}")
    return "\n".join(lines)
