"""dblast_jax: dependent block drafting (DBlast) for stochastic speculative decoding.

    import dblast_jax as dj
    target = dj.load_target("smollm2-135m-instruct")
    result = dj.generate(target, ["Hello!"], dj.SamplingConfig(temperature=0.7))
"""

from dblast_jax.config import DrafterConfig, RopeScaling, SamplingConfig, TargetConfig
from dblast_jax.generation import GenerationResult, Target, generate, load_target

__all__ = [
    "DrafterConfig",
    "GenerationResult",
    "RopeScaling",
    "SamplingConfig",
    "Target",
    "TargetConfig",
    "generate",
    "load_target",
]

__version__ = "0.1.0"
