"""The user-facing API: targets and drafters, plain and speculative text generation.

A `Target` bundles what every job needs about the large model: its config, parameters,
tokenizer (with chat template) and a name (`load_target`: a registry name, a Hugging Face
folder or a GGUF file). A `Drafter` is a drafter's config and parameters
(`drafter_from_spec`: a folder, a training workdir, `pretrained:NAME`, `random-kN`).
`generate` / `speculative_generate` handle text <-> tokens, batching and timing around
the jitted on-device loops (`sampler`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import time
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from dblast_jax import draft_vocab, pretrained, registry, sharding
from dblast_jax.config import (CombinedDrafterConfig, DrafterConfig, NgramConfig,
                               SamplingConfig, TargetConfig, trained_drafter_config)
from dblast_jax.distributed import mesh_shape
from dblast_jax.io import paths, presets
from dblast_jax.io.dflash import export_drafter as _export_dflash
from dblast_jax.io.dflash import load_dflash, read_draft_vocab
from dblast_jax.io.gguf import load_gguf
from dblast_jax.io.hf import load_hf
from dblast_jax.io.tokenizer import Tokenizer
from dblast_jax.models import drafter as drafter_lm
from dblast_jax.sampler import (PAD_ID, cache_size_for, generate_tokens, pad_prompts,
                                speculative_generate_tokens)

Prompt = Union[str, Sequence[int], Sequence[dict]]

# the registry's random-weight models of before: name -> TargetConfig constructor
TINY_PRESETS = {name: getattr(TargetConfig, entry.config)
                for name, entry in registry.models_of_kind("random").items()}


@dataclasses.dataclass
class Target:
    config: TargetConfig
    params: Any
    tokenizer: Any = None  # dblast_jax.io.tokenizer.Tokenizer or None for token-only models
    name: str = "target"

    @property
    def stop_ids(self) -> tuple[int, ...]:
        if self.tokenizer is not None:
            return tuple(self.tokenizer.stop_ids)
        return tuple(self.config.eos_token_ids)


def load_target(path_or_preset: str, dtype=jnp.float32, seed: int = 0) -> Target:
    """Load a target by preset name, Hugging Face folder, or GGUF file.

    Presets: `smollm2-135m-instruct` (the pinned GGUF; never downloaded silently),
    `tiny-llama` / `tiny-qwen3` (random weights, no tokenizer; for tests), `tiny-smollm2`
    (random tiny weights with SmolLM2's tokenizer and chat template: text at test speed).
    """
    name = str(path_or_preset)
    if name in registry.MODELS:
        config, params, tokenizer = presets.load_model(name, dtype, seed)
        return Target(config, params, tokenizer, name)
    path = Path(os.path.expanduser(name))
    if path.is_file() and path.suffix == ".gguf":
        config, params, metadata = load_gguf(path, dtype=dtype)
        return Target(config, params, Tokenizer.from_gguf_metadata(metadata), path.stem)
    if path.is_dir():
        config, params = load_hf(path, dtype=dtype)
        tokenizer = Tokenizer.from_file(path) if (path / "tokenizer.json").exists() else None
        return Target(config, params, tokenizer, path.name)
    check_target_source(name)
    raise AssertionError("unreachable: check_target_source accepted " + repr(name))


def check_target_source(path_or_preset: str) -> None:
    """Raise load_target's FileNotFoundError for a name that is no preset, .gguf file or
    folder, without loading anything: commands check it before slower work (reading or
    fetching prompt pools), so a mistyped --model fails first."""
    name = str(path_or_preset)
    path = Path(os.path.expanduser(name))
    if name in registry.MODELS or (path.is_file() and path.suffix == ".gguf") or path.is_dir():
        return
    known = sorted(registry.MODELS)
    raise FileNotFoundError(
        f"{name!r} is neither a known preset ({', '.join(known)}), a Hugging Face folder "
        "(config.json + *.safetensors) nor a .gguf file")


def encode_prompts(target: Target, prompts: Sequence[Prompt], chat: bool = True,
                   system: Optional[str] = None) -> list[list[int]]:
    """Strings (chat-templated unless `chat=False`), message lists, or token-id lists."""
    encoded = []
    for prompt in prompts:
        if isinstance(prompt, str):
            if target.tokenizer is None:
                raise ValueError(f"target {target.name!r} has no tokenizer; pass token ids")
            if chat:
                messages = ([{"role": "system", "content": system}] if system else [])
                messages.append({"role": "user", "content": prompt})
                encoded.append(target.tokenizer.encode_chat(messages))
            else:
                encoded.append(target.tokenizer.encode(prompt))
        elif prompt and isinstance(prompt[0], dict):
            if target.tokenizer is None:
                raise ValueError(f"target {target.name!r} has no tokenizer; pass token ids")
            encoded.append(target.tokenizer.encode_chat(list(prompt)))
        else:
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < target.config.vocab_size]
            if bad:
                raise ValueError(f"token ids {bad[:5]} outside the vocabulary "
                                 f"[0, {target.config.vocab_size})")
            encoded.append(ids)
    return encoded


@dataclasses.dataclass
class GenerationResult:
    tokens: list[list[int]]  # generated ids per prompt (stop token included if emitted)
    text: list[Optional[str]]
    timing: dict[str, float]
    stats: dict[str, Any] = dataclasses.field(default_factory=dict)


# ---- meshes ------------------------------------------------------------------------------

def parse_mesh(spec: Optional[str]):
    """'data,fsdp,tensor' (e.g. '2,2,2' or '-1,1,1') -> a Mesh over all devices (every
    host's, in a multi-process run); None or '' -> None (one device)."""
    shape = mesh_shape(spec)
    return None if shape is None else sharding.make_mesh(*shape)


def on_mesh(model: Union["Target", "Drafter"], mesh) -> Union["Target", "Drafter"]:
    """The same target or drafter with its parameters placed on `mesh` by the project's
    partition rules (fsdp / tensor axes); batches passed to `generate` /
    `speculative_generate` then go over the data axis. mesh None: returned unchanged."""
    if mesh is None:
        return model
    rules = sharding.TARGET_RULES if isinstance(model, Target) else sharding.DRAFTER_RULES
    return dataclasses.replace(model, params=sharding.shard_params(model.params, mesh, rules))


def mesh_of(params: Any):
    """The mesh a parameter pytree is placed on (None: not on a multi-device mesh)."""
    leaf = jax.tree.leaves(params)[0] if jax.tree.leaves(params) else None
    mesh = getattr(getattr(leaf, "sharding", None), "mesh", None)
    return mesh if mesh is not None and getattr(mesh, "size", 1) > 1 else None


def _place_batch(mesh, *arrays):
    """Rows of each [B, ...] array on the mesh's data axis (replicated where B does not
    divide); unchanged without a mesh."""
    if mesh is None:
        return arrays
    return tuple(jax.device_put(a, sharding.batch_sharding(mesh, a.shape)) for a in arrays)


def _trim(out: np.ndarray, counts: np.ndarray) -> list[list[int]]:
    return [[int(t) for t in row[:n] if t != PAD_ID] for row, n in zip(out, counts)]


def decode_outputs(target: Target, tokens: list[list[int]]) -> list[Optional[str]]:
    if target.tokenizer is None:
        return [None] * len(tokens)
    stops = set(target.stop_ids)
    return [target.tokenizer.decode([t for t in row if t not in stops]) for row in tokens]


def _prepare(target: Target, prompts: Sequence[Prompt], sampling: SamplingConfig, rng,
             chat: bool, extra_cache: int = 0):
    """Shared by both generators: keys, default stop tokens, padded prompts, cache size."""
    if isinstance(rng, int):
        rng = jax.random.key(rng)
    if not sampling.stop_tokens:
        sampling = sampling.replace(stop_tokens=target.stop_ids)
    ids = encode_prompts(target, prompts, chat=chat)
    tokens, lengths = pad_prompts(ids, multiple=prompt_bucket(max(map(len, ids), default=1)))
    cache_size = cache_size_for(tokens.shape[1], sampling.max_new_tokens, extra=extra_cache)
    limit = target.config.max_position_embeddings
    if cache_size > limit:
        raise ValueError(f"prompt ({tokens.shape[1]} tokens, padded) + max_new_tokens "
                         f"({sampling.max_new_tokens}) exceed the model's context of {limit}")
    return rng, sampling, tokens, lengths, cache_size


def prompt_bucket(width: int) -> int:
    """Padding multiple for a batch whose longest prompt has `width` tokens: coarse
    buckets keep the number of compiled shapes small over a benchmark of varied prompt
    lengths (right padding is free for correctness: rows carry their own lengths)."""
    return 16 if width <= 64 else 64 if width <= 512 else 256


# Executables compiled ahead of time by `warmup`, keyed by the jitted function, its static
# arguments and every argument leaf's shape, dtype and sharding: an evaluation over many
# prompts compiles each shape once, and a timed call runs the executable directly.
_COMPILED: dict = {}


def _leaf_key(x: Any) -> tuple:
    return (tuple(x.shape), str(x.dtype), str(getattr(x, "sharding", None)))


def _timed(fn, args: tuple, static: dict, warmup: bool):
    """Run the jitted `fn(*args, **static)`; outputs as numpy, and a timing dict.

    With `warmup` the call is compiled ahead of time (`lower().compile()`, no execution:
    a new shape costs one compile instead of one compile plus a whole extra generation)
    and `seconds` times the compiled executable alone. Without it `seconds` includes
    whatever compilation the call needs."""
    compile_s = 0.0
    if warmup:
        leaves, tree = jax.tree.flatten(args)
        key = (fn, tuple(sorted(static.items())), tree, tuple(map(_leaf_key, leaves)))
        run = _COMPILED.get(key)
        if run is None:
            t0 = time.perf_counter()
            run = _COMPILED[key] = fn.lower(*args, **static).compile()
            compile_s = time.perf_counter() - t0
    else:
        run = functools.partial(fn, **static)
    t0 = time.perf_counter()
    outputs = jax.block_until_ready(run(*args))
    seconds = time.perf_counter() - t0
    outputs = [np.asarray(x) for x in outputs]
    new_tokens = int(outputs[1].sum())
    timing = {"seconds": seconds, "new_tokens": new_tokens,
              "tokens_per_s": new_tokens / max(seconds, 1e-9), "warmup_seconds": compile_s}
    return outputs, timing


def generate(target: Target, prompts: Sequence[Prompt], sampling: SamplingConfig = SamplingConfig(),
             rng: jax.Array | int = 0, chat: bool = True, warmup: bool = False) -> GenerationResult:
    """Plain sampling from the target. `timing` separates compile from generation.

    With `warmup=True` the call is compiled first (once per set of shapes in this process, without
    running it), so `timing['seconds']` measures generation alone
    (what benchmarks want). A target placed on a mesh (`on_mesh`) generates there, the
    batch split over the data axis; the tokens equal a one-device run's.
    """
    rng, sampling, tokens, lengths, cache_size = _prepare(target, prompts, sampling, rng, chat)
    tokens, lengths = _place_batch(mesh_of(target.params), tokens, lengths)
    (out, counts), timing = _timed(
        generate_tokens, (target.params, tokens, lengths, rng),
        dict(config=target.config, sampling=sampling, cache_size=cache_size), warmup)
    toks = _trim(out, counts)
    return GenerationResult(toks, decode_outputs(target, toks), timing)


# ---- speculative decoding ------------------------------------------------------------------

@dataclasses.dataclass
class Drafter:
    config: Any  # DrafterConfig, NgramConfig or CombinedDrafterConfig
    params: Any  # the trained drafter's parameters ({} for n-gram drafting)
    name: str = "drafter"
    # SamplingConfig fields this drafter is evaluated with (e.g. verify_mode, Z_T)
    sampling_overrides: dict = dataclasses.field(default_factory=dict)
    # a spec's `@block=N` (with_block_size): recorded beside the sampling overrides
    block_override: Optional[int] = None
    # a spec's n-gram settings (`@n=3,min_n=2`, `@match=3`): recorded beside them too
    ngram_settings: dict = dataclasses.field(default_factory=dict)
    # response-token counts [V] of the training corpus (FOLDER/token_counts.npy): the
    # ranking a draft-time vocabulary takes its ids from (None: not shipped with it)
    token_counts: Optional[np.ndarray] = dataclasses.field(default=None, repr=False)
    # N of the draft-time vocabulary in `params` (with_draft_vocab), None: the full head
    draft_vocab: Optional[int] = None


def init_drafter(target: Target, drafter_config, rng: jax.Array | int = 0,
                 dtype=jnp.float32) -> Drafter:
    """A randomly initialised drafter for `target` (shares its embedding and LM head)."""
    if isinstance(rng, int):
        rng = jax.random.key(rng)
    params = drafter_lm.init_drafter_params(drafter_config, target.config, rng, dtype)
    return Drafter(drafter_config, params, drafter_config.name)


def load_drafter(path: str | os.PathLike, target: Target, dtype=jnp.float32) -> Drafter:
    """A DFlash / DBlast export folder (config.json + safetensors) for `target`. An
    export made with a draft-time vocabulary (vLLM's `draft_vocab_size` / `d2t`) drafts
    over it, as vLLM would; its token_counts.npy, if any, is kept for `with_draft_vocab`."""
    config, params = load_dflash(path, target.config, dtype)
    counts = draft_vocab.load_counts(path, target.config.vocab_size) if paths.is_local(
        os.fspath(path)) else None
    drafter = Drafter(config, params, Path(path).name, token_counts=counts)
    ids = read_draft_vocab(os.fspath(path), target.config.vocab_size)
    if ids is None:
        return drafter
    return dataclasses.replace(drafter, params=draft_vocab.attach(params, target.params, ids,
                                                                  target.config),
                               draft_vocab=int(ids.shape[0]))


def with_draft_vocab(drafter: Drafter, target: Target, size: int) -> Drafter:
    """`drafter` drafting over the `size` most frequent response tokens of its training
    corpus (dblast_jax/draft_vocab.py: cheaper steps, the same exact output, some
    acceptance lost). The ranking: the drafter's token_counts.npy, else the order of the
    draft vocabulary its export carries (then `size` may not exceed it)."""
    if trained_drafter_config(drafter.config) is None:
        raise ValueError(f"drafter {drafter.name!r}: draft_vocab sets a trained drafter's "
                         "LM head; n-gram drafting has none")
    vocab = target.config.vocab_size
    size = draft_vocab.check_size(size, vocab, where=f"drafter {drafter.name!r}: draft_vocab")
    _, carried = draft_vocab.split(drafter.params)
    if drafter.token_counts is not None:
        ids = draft_vocab.ids_from_counts(drafter.token_counts, size)
    elif carried is not None:
        have = int(carried["ids"].shape[0])
        if size > have:
            raise ValueError(f"drafter {drafter.name!r}: draft_vocab={size} exceeds the "
                             f"{have}-token draft vocabulary its export carries (and it has "
                             f"no {draft_vocab.COUNTS_FILE} to rank the rest)")
        ids = np.asarray(carried["ids"])[:size]
    else:
        raise ValueError(f"drafter {drafter.name!r}: draft_vocab={size} needs the "
                         "response-token counts of its training corpus "
                         f"({draft_vocab.COUNTS_FILE} beside its weights); write them with "
                         "`dblast export SOURCE --out FOLDER --token-counts-from CORPUS`")
    params = draft_vocab.attach(drafter.params, target.params, ids, target.config)
    return dataclasses.replace(drafter, params=params, draft_vocab=size)


NGRAM_SPEC = "ngram"


def ngram_drafter(block_size: int = 8, max_n: int = 4, min_n: int = 2) -> Drafter:
    """Prompt-lookup drafting (no parameters): `block_size - 1` drafts copied from the
    text after the latest earlier occurrence of its longest max_n..min_n-token suffix."""
    config = NgramConfig(block_size=block_size, max_n=max_n, min_n=min_n)
    return Drafter(config, {}, NGRAM_SPEC)


def combined_drafter(trained: Drafter, min_match: int = 2, max_n: int = 4,
                     min_n: int = 2) -> Drafter:
    """`trained` plus the n-gram proposal: per step and row the n-gram drafts where the
    text's suffix matched at least `min_match` tokens, else the trained drafter's."""
    base = trained_drafter_config(trained.config)
    if base is None or base is not trained.config:
        raise ValueError(f"drafter {trained.name!r} is not a trained drafter; combine a "
                         "trained drafter with the n-gram proposal")
    config = CombinedDrafterConfig(base, NgramConfig(base.block_size, max_n, min_n),
                                   min_match=min_match)
    return dataclasses.replace(trained, config=config, name=f"{trained.name}+{NGRAM_SPEC}")


def drafter_from_spec(spec: str, target: Target, dtype=jnp.float32) -> Drafter:
    """A drafter folder, a training workdir (its latest checkpoint), `pretrained:NAME` (a
    drafter shipped in the repository, checked by sha256), `random` / `random-kN`
    (untrained: shows the overhead floor), `ngram` (prompt lookup, no parameters), or any
    of the trained ones followed by `+ngram` (the combined drafter)."""
    if spec == NGRAM_SPEC:
        return ngram_drafter()
    if spec.endswith("+" + NGRAM_SPEC) and len(spec) > len(NGRAM_SPEC) + 1:
        return combined_drafter(drafter_from_spec(spec[:-len(NGRAM_SPEC) - 1], target, dtype))
    if pretrained.is_pretrained_spec(spec):
        name = spec[len(pretrained.PREFIX):]
        # a preset-loaded target must be the one the drafter was trained for; a target
        # loaded from a file path is checked by shape when the weights load
        known = target.name in registry.MODELS
        folder = pretrained.pretrained_folder(name, target=target.name if known else None)
        drafter = load_drafter(folder, target, dtype)
        drafter.name = name
        return drafter
    if re.fullmatch(r"random(-k[1-9][0-9]*)?", spec):  # not a folder named random_...
        k = int(spec.split("-k")[1]) if "-k" in spec else 1
        config = DrafterConfig.for_target(target.config, num_layers=1, block_size=8,
                                          num_categories=k)
        drafter = init_drafter(target, config, 0, dtype)
        drafter.name = spec
        return drafter
    if (os.path.isfile(os.path.join(spec, "train_config.json"))
            and not os.path.isfile(os.path.join(spec, "config.json"))):
        return load_workdir_drafter(spec, target, dtype)
    return load_drafter(spec, target, dtype)


def load_workdir_drafter(workdir: str | os.PathLike, target: Target,
                         dtype=jnp.float32) -> Drafter:
    """The drafter of a training workdir's latest checkpoint (read onto one device,
    whatever mesh it was trained on; no training data needed) for `target`."""
    from dblast_jax.train.restore import restore_drafter  # startup: train pulls grain, orbax
    restored = restore_drafter(os.fspath(workdir), mesh=sharding.make_mesh(1, 1, 1),
                               log=lambda s: None)
    drafter_lm.check_drafter_fits_target(restored.drafter_config, target.config)
    params = jax.tree.map(lambda x: jnp.asarray(x, dtype), restored.params_host())
    return Drafter(restored.drafter_config, params, Path(os.path.abspath(workdir)).name)


# sampling settings a drafter spec may fix for itself (evaluation ablations): the key
# after '@' in NAME=FOLDER@key=value,... and the SamplingConfig field it sets
SPEC_SAMPLING_KEYS = {"verify_mode": "verify_mode", "mode": "verify_mode",
                      "category_temperature": "category_temperature",
                      "zt": "category_temperature", "z_t": "category_temperature",
                      "draft_temperature": "draft_temperature"}
# drafter settings a spec may fix (NAME=FOLDER@block=4): drafting fewer tokens per step
# than the drafter was trained for. A step then verifies a shorter block, which is cheaper
# on a compute-bound CPU (RESULTS.md 4.8); the drafter has no per-position parameters, so
# only the block's length changes, and verification stays exact.
SPEC_DRAFTER_KEYS = {"block": "block_size", "block_size": "block_size"}
# NAME=FOLDER@draft_vocab=8192: draft over the 8,192 most frequent response tokens of the
# drafter's training corpus (with_draft_vocab; exact, cheaper steps, fewer acceptances)
SPEC_DRAFT_VOCAB_KEYS = {"draft_vocab": "draft_vocab", "vocab": "draft_vocab"}
# n-gram settings (NAME=ngram@n=4,k=7, NAME=FOLDER+ngram@match=3): the longest and shortest
# suffix matched, the number of drafts (k = block - 1), the combined drafter's minimum
# match for taking the n-gram drafts
SPEC_NGRAM_KEYS = {"n": "max_n", "max_n": "max_n", "min_n": "min_n", "k": "num_drafts",
                   "match": "min_match", "min_match": "min_match"}
_INT_SETTING_MIN = {"block_size": 2, "max_n": 1, "min_n": 1, "num_drafts": 1,
                    "min_match": 1, "draft_vocab": 1}


def parse_drafter_spec(spec: str) -> tuple[str, str, dict]:
    """'NAME=FOLDER[@key=value,...]' -> (name, folder, SamplingConfig overrides).

    The overrides let one trained drafter appear several times in an evaluation with its
    own verification mode or category temperature Z_T (`k4_mix=DIR@mode=mixture`,
    `k4_zt05=DIR@zt=0.5`)."""
    name, _, rest = spec.partition("=")
    path, _, settings = rest.partition("@")
    if not name or not path:
        raise ValueError(f"drafter {spec!r}: expected NAME=FOLDER[@key=value,...] "
                         "(or NAME=random-kN)")
    overrides: dict = {}
    is_ngram = path == NGRAM_SPEC or path.endswith("+" + NGRAM_SPEC)
    keys = {**SPEC_SAMPLING_KEYS, **SPEC_DRAFTER_KEYS, **SPEC_DRAFT_VOCAB_KEYS,
            **(SPEC_NGRAM_KEYS if is_ngram else {})}
    for item in filter(None, (x.strip() for x in settings.split(","))):
        key, eq, value = item.partition("=")
        field = keys.get(key.strip())
        if not eq or field is None:
            ngram_note = "" if is_ngram else f" (n-gram keys {sorted(SPEC_NGRAM_KEYS)} " \
                "apply to ngram and FOLDER+ngram)"
            raise ValueError(f"drafter {spec!r}: setting {item!r} must be key=value with key "
                             f"in {sorted(keys)}{ngram_note}")
        if field in _INT_SETTING_MIN:
            low = _INT_SETTING_MIN[field]
            if not re.fullmatch(r"[0-9]+", value.strip()) or int(value) < low:
                raise ValueError(f"drafter {spec!r}: {key.strip()} must be an integer >= "
                                 f"{low}, got {value.strip()!r}")
            overrides[field] = int(value)
        else:
            overrides[field] = value.strip() if field == "verify_mode" else float(value)
    if "num_drafts" in overrides:  # k drafts = a block of k + 1
        k = overrides.pop("num_drafts")
        if overrides.setdefault("block_size", k + 1) != k + 1:
            raise ValueError(f"drafter {spec!r}: k={k} and block={overrides['block_size']} "
                             "disagree (block = k + 1)")
    sampling = {k: v for k, v in overrides.items() if k not in DRAFTER_SETTINGS}
    if sampling:
        SamplingConfig(**sampling)  # validates mode names and temperature ranges now
    return name, path, overrides


# the spec settings that shape the drafter rather than the sampling
DRAFTER_SETTINGS = ("block_size", "max_n", "min_n", "min_match", "draft_vocab")


def with_ngram_settings(drafter: Drafter, settings: dict) -> Drafter:
    """`drafter` (n-gram or combined) with a spec's max_n / min_n / min_match."""
    config = drafter.config
    ngram_keys = {k: settings[k] for k in ("max_n", "min_n") if k in settings}
    if isinstance(config, NgramConfig):
        if "min_match" in settings:
            raise ValueError(f"drafter {drafter.name!r}: match= applies to a combined "
                             "drafter (FOLDER+ngram), not to ngram alone (use min_n)")
        return dataclasses.replace(drafter, config=config.replace(**ngram_keys))
    if isinstance(config, CombinedDrafterConfig):
        changes: dict = {"ngram": config.ngram.replace(**ngram_keys)} if ngram_keys else {}
        if "min_match" in settings:
            changes["min_match"] = settings["min_match"]
        return dataclasses.replace(drafter, config=config.replace(**changes))
    if ngram_keys or "min_match" in settings:
        raise ValueError(f"drafter {drafter.name!r}: n-gram settings need an ngram or "
                         "FOLDER+ngram drafter")
    return drafter


def with_block_size(drafter: Drafter, block_size: int) -> Drafter:
    """`drafter` drafting `block_size - 1` tokens per step instead of its trained block's
    (a shorter block only: a longer one would draft positions it never learned; n-gram
    drafting, which learned nothing, takes any block >= 2)."""
    if isinstance(drafter.config, NgramConfig):
        if block_size < 2:
            raise ValueError(f"drafter {drafter.name!r}: block {block_size} must be >= 2")
        return dataclasses.replace(drafter, config=drafter.config.replace(
            block_size=block_size), block_override=block_size)
    trained = drafter.config.block_size
    if not 2 <= block_size <= trained:
        raise ValueError(f"drafter {drafter.name!r}: block {block_size} must lie in "
                         f"[2, {trained}] (it was trained with blocks of {trained})")
    return dataclasses.replace(drafter, config=drafter.config.replace(block_size=block_size),
                               block_override=block_size)


def named_drafters(specs: Sequence[str], target: Target, dtype=jnp.float32) -> dict:
    """["NAME=FOLDER[@key=value,...]" | "NAME=random-kN", ...] -> {name: Drafter}
    (evaluation inputs). A folder named twice is loaded once; each name keeps its own
    sampling overrides in `Drafter.sampling_overrides`."""
    drafters: dict = {}
    loaded: dict = {}
    for spec in specs:
        name, path, overrides = parse_drafter_spec(spec)
        if name in drafters:
            raise ValueError(f"drafter name {name!r} given twice")
        if path not in loaded:
            loaded[path] = drafter_from_spec(path, target, dtype)
        block = overrides.pop("block_size", None)
        vocab = overrides.pop("draft_vocab", None)
        ngram_settings = {k: overrides.pop(k) for k in DRAFTER_SETTINGS if k in overrides}
        drafter = dataclasses.replace(loaded[path], name=name, sampling_overrides=overrides)
        drafter = with_ngram_settings(drafter, ngram_settings)
        drafter.ngram_settings = ngram_settings
        if vocab is not None:
            drafter = with_draft_vocab(drafter, target, vocab)
        drafters[name] = drafter if block is None else with_block_size(drafter, block)
    return drafters


def block_variants(drafters: dict, blocks: Sequence[int]) -> tuple[dict, dict]:
    """Each drafter also at each of `blocks` (named NAME_blockN; a trained drafter only at
    blocks up to its own, n-gram drafting at any), for `dblast eval --blocks`: returns the
    widened {name: Drafter} and the families {NAME: {block: name}} whose best block the
    evaluation reports."""
    out: dict = {}
    families: dict = {}
    for name, drafter in drafters.items():
        own = drafter.config.block_size
        family = {own: name}
        out[name] = drafter
        for block in sorted(set(int(b) for b in blocks)):
            if block < 2:
                raise ValueError(f"--blocks: a block must be >= 2 (the anchor and one "
                                 f"draft), got {block}")
            fits = isinstance(drafter.config, NgramConfig) or block <= own
            if block == own or not fits:
                continue
            variant = f"{name}_block{block}"
            if variant in drafters:
                raise ValueError(f"--blocks: {variant!r} is already a drafter name")
            out[variant] = with_block_size(dataclasses.replace(drafter, name=variant), block)
            family[block] = variant
        families[name] = dict(sorted(family.items()))
    return out, families


def export_drafter(drafter: Drafter, path: str | os.PathLike, format: str = "dflash",
                   dtype: str = "float32", *, force: bool = False) -> Path:
    """Write `drafter` as a DFlash folder at `path` (see io.dflash.export_drafter): into
    an absent or empty folder or over a previous export; any other folder is refused
    unless `force`, which replaces only the files export writes. Non-finite parameters
    are refused."""
    if format != "dflash":
        raise ValueError(f"unsupported export format {format!r}; supported: dflash")
    return _export_dflash(drafter.params, drafter.config, path, dtype=dtype, force=force,
                          token_counts=drafter.token_counts)


def acceptance_stats(accepted: np.ndarray, expected: np.ndarray, block_size: int) -> dict:
    """Summaries of per-step accepted counts ([B, steps], -1 = no step).

    tau = mean(accepted + 1) per step (the bonus/residual token included, max = b);
    per-position acceptance = P(draft i accepted | drafts 1..i-1 accepted).
    """
    valid = accepted >= 0
    acc = accepted[valid]
    exp = expected[valid]
    hist = np.bincount(acc, minlength=block_size)[:block_size] if acc.size else np.zeros(
        block_size, int)
    reached = np.array([(acc >= i - 1).sum() for i in range(1, block_size)])
    passed = np.array([(acc >= i).sum() for i in range(1, block_size)])
    per_position = np.where(reached > 0, passed / np.maximum(reached, 1), np.nan)
    return {
        "steps": int(acc.size),
        "tau": float(acc.mean() + 1) if acc.size else float("nan"),
        "tau_expected": float(exp.mean() + 1) if acc.size else float("nan"),
        "accepted_mean": float(acc.mean()) if acc.size else float("nan"),
        "accepted_stderr": float(acc.std() / np.sqrt(acc.size)) if acc.size > 1 else 0.0,
        "expected_accepted_mean": float(exp.mean()) if acc.size else float("nan"),
        "histogram": hist.tolist(),
        "per_position_acceptance": [None if np.isnan(x) else float(x) for x in per_position],
    }


def speculative_generate(target: Target, drafter: Drafter, prompts: Sequence[Prompt],
                         sampling: SamplingConfig = SamplingConfig(),
                         rng: jax.Array | int = 0, chat: bool = True,
                         warmup: bool = False) -> GenerationResult:
    """Speculative sampling: same output distribution as `generate`, fewer target passes.

    `stats` holds tau (empirical and expected), the accepted-count histogram and the
    per-position acceptance rates. Target and drafter placed on one mesh (`on_mesh`)
    decode there, the batch split over the data axis.
    """
    trained = trained_drafter_config(drafter.config)
    if trained is not None:
        drafter_lm.check_drafter_fits_target(trained, target.config)
    rng, sampling, tokens, lengths, cache_size = _prepare(
        target, prompts, sampling, rng, chat, extra_cache=drafter.config.block_size)
    mesh, dmesh = mesh_of(target.params), mesh_of(drafter.params)
    if mesh is not None and dmesh is not None and dmesh != mesh:
        raise ValueError("target and drafter are placed on different meshes; place both "
                         "with on_mesh(..., mesh) on the same mesh")
    mesh = mesh or dmesh
    if mesh is not None:  # the other one follows (placed once per call; place both ahead
        target = target if mesh_of(target.params) else on_mesh(target, mesh)  # to reuse)
        drafter = drafter if mesh_of(drafter.params) else on_mesh(drafter, mesh)
    tokens, lengths = _place_batch(mesh, tokens, lengths)
    (out, counts, accepted, expected), timing = _timed(
        speculative_generate_tokens, (target.params, drafter.params, tokens, lengths, rng),
        dict(target_config=target.config, drafter_config=drafter.config, sampling=sampling,
             cache_size=cache_size), warmup)
    toks = _trim(out, counts)
    stats = acceptance_stats(accepted, expected, drafter.config.block_size)
    return GenerationResult(toks, decode_outputs(target, toks), timing, stats)
