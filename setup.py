"""dblast_jax: dependent block drafting for stochastic speculative decoding, in JAX."""

from setuptools import find_packages, setup

CORE = [
    "jax==0.10.2",
    "jaxlib==0.10.2",
    "flax==0.12.8",
    "optax==0.2.8",
    "orbax-checkpoint==0.12.8",
    "grain==0.2.18",
    "tensorflow-datasets==4.9.10",
    "chex==0.1.92",
    "absl-py==2.5.1",
    "safetensors==0.8.0",
    "gguf==0.19.0",
    "tokenizers==0.23.3",
    "jinja2==3.1.6",
    "numpy==2.4.6",
    "tqdm==4.70.1",
    "matplotlib==3.11.2",
]

TORCH = ["torch==2.13.0"]

TEST = TORCH + [
    "pytest==9.0.3",
    "transformers==5.24.0",
    "sentencepiece==0.2.3",
    # the Colab notebook is executed by the test suite (tests/test_notebook.py)
    "nbclient==0.11.0",
    "nbformat==5.11.1",
    "ipykernel==7.4.0",
    # Not listed: z-lab's reference DFlash package, which tests/test_dflash_interop.py
    # loads our exports with. dflash==0.1.0 pins tqdm==4.70.0 (we pin 4.70.1),
    # datasets and requests, and its [local] extra transformers==5.15.0 (we need 5.24),
    # so pip cannot resolve it beside ours; its model code (torch + transformers only)
    # runs on our versions. README's test command installs it on its own with
    # `pip install --no-deps dflash==0.1.0`; without it those tests skip.
]

setup(
    name="dblast_jax",
    version="0.1.0",
    description="Dependent block drafting (DBlast) for stochastic speculative decoding in JAX",
    packages=find_packages(include=["dblast_jax", "dblast_jax.*"]),
    python_requires=">=3.11",
    install_requires=CORE,
    extras_require={
        "test": TEST,
        "torch": TORCH,
        "tpu": ["jax[tpu]==0.10.2"],
        "cuda12": ["jax[cuda12]==0.10.2"],
    },
    entry_points={"console_scripts": ["dblast=dblast_jax.cli:main"]},
)
