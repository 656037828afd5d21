"""Speculative decoding in PyTorch (dblast_jax/io/torch_drafter.py `spec_generate`).

* Lossless: the same design as tests/test_speculative.py, on a tiny transformers target
  (vocabulary 5, so the exact distribution of the first NEW generated tokens comes from
  enumerating all 5**NEW continuations), a confident random K = 4 drafter unlike it, many
  one-prompt calls, and a chi-square test against the exact distribution (false-alarm
  rate P_VALUE per case), for all four verification modes at T = 1 and one mode with
  top-k / top-p. The same test on a deliberately broken verifier must fail (power).
* T = 0: the same tokens and the same per-step accepted counts as the JAX sampler
  (dj.speculative_generate) on the same target (transformers weights converted with
  io.hf) and the same drafter (K = 1 with a token mask, K = 4 with a learned mask),
  with a stop token inside the text.
* Hugging Face remote code: `write_remote_code` / `dblast export --remote-code` make an
  export loadable with AutoModel.from_pretrained(..., trust_remote_code=True), and the
  loaded model generates.
"""

from __future__ import annotations

import itertools
import json
import os

import numpy as np
import pytest

pytestmark = [pytest.mark.torch,
              pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")]

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("scipy.stats")

from conftest import chi_square_pvalue  # noqa: E402
from dblast_jax.io import torch_drafter as TD  # noqa: E402

P_VALUE = 1e-4
VOCAB, NEW, BLOCK, SAMPLES = 5, 3, 3, 600
PROMPT = [1, 4]
MODES = TD.VERIFY_MODES


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # tiny matrices: extra intra-op threads only contend on a shared machine
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    yield
    torch.set_num_threads(old)


def _llama(vocab, seed, init_range, layers=2):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, initializer_range=init_range,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return transformers.LlamaForCausalLM(cfg).eval()


def _drafter_config(k, block, target_layer_ids, mask_token_id=None, correction_rank=0,
                    causal=False):
    cfg = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 8, "intermediate_size": 48, "num_hidden_layers": 1,
           "block_size": block, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
           "dflash_config": {"mask_token_id": mask_token_id,
                             "target_layer_ids": list(target_layer_ids)}}
    if causal:  # vLLM's key, and ours
        cfg["dflash_config"]["causal"] = True
    if k > 1 or mask_token_id is None or correction_rank or causal:
        cfg["dblast_config"] = {"num_categories": k, "expander_width": 8 if k > 1 else 0,
                                "mask": "learned" if mask_token_id is None else "token"}
    if correction_rank:
        cfg["dblast_config"].update(correction="previous-token",
                                    correction_rank=correction_rank)
    if causal:
        cfg["dblast_config"]["block_attention"] = "causal"
    return cfg


def _random_drafter(config, seed=1):
    drafter = TD.DBlastDrafterTorch(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in drafter.parameters():
            p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen) if p.dim() == 1 else
                    2.0 * torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return drafter


# ---- lossless ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    return _tiny_pair(_drafter_config(4, BLOCK, (0, 1)))


@pytest.fixture(scope="module")
def tiny_corrected():
    """The same, with a serial correction head (rank 4) on the K = 4 drafter."""
    return _tiny_pair(_drafter_config(4, BLOCK, (0, 1), correction_rank=4))


@pytest.fixture(scope="module")
def tiny_causal():
    """The same K = 4 drafter with a causal block (one pass per drafted position)."""
    return _tiny_pair(_drafter_config(4, BLOCK, (0, 1), causal=True))


def _tiny_pair(config):
    target = _llama(VOCAB, 0, 0.5)
    drafter = _random_drafter(config)
    with torch.no_grad():
        torch.manual_seed(2)  # text sampled from the target at T = 1
        text = target.generate(torch.tensor([PROMPT] * 6), max_new_tokens=10, do_sample=True,
                               top_k=0, top_p=1.0)
    # a short fit: drafts that the target often accepts, but not always (a drafter close
    # to the target also gives the broken-verifier test its power)
    return target, _fit_torch(drafter, target, text.tolist(), steps=8, lr=2e-2)


def exact_distribution(target, temperature, top_k=0, top_p=1.0):
    """Exact probability of each of the VOCAB**NEW continuations of PROMPT."""
    seqs = torch.tensor(list(itertools.product(range(VOCAB), repeat=NEW)))
    full = torch.cat([torch.tensor(PROMPT).expand(len(seqs), -1), seqs], dim=1)
    with torch.no_grad():
        logits = target(input_ids=full).logits[:, len(PROMPT) - 1:-1]
    p = TD.sampling_probs(logits, temperature, top_k, top_p)  # [N, NEW, V]
    probs = p.gather(-1, seqs[..., None])[..., 0].double().prod(-1).numpy()
    return seqs.numpy(), probs / probs.sum()


def sample_sequences(target, drafter, n=SAMPLES, seed=0, **kw):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.tensor([PROMPT])
    samples, accepted = [], []
    for _ in range(n):
        out = drafter.spec_generate(target, ids, NEW, generator=gen, **kw)
        assert len(out.tokens) == NEW
        samples.append(tuple(out.tokens))
        accepted += out.accepted
    return samples, np.array(accepted)


CASES = [(mode, 1.0, 0, 1.0) for mode in MODES] + [("sampled-mixture", 1.0, 3, 0.9)]


@pytest.mark.parametrize("mode,temperature,top_k,top_p", CASES)
def test_lossless_against_exact_target_distribution(tiny, mode, temperature, top_k, top_p):
    target, drafter = tiny
    seqs, probs = exact_distribution(target, temperature, top_k, top_p)
    samples, accepted = sample_sequences(
        target, drafter, temperature=temperature, top_k=top_k, top_p=top_p, verify_mode=mode,
        category_temperature=1.3, draft_temperature=0.8)
    pvalue = chi_square_pvalue(samples, seqs, probs)
    print(f"\n[{mode} T={temperature} top_k={top_k} top_p={top_p}] chi-square p = "
          f"{pvalue:.3g}, steps accepting a draft: {(accepted > 0).mean():.3f}")
    assert pvalue > P_VALUE
    assert (accepted > 0).mean() > 0.05  # acceptance paths are exercised


_CORRECT_VERIFY_BLOCK = TD.verify_block


def _broken_verify_block(target_probs, drafts, proposal, gen_accept, gen_residual):
    """A classic bug: at a rejection, sample from p instead of the residual max(0, p - Q)."""
    n, _, alphas = _CORRECT_VERIFY_BLOCK(target_probs, drafts, proposal, gen_accept,
                                         gen_residual)
    return n, int(torch.multinomial(target_probs[n], 1, generator=gen_residual)), alphas


@pytest.mark.parametrize("mechanism,seed", [("tiny_corrected", 3), ("tiny_causal", 5)],
                         ids=["correction", "causal"])
@pytest.mark.parametrize("mode", MODES)
def test_left_to_right_drafters_are_lossless(request, mechanism, seed, mode):
    """The serial correction head (each q_i given the drafted d_{i-1}) and the causal
    block (draft i from a pass over the drafted prefix), in every verification mode."""
    target, drafter = request.getfixturevalue(mechanism)
    seqs, probs = exact_distribution(target, 1.0)
    samples, accepted = sample_sequences(target, drafter, seed=seed, temperature=1.0,
                                         verify_mode=mode, category_temperature=1.3,
                                         draft_temperature=0.8)
    pvalue = chi_square_pvalue(samples, seqs, probs)
    print(f"\n[{mechanism} {mode}] chi-square p = {pvalue:.3g}, steps accepting a draft: "
          f"{(accepted > 0).mean():.3f}")
    assert pvalue > P_VALUE
    assert (accepted > 0).mean() > 0.05


def test_causal_power_when_verified_against_the_all_mask_pass(tiny_causal, monkeypatch):
    """Drafts taken left to right but verified against the q of one pass over MASK
    positions (what a DFlash loader would draft from) must fail."""
    target, drafter = tiny_causal
    seqs, probs = exact_distribution(target, 1.0)
    real = TD._CausalSerial.sampled

    def all_mask_q(self, z, draft_temperature, gen):
        drafts, q = real(self, z, draft_temperature, gen)
        first = torch.einsum("kjh,vh->kjv", self.base.float(), self.head_w)
        return drafts, torch.softmax(first / draft_temperature, dim=-1)

    monkeypatch.setattr(TD._CausalSerial, "sampled", all_mask_q)
    samples, _ = sample_sequences(target, drafter, n=3 * SAMPLES, seed=6, temperature=1.0,
                                  verify_mode="sampled-branch", draft_temperature=0.8)
    pvalue = chi_square_pvalue(samples, seqs, probs)
    print(f"\n[causal, all-MASK q] chi-square p = {pvalue:.3g}")
    assert pvalue < P_VALUE


def test_correction_forward_needs_the_previous_tokens(tiny_corrected, tiny):
    target, drafter = tiny_corrected
    ids = torch.tensor([PROMPT + [2, 3, 1]])
    with torch.no_grad():
        taps = TD._taps(target(input_ids=ids, output_hidden_states=True).hidden_states,
                        drafter.target_layer_ids)
    embed = target.get_input_embeddings().weight
    head = target.get_output_embeddings().weight
    args = (taps, torch.tensor([2]), torch.tensor([2]), embed, head)
    with pytest.raises(ValueError, match=r"correction head: forward needs prev_tokens"):
        drafter(*args)
    with pytest.raises(ValueError, match=r"prev_tokens must be \[1, 2\], got \[1, 3\]"):
        drafter(*args, prev_tokens=torch.tensor([[2, 3, 1]]))
    with torch.no_grad():  # the previous tokens matter
        a, _ = drafter(*args, prev_tokens=torch.tensor([[2, 3]]))
        b, _ = drafter(*args, prev_tokens=torch.tensor([[2, 4]]))
    assert float((a[:, :, 0] - b[:, :, 0]).abs().max()) == 0.0
    assert float((a[:, :, 1] - b[:, :, 1]).abs().max()) > 1e-3
    with pytest.raises(ValueError, match="prev_tokens is for drafters with a correction"):
        tiny[1](*args, prev_tokens=torch.tensor([[2, 3]]))


def test_correction_power_when_verified_against_the_uncorrected_q(tiny_corrected,
                                                                    monkeypatch):
    """Drafts taken from the corrected q but verified against the parallel pass's
    uncorrected q (the bug a correction port is most likely to have) must fail."""
    import copy
    target, drafter = tiny_corrected
    drafter = copy.deepcopy(drafter)
    with torch.no_grad():  # a stronger correction: the two q differ more
        drafter.dblast.correction.out_proj.weight.mul_(3.0)
    seqs, probs = exact_distribution(target, 1.0)
    real = TD._Serial.sampled

    def uncorrected_q(self, z, draft_temperature, gen):
        drafts, _ = real(self, z, draft_temperature, gen)
        return drafts, torch.softmax(self.base / draft_temperature, dim=-1)

    monkeypatch.setattr(TD._Serial, "sampled", uncorrected_q)
    samples, _ = sample_sequences(target, drafter, seed=4, temperature=1.0,
                                  verify_mode="sampled-branch", draft_temperature=0.8)
    pvalue = chi_square_pvalue(samples, seqs, probs)
    print(f"\n[correction, uncorrected q] chi-square p = {pvalue:.3g}")
    assert pvalue < P_VALUE


def test_the_test_has_power_on_a_broken_verifier(tiny, monkeypatch):
    target, drafter = tiny
    seqs, probs = exact_distribution(target, 1.0)
    monkeypatch.setattr(TD, "verify_block", _broken_verify_block)
    samples, _ = sample_sequences(target, drafter, seed=1, temperature=1.0,
                                  verify_mode="greedy-branch")
    pvalue = chi_square_pvalue(samples, seqs, probs)
    print(f"\n[broken verifier] chi-square p = {pvalue:.3g}")
    assert pvalue < P_VALUE


def test_sampling_probs_equal_jax_sampling_logprobs():
    """The torch sampling distribution is dblast_jax.sampling's (ties included)."""
    import jax.numpy as jnp
    from dblast_jax.sampling import sampling_logprobs
    gen = np.random.default_rng(0)
    logits = np.round(gen.normal(size=(64, 11)) * 2, 1).astype(np.float32)  # many ties
    for temperature, top_k, top_p in ((1.0, 0, 1.0), (0.7, 3, 1.0), (1.3, 0, 0.8),
                                      (1.0, 4, 0.6), (2.0, 11, 0.95)):
        ours = TD.sampling_probs(torch.from_numpy(logits), temperature, top_k, top_p).numpy()
        ref = np.exp(np.asarray(sampling_logprobs(jnp.asarray(logits), temperature, top_k,
                                                  top_p)))
        np.testing.assert_allclose(ours, ref, atol=1e-6)
        np.testing.assert_array_equal(ours > 0, ref > 0)


# ---- T = 0: the JAX sampler's tokens and accepted counts ------------------------------------

JV, JBLOCK, JNEW = 32, 4, 30


def _fit_torch(drafter, target, seqs, steps=40, lr=1e-2):
    """A few Adam steps of the block cross-entropy (every branch) on the target's text,
    so that some drafts are accepted."""
    embed = target.get_input_embeddings().weight.detach()
    head = target.get_output_embeddings().weight.detach()
    batches = []
    for seq in seqs:
        ids = torch.tensor([seq])
        with torch.no_grad():
            hs = target(input_ids=ids, output_hidden_states=True).hidden_states
        taps = TD._taps(hs, drafter.target_layer_ids)
        b = drafter.block_size
        anchors = torch.arange(1, len(seq) - b + 1)
        labels = torch.stack([ids[0, s + 1:s + b] for s in anchors.tolist()])
        batches.append((taps.expand(len(anchors), -1, -1, -1), ids[0, anchors], anchors, labels))
    # teacher forcing: the data's previous tokens
    corrected = drafter.correction != "none" or drafter.causal
    opt = torch.optim.Adam([p for n, p in drafter.named_parameters() if "prior" not in n], lr=lr)
    drafter.train()
    for _ in range(steps):
        opt.zero_grad()
        loss = 0.0
        for taps, tokens, anchors, labels in batches:
            prev = torch.cat([tokens[:, None], labels[:, :-1]], 1) if corrected else None
            logits, _ = drafter(taps, tokens, anchors, embed, head, prev_tokens=prev)
            k = logits.shape[1]
            loss = loss + torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), labels[:, None].expand(-1, k, -1).reshape(-1))
        loss.backward()
        opt.step()
    return drafter.eval()


@pytest.fixture(scope="module")
def jax_pair(tmp_path_factory):
    """A tiny transformers target, the same target in JAX, and prompts."""
    import dblast_jax as dj
    from dblast_jax.io import hf
    root = tmp_path_factory.mktemp("torch-spec")
    model = _llama(JV, 3, 0.3)
    with torch.no_grad():  # non-trivial norm scales
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(root / "target")
    tc, tp = hf.load_hf(root / "target")
    gen = np.random.default_rng(1)
    prompts = [[int(t) for t in gen.integers(0, JV - 1, 7)] for _ in range(2)]
    with torch.no_grad():
        plain = [model.generate(torch.tensor([p]), max_new_tokens=40, do_sample=False
                                )[0, len(p):].tolist() for p in prompts]
    return dict(model=model, target=dj.Target(tc, tp, None, "tiny"), prompts=prompts,
                plain=plain, root=root)


@pytest.mark.parametrize("k,rank,causal", [(1, 0, False), (4, 0, False), (1, 4, False),
                                           (4, 0, True)])
def test_temperature_zero_equals_jax_sampler(jax_pair, k, rank, causal):
    """rank > 0: a serial correction head of that rank; causal: a causal block (both
    trained with teacher forcing)."""
    import jax
    import dblast_jax as dj
    from dblast_jax import generation
    from dblast_jax.config import DrafterConfig, SamplingConfig
    from dblast_jax.io import dflash
    from dblast_jax.models import drafter as D
    from dblast_jax.sampler import speculative_generate_tokens
    from safetensors.torch import save_file

    model, target, prompts = jax_pair["model"], jax_pair["target"], jax_pair["prompts"]
    tc = target.config
    kw = (dict(mask_token_id=JV - 1) if k == 1 else
          dict(num_categories=4, expander_width=8, mask_token_id=None))
    if rank:
        kw.update(correction="previous-token", correction_rank=rank)
    if causal:
        kw.update(block_attention="causal")
    dc = DrafterConfig.for_target(tc, num_layers=1, block_size=JBLOCK, target_layer_ids=(0,),
                                  **kw)
    dp = D.init_drafter_params(dc, tc, jax.random.key(k))
    folder = dflash.export_drafter(dp, dc, str(jax_pair["root"] / f"k{k}_r{rank}_c{causal}"))
    drafter = TD.DBlastDrafterTorch.from_pretrained(folder)
    if k > 1:  # a prior with clear gaps: at Z_T -> 0 both sides draw its argmax
        with torch.no_grad():
            drafter.dblast.prior.weight.normal_(0.0, 1.0, generator=torch.Generator()
                                                .manual_seed(0))
    seqs = [p + t for p, t in zip(prompts, jax_pair["plain"])]
    drafter = _fit_torch(drafter, model, seqs)
    save_file({n: t.detach().contiguous() for n, t in drafter.state_dict().items()},
              os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    dc, dp = dflash.load_dflash(folder, tc)

    plain = jax_pair["plain"]  # a stop token that ends the 2nd text late, not the 1st
    stop = next(t for t in plain[1][10:JNEW] if plain[1].index(t) >= 10
                and t not in plain[0][:JNEW])
    z_t = 1e-3  # z = the prior's argmax on both sides (K = 1: z = 0)
    all_acc = []
    for mode in ("greedy-branch", "mixture"):
        sampling = SamplingConfig(temperature=0.0, max_new_tokens=JNEW, stop_tokens=(stop,),
                                  verify_mode=mode, category_temperature=z_t)
        api = dj.speculative_generate(target, dj.Drafter(dc, dp), prompts, sampling, chat=False)
        rng, sampling, tokens, lengths, cache = generation._prepare(
            target, prompts, sampling, 0, False, extra_cache=dc.block_size)
        out, counts, accepted, _ = speculative_generate_tokens(
            target.params, dp, tokens, lengths, rng, target_config=tc, drafter_config=dc,
            sampling=sampling, cache_size=cache)  # the loop the API ran (same compile)
        out, counts, accepted = map(np.asarray, (out, counts, accepted))
        for row, prompt in enumerate(prompts):
            jax_tokens = out[row, :counts[row]].tolist()
            assert api.tokens[row] == jax_tokens
            res = drafter.spec_generate(model, torch.tensor([prompt]), JNEW,
                                        temperature=0.0, verify_mode=mode,
                                        category_temperature=z_t, stop_token_ids=[stop],
                                        generator=torch.Generator().manual_seed(row))
            assert res.tokens == jax_tokens, (mode, row)
            assert res.tokens == jax_pair["plain"][row][:len(res.tokens)]
            assert res.accepted == [int(a) for a in accepted[row] if a >= 0], (mode, row)
            assert res.expected == [float(a) for a in res.accepted]  # T = 0: 0/1 alphas
            all_acc += res.accepted
    print(f"\n[K = {k}, correction rank {rank}, causal {causal}] accepted drafts per "
          f"step (both modes, both prompts): {all_acc}")
    assert stop in res.tokens and res.tokens[-1] == stop and len(res.tokens) < JNEW
    # non-vacuous: some steps accept drafts, not every step accepts all of them
    assert max(all_acc) >= 2 and min(all_acc) <= 1, all_acc


# ---- Hugging Face remote code -----------------------------------------------------------------

def test_remote_code_export_loads_with_automodel_and_generates(tmp_path, monkeypatch, tiny):
    import transformers.dynamic_module_utils as dmu
    from dblast_jax import cli
    from dblast_jax.io import dflash, hf_remote

    assert hf_remote.MODELING_FILE in dflash.EXPORT_MODELING_FILES
    target, drafter = tiny
    folder = tmp_path / "k4"
    os.makedirs(folder)
    with open(folder / "config.json", "w") as fh:
        json.dump({"architectures": ["DFlashDraftModel"], "model_type": "qwen3",
                   **drafter.config, "dtype": "float32"}, fh)
    from safetensors.torch import save_file
    save_file({n: t.contiguous() for n, t in drafter.state_dict().items()},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    hf_remote.write_remote_code(folder)
    hf_remote.write_remote_code(folder)  # idempotent
    assert sorted(os.listdir(folder)) == ["config.json", "model.safetensors",
                                          "modeling_dblast.py"]
    # self-contained: only torch / transformers (and the standard library) are required
    assert set(dmu.get_imports(folder / "modeling_dblast.py")) <= {
        "__future__", "inspect", "json", "os", "typing", "torch", "transformers"}

    monkeypatch.setattr(dmu, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    auto = transformers.AutoModel.from_pretrained(str(folder), trust_remote_code=True)
    assert type(auto).__name__ == "DBlastDraftModel"
    assert auto.num_categories == 4 and auto.block_size == BLOCK
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(auto.state_dict()[name], tensor), name
    kw = dict(temperature=1.0, top_k=4, top_p=0.95, verify_mode="sampled-mixture",
              category_temperature=0.7, draft_temperature=0.9, stop_token_ids=[3])
    ids = torch.tensor([PROMPT])
    a = auto.spec_generate(target, ids, 12, generator=torch.Generator().manual_seed(5), **kw)
    b = drafter.spec_generate(target, ids, 12, generator=torch.Generator().manual_seed(5), **kw)
    assert a == b and len(a.tokens) >= 1 and len(a.accepted) >= 1

    # `dblast export --remote-code` on a drafter folder; a plain re-export drops the file
    from dblast_jax.config import DrafterConfig, TargetConfig
    from dblast_jax.models import drafter as D
    import jax
    tc = TargetConfig.tiny_qwen3()
    dc = DrafterConfig.for_target(tc, num_layers=1, block_size=4, num_categories=2,
                                  expander_width=4)
    src = dflash.export_drafter(D.init_drafter_params(dc, tc, jax.random.key(0)), dc,
                                str(tmp_path / "src"))
    out = str(tmp_path / "cli")
    args = ["export", src, "--out", out, "--target", "tiny-qwen3"]
    assert cli.main(args + ["--remote-code"]) == 0
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "modeling_dblast.py"]
    with open(os.path.join(out, "config.json")) as fh:
        assert json.load(fh)["auto_map"] == hf_remote.AUTO_MAP
    loaded = transformers.AutoModel.from_pretrained(out, trust_remote_code=True)
    assert loaded.num_categories == 2
    assert cli.main(args) == 0  # a previous export: replaced, the modeling file removed
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
