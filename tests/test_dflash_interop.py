"""Exports against z-lab's reference implementation (the `dflash` package, 0.1.0).

A K = 1 token-mask export must be a plain DFlash checkpoint: `dflash.DFlashDraftModel.
from_pretrained` loads it with no missing or unexpected tensors, its block logits equal
ours on the same context features and anchor, and its own speculative loop
(`dflash.model.dflash_generate`) at T = 0 gives our tokens and our per-step acceptance.
Targets: a tiny random Llama (SmolLM2-like: tied embeddings, GQA) and a tiny random Qwen3
(q/k norms, untied head), built with transformers and converted with `io.hf` as in
test_hf_parity.py, so both sides run the same target weights.

The `dflash` package pins other transformers / torch versions than ours, so it is
installed on its own with `pip install --no-deps dflash==0.1.0` (README's test command);
without it these tests skip.

Acceptance-length convention. `dflash_generate` returns, per target pass, the number of
tokens that pass added to the output: accepted drafts + 1 (the target's own next
token), cut to the tokens still wanted (max_new_tokens) and at the first stop token. Our
sampler records `accepted` = accepted drafts only (tau = mean(accepted + 1)), so
    dflash[i] == min(accepted[i] + 1, tokens still wanted, up to and incl. a stop token).
DFlash also shortens its last block to the tokens still wanted (verify size
min(b, remaining + 1)); its drafter attends over the whole block, so drafts of such a
short final block can differ from ours. Those steps are compared through the output
tokens only (greedy verification is lossless either way); every full-block step must
match exactly.
"""

from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = [pytest.mark.torch,  # dflash passes past_key_values= to the target
              pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")]

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
dfm = pytest.importorskip(
    "dflash.model", reason="z-lab's dflash package is not installed; install it with "
                           "`pip install --no-deps dflash==0.1.0` (README's test command)")

import dblast_jax as dj  # noqa: E402
from dblast_jax.config import DrafterConfig, SamplingConfig, TargetConfig  # noqa: E402
from dblast_jax.io import dflash, hf  # noqa: E402
from dblast_jax.models import drafter as D  # noqa: E402
from dblast_jax.models import target as T  # noqa: E402

BLOCK = 6
NEW_TOKENS = 40
PROMPT_LEN = 9
NUM_PROMPTS = 3
FIT_STEPS = 20  # partial fit: acceptance lengths spread over 1 .. b

# SmolLM2-like (tied, GQA, Llama) and Qwen3-like (q/k norm, untied, explicit head_dim).
# initializer_range 0.3: greedy text that wanders instead of repeating one token; a small
# vocabulary and a short fit give acceptance lengths spread over 1 .. b.
TARGETS = {
    "llama": ("Llama", dict(vocab_size=64, hidden_size=48, intermediate_size=80,
                            num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=2,
                            rope_theta=5000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                            initializer_range=0.3)),
    "qwen3": ("Qwen3", dict(vocab_size=64, hidden_size=40, intermediate_size=72,
                            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=12, rope_theta=1e6, tie_word_embeddings=False,
                            initializer_range=0.3)),
}


@pytest.fixture(autouse=True)
def _cpu_timer(monkeypatch):
    # dflash_generate(return_stats=True) times itself with torch.cuda.synchronize()
    monkeypatch.setattr(dfm, "_cuda_time", time.perf_counter)


def _hf_target(arch: str, folder):
    """(torch model, dj.Target) of one tiny random target, the same weights on both sides."""
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    cls, kwargs = TARGETS[arch]
    torch.manual_seed(0)
    cfg = getattr(transformers, f"{cls}Config")(**kwargs, bos_token_id=None, eos_token_id=None,
                                                pad_token_id=None)
    model = getattr(transformers, f"{cls}ForCausalLM")(cfg).eval()
    with torch.no_grad():  # non-trivial norm scales
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(folder)
    tc, tp = hf.load_hf(folder)
    return model, dj.Target(tc, tp, None, arch)


def _random_drafter(tc: TargetConfig, seed: int = 0):
    """K = 1, token mask (the last vocabulary row), every leaf O(1)-effective."""
    dc = DrafterConfig.for_target(tc, num_layers=2, block_size=BLOCK,
                                  mask_token_id=tc.vocab_size - 1)
    gen = np.random.default_rng(seed)

    def leaf(a):
        z = gen.standard_normal(a.shape, np.float32)
        return jnp.asarray(1.0 + 0.3 * z if len(a.shape) == 1 else 1.5 * z / np.sqrt(a.shape[-2]))

    return dc, jax.tree.map(leaf, D.abstract_drafter_params(dc, tc))


def _fit(dc, dp, target, seqs, steps=FIT_STEPS, lr=1e-2):
    """A few Adam steps of the DFlash CE on the target's own greedy text, so that some
    drafts are accepted (a random drafter's acceptance is ~0 and would test nothing)."""
    import optax
    tc, tp = target.config, target.params
    tokens = jnp.asarray(seqs, jnp.int32)
    _, taps = T.forward(tp, tokens, config=tc, tap_layers=dc.target_layer_ids)
    n_anchor = tokens.shape[1] - BLOCK + 1
    anchors = jnp.broadcast_to(jnp.arange(n_anchor, dtype=jnp.int32), (tokens.shape[0], n_anchor))
    labels = tokens[:, jnp.arange(n_anchor)[:, None] + jnp.arange(1, BLOCK)[None, :]]

    def loss(p):
        h, _ = D.train_hidden(p, tp, taps, tokens, anchors, drafter_config=dc, target_config=tc)
        logq = jax.nn.log_softmax(D.branch_logits(tp, h[:, :, 0], tc), axis=-1)
        return -jnp.mean(jnp.take_along_axis(logq, labels[..., None], axis=-1))

    opt = optax.adam(lr)

    @jax.jit
    def step(p, s):
        value, grads = jax.value_and_grad(loss)(p)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, value

    state = opt.init(dp)
    for _ in range(steps):
        dp, state, value = step(dp, state)
    return dp, taps


@pytest.fixture(scope="module", params=sorted(TARGETS))
def setup(request, tmp_path_factory):
    """Per target: torch target, our target, prompts, a fitted K = 1 drafter, its export and
    the reference package's model loaded from it."""
    arch = request.param
    root = tmp_path_factory.mktemp(f"interop-{arch}")
    model, target = _hf_target(arch, root / "target")
    tc = target.config
    gen = np.random.default_rng(1)
    prompts = [[int(t) for t in gen.integers(0, tc.vocab_size - 1, PROMPT_LEN)]
               for _ in range(NUM_PROMPTS)]
    with torch.no_grad():  # the target's greedy text (transformers' own generate)
        plain = [model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False
                                )[0, len(p):].tolist() for p in prompts]
    dc, dp = _random_drafter(tc)
    seqs = [p + t for p, t in zip(prompts, plain)]
    dp, taps = _fit(dc, dp, target, seqs)
    folder = dflash.export_drafter(dp, dc, str(root / "drafter"))
    ref, info = dfm.DFlashDraftModel.from_pretrained(folder, output_loading_info=True)
    return dict(arch=arch, model=model, target=target, prompts=prompts, plain=plain,
                seq0=seqs[0], taps0=np.asarray(taps[:1]),
                dc=dc, dp=dp, folder=folder, ref=ref.eval(), info=info)


def test_export_is_a_plain_dflash_checkpoint(setup):
    info, ref, dc = setup["info"], setup["ref"], setup["dc"]
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"] and not info["error_msgs"], info
    assert ref.dtype == torch.float32  # read from the config's dtype field ("auto")
    assert (ref.block_size, ref.mask_token_id) == (dc.block_size, dc.mask_token_id)
    assert list(ref.target_layer_ids) == list(dc.target_layer_ids)
    assert len(ref.layers) == dc.num_layers
    assert not any(layer.self_attn.is_causal for layer in ref.layers)
    assert ref.config.rope_parameters["rope_theta"] == pytest.approx(dc.rope_theta)
    with open(os.path.join(setup["folder"], "config.json")) as fh:
        cfg = json.load(fh)
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"] == {"mask_token_id": dc.mask_token_id,
                                    "target_layer_ids": list(dc.target_layer_ids)}
    assert cfg["block_size"] == BLOCK and cfg["num_target_layers"] == 4
    assert cfg["dtype"] == cfg["torch_dtype"] == "float32"
    assert "dblast_config" not in cfg
    # every tensor of the reference model came from the file (nothing left at init values)
    ours = {k for _, k, _ in dflash.key_table(dc)}
    assert set(ref.state_dict()) == ours


def test_block_logits_match_the_reference(setup):
    """Same context features (our taps) and anchor -> the same b - 1 logits rows."""
    target, dc, dp, ref = setup["target"], setup["dc"], setup["dp"], setup["ref"]
    tc, tp = target.config, target.params
    taps = np.repeat(setup["taps0"], 3, axis=0)  # [3, T, n_taps, H], one row per anchor
    anchors = np.array([3, 9, 16], np.int32)
    anchor_tokens = np.array([setup["seq0"][s] for s in anchors], np.int32)
    cache = D.init_draft_cache(dc, 3, taps.shape[1])
    cache = D.append_context(dp, jnp.asarray(taps), jnp.zeros((3,), jnp.int32), cache,
                             drafter_config=dc)
    h, _ = D.draft_hidden(dp, tp, jnp.asarray(anchor_tokens), jnp.asarray(anchors), cache,
                          drafter_config=dc, target_config=tc)
    ours = np.asarray(D.branch_logits(tp, h, tc))[:, 0]  # [3, b-1, V]
    head = dfm._output_head(setup["model"])
    worst, drafts = 0.0, set()
    for row, s in enumerate(anchors):
        s = int(s)
        feats = torch.from_numpy(taps[row:row + 1, :s].reshape(1, s, -1).copy())
        block = torch.tensor([[int(anchor_tokens[row])] + [dc.mask_token_id] * (BLOCK - 1)])
        with torch.no_grad():
            noise = dfm._raw_input_embeddings(setup["model"], block)
            hidden = ref(target_hidden=feats, noise_embedding=noise,
                         position_ids=torch.arange(s + BLOCK)[None])
            theirs = ref.compute_logits(hidden[:, 1:], head)[0].float().numpy()
        assert theirs.shape == ours[row].shape == (BLOCK - 1, tc.vocab_size)
        worst = max(worst, float(np.abs(theirs - ours[row]).max()))
        drafts.update(ours[row].argmax(-1).tolist())
    assert np.abs(ours).max() > 0.5  # not a vacuous comparison
    print(f"\n[{setup['arch']}] block logits max |diff| {worst:.2e}")
    assert worst <= 1e-4
    assert len(drafts) > 2  # the drafter is not collapsed onto one token


def _expected_dflash_lengths(accepted, tokens, stops, budget):
    """Our per-step accepted counts -> DFlash's per-step acceptance lengths, and whether
    that step verified a full block in DFlash (see the module docstring)."""
    out, full, done = [], [], 1  # the prefill emits the first token
    for n in accepted:
        if n < 0 or done >= budget:
            break
        remaining = budget - done
        produced = min(int(n) + 1, remaining)
        hit = [j for j, t in enumerate(tokens[done:done + produced]) if t in stops]
        if hit:
            produced = hit[0] + 1
        full.append(remaining + 1 >= BLOCK)
        out.append(produced)
        done += produced
        if hit:
            break
    return out, full


def test_reference_speculative_loop_gives_our_tokens_and_acceptance(setup):
    from dblast_jax.sampler import cache_size_for, pad_prompts, speculative_generate_tokens

    target, dc, dp, ref, model = (setup["target"], setup["dc"], setup["dp"], setup["ref"],
                                  setup["model"])
    tc = target.config
    # one stop token the greedy text does emit, so the stop path is exercised too
    stop = setup["plain"][1][NEW_TOKENS // 2]
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=NEW_TOKENS, stop_tokens=(stop,))
    tokens, lengths = pad_prompts(setup["prompts"], multiple=16)
    out, counts, accepted, _ = speculative_generate_tokens(
        target.params, dp, jnp.asarray(tokens), jnp.asarray(lengths), jax.random.key(0),
        target_config=tc, drafter_config=dc, sampling=sampling,
        cache_size=cache_size_for(tokens.shape[1], NEW_TOKENS, extra=BLOCK))
    out, counts, accepted = map(np.asarray, (out, counts, accepted))
    # the public API runs the same jitted loop (same shapes: no new compile)
    api = dj.speculative_generate(target, dj.Drafter(dc, dp), setup["prompts"], sampling,
                                  chat=False)
    assert api.tokens == [out[r, :counts[r]].tolist() for r in range(len(setup["prompts"]))]
    assert api.stats["tau"] == pytest.approx(float(np.mean(accepted[accepted >= 0] + 1)))
    total_full, total_acc = 0, []
    for row, prompt in enumerate(setup["prompts"]):
        ours = out[row, :counts[row]].tolist()
        res = dfm.dflash_generate(ref, model, torch.tensor([prompt]), NEW_TOKENS, [stop],
                                  temperature=0.0, return_stats=True)
        theirs = res.output_ids[0, len(prompt):].tolist()
        assert theirs == ours, (row, theirs, ours)
        assert ours == setup["plain"][row][:len(ours)]  # and both are the target's greedy text
        want, full = _expected_dflash_lengths(accepted[row], ours, {stop}, NEW_TOKENS)
        got = list(res.acceptance_lengths)
        n_full = sum(full)  # full-block steps come first (the budget only shrinks)
        assert got[:n_full] == want[:n_full], (row, got, want, full)
        assert sum(got) == sum(want) == len(ours) - 1, (row, got, want)
        total_full += n_full
        total_acc += want[:n_full]
    print(f"\n[{setup['arch']}] DFlash acceptance lengths on full blocks: {total_acc}")
    # non-vacuous: some steps accept drafts, and not every step accepts all of them
    assert total_full >= 10 and max(total_acc) >= 3 and min(total_acc) <= 2, total_acc


def test_dblast_only_exports_say_so(tmp_path):
    """K > 1 and learned-mask exports carry dblast_config.dblast_only; the reference
    loader would see their dblast.* tensors as unexpected (it cannot run them)."""
    tc = TargetConfig.tiny_qwen3()
    for name, kw in (("k4", dict(num_categories=4, expander_width=8)),
                     ("learned", dict(mask_token_id=None))):
        dc = DrafterConfig.for_target(tc, num_layers=1, block_size=4, **kw)
        dp = D.init_drafter_params(dc, tc, jax.random.key(0))
        folder = dflash.export_drafter(dp, dc, str(tmp_path / name))
        with open(os.path.join(folder, "config.json")) as fh:
            cfg = json.load(fh)
        assert cfg["dblast_config"]["dblast_only"] is True, name
        assert "DBlast-only" in cfg["dblast_config"]["note"]
        _, info = dfm.DFlashDraftModel.from_pretrained(folder, output_loading_info=True)
        assert info["unexpected_keys"] and all(k.startswith("dblast.")
                                               for k in info["unexpected_keys"]), name
        back, _ = dflash.load_dflash(folder, tc)  # and we still read it
        assert back.num_categories == dc.num_categories


def test_bfloat16_export_loads_as_bfloat16(setup, tmp_path):
    folder = dflash.export_drafter(setup["dp"], setup["dc"], str(tmp_path / "bf16"),
                                   dtype="bfloat16")
    ref, info = dfm.DFlashDraftModel.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert ref.dtype == torch.bfloat16
