"""dblast_jax: dependent block drafting for stochastic speculative decoding, in JAX."""

from setuptools import find_packages, setup

# Compatible ranges: the lower bound is the version CI tests (constraints.txt pins them
# all: `pip install -e . -c constraints.txt`), the upper bound the next release that may
# break us (the next minor of a 0.x package, else the next major). A preinstalled jax /
# numpy inside the range (Colab) is kept instead of being replaced.
CORE = [
    "jax>=0.10.2,<0.11",
    "jaxlib>=0.10.2,<0.11",
    "flax>=0.12.8,<0.13",
    "optax>=0.2.8,<0.3",
    "orbax-checkpoint>=0.12.8,<0.13",
    "etils[epath]>=1.15.0,<2",  # dblast_jax.io.paths: local or gs:// workdirs and exports
    "grain>=0.2.18,<0.3",
    "tensorflow-datasets>=4.9.10,<5",
    "chex>=0.1.92,<0.2",
    "absl-py>=2.5.1,<3",
    "safetensors>=0.8.0,<0.9",
    "gguf>=0.19.0,<0.20",
    "tokenizers>=0.23.3,<0.24",
    "jinja2>=3.1.6,<4",
    "numpy>=2.4.6,<3",
    "tqdm>=4.70.1,<5",
    "matplotlib>=3.11.2,<4",
    "tensorboardX>=2.6.5,<3",  # live metrics (event files without TensorFlow)
]

TORCH = ["torch==2.13.0"]

TEST = TORCH + [
    "pytest>=9.0.3,<10",
    # two test workers (README: `-n 2 --dist loadfile`) keep the suite near 20 minutes
    "pytest-xdist>=3.8.0,<4",
    "transformers>=5.24.0,<6",
    "sentencepiece>=0.2.3,<0.3",
    # the Colab notebook is executed by the test suite (tests/test_notebook.py)
    "nbclient>=0.11.0,<0.12",
    "nbformat>=5.11.1,<6",
    "ipykernel>=7.4.0,<8",
    # Not listed: z-lab's reference DFlash package, which tests/test_dflash_interop.py
    # loads our exports with. dflash==0.1.0 pins tqdm==4.70.0 (we need >=4.70.1),
    # datasets and requests, and its [local] extra transformers==5.15.0 (we need 5.24),
    # so pip cannot resolve it beside ours; its model code (torch + transformers only)
    # runs on our versions. README's test command installs it on its own with
    # `pip install --no-deps dflash==0.1.0`; without it those tests skip.
]

PRETRAINED_PACKAGE = "dblast_jax.pretrained_drafters"

setup(
    name="dblast_jax",
    version="0.1.0",
    description="Dependent block drafting (DBlast) for stochastic speculative decoding in JAX",
    # the drafters shipped in the repository's pretrained/ (sha256 manifest) travel in the
    # wheel as package data, so a non-editable install has them too (pretrained.py)
    packages=find_packages(include=["dblast_jax", "dblast_jax.*"]) + [PRETRAINED_PACKAGE],
    package_dir={PRETRAINED_PACKAGE: "pretrained"},
    package_data={PRETRAINED_PACKAGE: ["manifest.json", "*/*/*"]},
    python_requires=">=3.11",
    install_requires=CORE,
    extras_require={
        "test": TEST,
        "torch": TORCH,
        "tpu": ["jax[tpu]>=0.10.2,<0.11"],
        "cuda12": ["jax[cuda12]>=0.10.2,<0.11"],
        # gs:// workdirs and exports (epath's gcsfs backend; google-cloud-storage, which
        # tensorboardX uploads event files with, comes with gcsfs)
        "gcs": ["etils[epath-gcs]>=1.15.0,<2"],
    },
    entry_points={"console_scripts": ["dblast=dblast_jax.cli:main"]},
)
