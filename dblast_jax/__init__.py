"""dblast_jax: dependent block drafting (DBlast) for stochastic speculative decoding.

    import dblast_jax as dj
    target = dj.load_target("smollm2-135m-instruct")
    result = dj.generate(target, ["Hello!"], dj.SamplingConfig(temperature=0.7))
"""

from dblast_jax.config import (DrafterConfig, DrafterSpec, RopeScaling, SamplingConfig,
                               TargetConfig)
from dblast_jax.generation import (Drafter, GenerationResult, Target, combined_drafter,
                                   drafter_from_spec, export_drafter, generate, init_drafter,
                                   load_drafter, load_target, ngram_drafter, on_mesh,
                                   parse_mesh, speculative_generate, with_block_size,
                                   with_draft_vocab)
from dblast_jax.demo import DemoConfig, run_demo

__all__ = [
    "DemoConfig",
    "Drafter",
    "DrafterConfig",
    "DrafterSpec",
    "combined_drafter",
    "drafter_from_spec",
    "export_drafter",
    "init_drafter",
    "load_drafter",
    "ngram_drafter",
    "speculative_generate",
    "GenerationResult",
    "RopeScaling",
    "SamplingConfig",
    "Target",
    "TargetConfig",
    "generate",
    "load_target",
    "on_mesh",
    "parse_mesh",
    "run_demo",
    "with_block_size",
    "with_draft_vocab",
]

__version__ = "0.1.0"
