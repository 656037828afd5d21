"""Feature probe: how much of the next-but-one token do the target's taps carry?

A block drafter anchored at position s sees the target's features of positions < s and
the anchor token x_s, and must predict x_{s+1} at its first block slot. This script
trains small linear probes for that prediction on frozen inputs and reports held-out
top-1 agreement with the data token, beside a bigram table and the target itself:

  bigram          counted table x_s -> x_{s+1} (the level the shipped drafters reach)
  emb             linear map of the anchor embedding e(x_s) (a learned bigram)
  tap{L}+emb      linear map of [rmsnorm(feature_L[s-1]); e(x_s)]
  taps{...}+emb   the same with several layers concatenated
  target          the target's own argmax at position s (it sees x_s through every
                  layer: the ceiling no drafter input can exceed)

Every probe logit is the target's tied LM head applied to the probe's hidden vector, so
a probe is a drafter with no layers. To stay cheap on a CPU the softmax runs over the
`vocab` most frequent response tokens of the training shards; labels outside it are
dropped for every row of the table alike (the coverage is printed).

    python experiments/smollm2/probe_features.py --train_shards=16 --out=experiments/smollm2/probe
"""

from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags

import dblast_jax as dj
from dblast_jax.data.corpus import Corpus
from dblast_jax.models import target as target_lib

FLAGS = flags.FLAGS
flags.DEFINE_string("corpus", "corpora/smollm2_t1", "regenerated corpus folder")
flags.DEFINE_integer("train_shards", 16, "probe training data: shards 0 .. N-1")
flags.DEFINE_string("heldout", "68:72", "held-out shard range A:B")
flags.DEFINE_integer("seq_len", 256, "window per record (as the trainer's seq_len)")
flags.DEFINE_integer("vocab", 8192, "softmax over this many most frequent tokens")
flags.DEFINE_integer("epochs", 3, "probe training epochs")
flags.DEFINE_integer("batch", 512, "probe minibatch (positions)")
flags.DEFINE_float("lr", 3e-3, "Adam learning rate")
flags.DEFINE_list("layers", ["3", "8", "15", "22", "29"], "target layers to tap")
flags.DEFINE_string("out", "", "folder for probe.json (optional)")
flags.DEFINE_string("feature_cache", "", "read the taps (and the target's top-1) from this "
                    "finished feature cache folder (built by the trainer over the corpus's "
                    "first shards) instead of running the target; --heldout must then lie "
                    "inside it")


def extract(target, corpus: Corpus, layers: tuple[int, ...], seq_len: int, batch: int = 8):
    """-> dict of per-position arrays for every s with a response label at s + 1:
    feats [N, n_layers, H] at s - 1, final [N, H] at s (the target's own view),
    anchor [N], label [N]. Records run in batches right-padded to seq_len (the forward
    is causal, so padding after a record does not change its features)."""
    fwd = jax.jit(lambda toks: target_lib.forward(target.params, toks, config=target.config,
                                                  tap_layers=layers)[1])
    final_idx = layers.index(target.config.num_layers - 1)
    out = {"feats": [], "final": [], "anchor": [], "label": []}
    for lo in range(0, len(corpus), batch):
        recs = [corpus[i] for i in range(lo, min(lo + batch, len(corpus)))]
        padded = np.zeros((batch, seq_len), np.int32)
        for r, rec in enumerate(recs):
            toks = rec["tokens"][:seq_len]
            padded[r, :len(toks)] = toks
        taps = np.asarray(fwd(jnp.asarray(padded)))  # [batch, seq_len, n, H]
        for r, rec in enumerate(recs):
            toks, mask = rec["tokens"][:seq_len], rec["loss_mask"][:seq_len]
            s = np.arange(1, len(toks) - 1)
            s = s[mask[s + 1]]
            out["feats"].append(taps[r, s - 1].astype(np.float16))
            out["final"].append(taps[r, s, final_idx])
            out["anchor"].append(toks[s])
            out["label"].append(toks[s + 1])
    return {k: np.concatenate(v) for k, v in out.items()}


def extract_cached(cache_dir: str, corpus: Corpus, first: int, stop: int):
    """Like `extract`, from a trainer feature cache: records first .. stop - 1 of the
    corpus the cache was built on (its taps are the drafter's layers; the target's own
    prediction comes from the stored teacher top-k when the cache has one)."""
    from dblast_jax.train.feature_cache import FeatureCache
    cache = FeatureCache(cache_dir)
    seq_len = cache.meta["seq_len"]
    out = {"feats": [], "target_pred": [], "anchor": [], "label": []}
    for i in range(first, stop):
        rec = corpus[i]
        toks, mask = rec["tokens"][:seq_len], rec["loss_mask"][:seq_len]
        s = np.arange(1, len(toks) - 1)
        s = s[mask[s + 1]]
        out["feats"].append(cache.taps(i)[s - 1].astype(np.float16))
        teacher = cache.teacher(i)
        out["target_pred"].append(teacher[0][s + 1, 0] if teacher is not None
                                  else np.full(len(s), -1))
        out["anchor"].append(toks[s])
        out["label"].append(toks[s + 1])
    return {k: np.concatenate(v) for k, v in out.items()}, tuple(cache.meta["tap_layers"])


def rms(x):
    return x / np.sqrt(np.mean(x.astype(np.float32) ** 2, axis=-1, keepdims=True) + 1e-6)


def train_probe(x_tr, y_tr, x_ev, y_ev, head, *, epochs, batch, lr, seed=0):
    """Linear probe: logits = head @ (x W); returns held-out (top1, nll), train seconds."""
    d_in, h = x_tr.shape[1], head.shape[1]
    key = jax.random.PRNGKey(seed)
    w = jax.random.normal(key, (d_in, h)) * (1.0 / np.sqrt(d_in))
    opt = optax.adam(lr)
    state = opt.init(w)
    head = jnp.asarray(head)

    def loss_fn(w, x, y):
        logits = (x @ w) @ head.T
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))

    @jax.jit
    def step(w, state, x, y):
        loss, g = jax.value_and_grad(loss_fn)(w, x, y)
        upd, state = opt.update(g, state)
        return optax.apply_updates(w, upd), state, loss

    @jax.jit
    def evaluate(w, x, y):
        logits = (x @ w) @ head.T
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, y)
        return jnp.sum(jnp.argmax(logits, -1) == y), jnp.sum(nll)

    rng = np.random.default_rng(seed)
    t0 = time.process_time()
    n = len(y_tr)
    for _ in range(epochs):
        order = rng.permutation(n)
        for lo in range(0, n - batch + 1, batch):
            idx = order[lo:lo + batch]
            w, state, _ = step(w, state, jnp.asarray(x_tr[idx]), jnp.asarray(y_tr[idx]))
    cpu = time.process_time() - t0
    hits, nll = 0, 0.0
    for lo in range(0, len(y_ev), 4096):
        a, b = evaluate(w, jnp.asarray(x_ev[lo:lo + 4096]), jnp.asarray(y_ev[lo:lo + 4096]))
        hits, nll = hits + int(a), nll + float(b)
    return hits / len(y_ev), nll / len(y_ev), cpu


def main(argv):
    del argv
    layers = tuple(int(x) for x in FLAGS.layers)
    target = dj.load_target("smollm2-135m-instruct")
    last = target.config.num_layers - 1
    if last not in layers:
        layers = layers + (last,)
    a, b = (int(x) for x in FLAGS.heldout.split(":"))
    t0 = time.process_time()
    if FLAGS.feature_cache:
        corpus = Corpus(FLAGS.corpus, max_shards=b)
        per = corpus.shards[0]["sequences"]
        tr, layers = extract_cached(FLAGS.feature_cache, corpus, 0, FLAGS.train_shards * per)
        ev, _ = extract_cached(FLAGS.feature_cache, corpus, a * per, len(corpus))
    else:
        tr = extract(target, Corpus(FLAGS.corpus, max_shards=FLAGS.train_shards), layers,
                     FLAGS.seq_len)
        ev = extract(target, Corpus(FLAGS.corpus, first_shard=a, max_shards=b), layers,
                     FLAGS.seq_len)
    print(f"features: {len(tr['label'])} train / {len(ev['label'])} held-out positions, "
          f"{time.process_time() - t0:.0f} CPU s")

    # the restricted vocabulary (most frequent training labels + anchors)
    counts = np.bincount(np.concatenate([tr["label"], tr["anchor"]]),
                         minlength=target.config.vocab_size)
    vocab = np.argsort(-counts)[:FLAGS.vocab]
    remap = np.full(target.config.vocab_size, -1, np.int64)
    remap[vocab] = np.arange(len(vocab))
    y_tr, y_ev = remap[tr["label"]], remap[ev["label"]]
    keep_tr, keep_ev = y_tr >= 0, y_ev >= 0
    print(f"vocab {len(vocab)}: covers {keep_tr.mean():.3f} of train / {keep_ev.mean():.3f} "
          "of held-out labels")
    embed = np.asarray(target.params["embed"]["embedding"], np.float32)
    head = embed[vocab]
    results = {"train_positions": int(keep_tr.sum()), "heldout_positions": int(keep_ev.sum()),
               "vocab": len(vocab), "coverage_heldout": float(keep_ev.mean())}

    # bigram table on the same positions (full table, then restricted to covered labels)
    pairs = {}
    for x, y in zip(tr["anchor"], tr["label"]):
        pairs.setdefault(int(x), {}).setdefault(int(y), 0)
        pairs[int(x)][int(y)] += 1
    unigram = int(np.argmax(np.bincount(tr["label"])))
    pred = np.array([max(pairs[int(x)].items(), key=lambda kv: kv[1])[0] if int(x) in pairs
                     else unigram for x in ev["anchor"]])
    results["bigram"] = {"top1": float(np.mean(pred[keep_ev] == ev["label"][keep_ev]))}

    # the target itself at position s (full vocabulary)
    if "final" in ev:
        final = jnp.asarray(ev["final"][keep_ev])
        tgt_pred = np.concatenate([
            np.asarray(jnp.argmax(final[i:i + 2048] @ jnp.asarray(embed).T, -1))
            for i in range(0, len(final), 2048)])
    else:
        tgt_pred = ev["target_pred"][keep_ev]
    if np.all(tgt_pred >= 0):
        results["target"] = {"top1": float(np.mean(tgt_pred == ev["label"][keep_ev]))}

    e_tr = rms(embed[tr["anchor"]])[keep_tr]
    e_ev = rms(embed[ev["anchor"]])[keep_ev]
    inputs = {"emb": (e_tr, e_ev)}
    for j, layer in enumerate(layers):
        inputs[f"tap{layer}+emb"] = (
            np.concatenate([rms(tr["feats"][keep_tr, j]), e_tr], -1),
            np.concatenate([rms(ev["feats"][keep_ev, j]), e_ev], -1))
    if len(layers) > 1:
        all_tr = [rms(tr["feats"][keep_tr, j]) for j in range(len(layers))]
        all_ev = [rms(ev["feats"][keep_ev, j]) for j in range(len(layers))]
        inputs["taps" + "-".join(map(str, layers)) + "+emb"] = (
            np.concatenate(all_tr + [e_tr], -1), np.concatenate(all_ev + [e_ev], -1))
    for name, (x_tr, x_ev) in inputs.items():
        top1, nll, cpu = train_probe(x_tr, y_tr[keep_tr], x_ev, y_ev[keep_ev], head,
                                     epochs=FLAGS.epochs, batch=FLAGS.batch, lr=FLAGS.lr)
        results[name] = {"top1": top1, "nll": nll, "cpu_s": cpu}
        print(f"{name:28s} top1 {top1:.3f}  nll {nll:.3f}  ({cpu:.0f} CPU s)", flush=True)
    print(f"{'bigram':28s} top1 {results['bigram']['top1']:.3f}")
    if "target" in results:
        print(f"{'target (ceiling)':28s} top1 {results['target']['top1']:.3f}")
    if FLAGS.out:
        os.makedirs(FLAGS.out, exist_ok=True)
        with open(os.path.join(FLAGS.out, "probe.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    app.run(main)
