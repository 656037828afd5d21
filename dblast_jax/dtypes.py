"""Dtype names (as configs, flags and files spell them) -> numpy / JAX dtypes.

`dtype_from_name("bfloat16")` is the dtype object that `jnp.dtype("bfloat16")` is
(ml_dtypes' bfloat16); every JAX and numpy function that takes a dtype takes it. Only
numpy and ml_dtypes are imported, so configs can use the names without importing JAX.
"""

from __future__ import annotations

from typing import Sequence

import ml_dtypes
import numpy as np

__all__ = ["PARAM_DTYPES", "dtype_from_name"]

# Parameter dtypes a drafter or target may be trained, loaded or exported in.
PARAM_DTYPES = ("float32", "bfloat16")

_BY_NAME = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16),
            "float16": np.dtype(np.float16)}


def dtype_from_name(name: str, choices: Sequence[str] = PARAM_DTYPES) -> np.dtype:
    """The dtype called `name`, one of `choices` (default PARAM_DTYPES); ValueError
    listing the choices for any other name."""
    if name not in choices or name not in _BY_NAME:
        raise ValueError(f"unknown dtype {name!r}: expected one of {', '.join(choices)}")
    return _BY_NAME[name]
