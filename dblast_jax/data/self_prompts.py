"""Training prompts the target writes itself: new user queries, sampled from its chat template.

Why: a drafter is trained on target-written answers, and the answers are only as varied
as the prompts behind them. A user's own prompt pool may be small, and this project's
pinned pools are used up (~2,300 prompts). An instruct model given its chat template up
to the start of a user turn writes a plausible user query (the "Magpie" observation), so
the target can supply as many distinct prompts as we sample, in its own domain, at the
cost of a short generation each (~1.4 s per kept query for SmolLM2-135M on one CPU core).

The queries are kept only when the target ended them itself (a stop token before the
length limit), they hold no special token, they are new (normalised text, `dedup`), and
they overlap no known prompt (evaluation sets and training pools: the held-out prompts
come from the pools). The folder holds `prompts.jsonl` (one {"id", "source", "turns"}
per line, what `dblast data regenerate --prompts-file` answers) and `state.json` (the
settings and counts); it is rewritten atomically after every batch, so a killed run
resumes where it stopped and a finished one is extended by asking for a larger count.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Callable, Optional, Sequence

import jax
import numpy as np

from dblast_jax.data import dedup
from dblast_jax.data.sources import Prompt
from dblast_jax.io.atomic import atomic_write_json, atomic_write_text

__all__ = ["SelfPromptConfig", "pre_query_tokens", "sample_self_prompts", "read_prompt_file",
           "SOURCE"]

SOURCE = "self"  # the Prompt.source of a query the target wrote
FORMAT = "dblast-self-prompts-v1"
_SENTINEL = "QUERYSENTINEL7731"

# sample_batch(key, batch_size) -> (tokens [B, max_query_tokens] int, num_generated [B] int)
BatchSampler = Callable[[jax.Array, int], tuple[np.ndarray, np.ndarray]]


@dataclasses.dataclass(frozen=True)
class SelfPromptConfig:
    """What a self-prompt folder was sampled with; a resume must ask for the same."""

    seed: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    max_query_tokens: int = 128
    batch_size: int = 16
    system: Optional[str] = None

    def __post_init__(self):
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 (greedy writes one query), got "
                             f"{self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        for name in ("max_query_tokens", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def pre_query_tokens(tokenizer, system: Optional[str] = None) -> list[int]:
    """The chat template's ids up to where a user's first message starts.

    Found by rendering a conversation whose message is a sentinel and cutting at it; a
    template that does not put the message after a fixed prefix is refused."""
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": _SENTINEL}]
    text = tokenizer.apply_chat_template(messages, False, False)
    if _SENTINEL not in text:
        raise ValueError("the target's chat template does not render the user message "
                         "verbatim; it cannot be asked to write a user query")
    prefix = text[: text.index(_SENTINEL)]
    ids = tokenizer.encode(prefix)
    full = tokenizer.encode(text)
    if not ids or list(full[: len(ids)]) != list(ids):
        raise ValueError("the chat template's text before the user message does not "
                         "tokenize as a prefix of the whole conversation; cannot sample "
                         "user queries from it")
    return [int(t) for t in ids]


def read_prompt_file(path) -> list[Prompt]:
    """Text prompts from a JSONL file: one {"turns": [str, ...]} or {"prompt": str} per
    line, with an optional "id" (default: the line number) and "source" (default: the
    file's stem). Bad lines are refused with their line number."""
    path = Path(path)
    if path.is_dir():
        path = path / "prompts.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no prompt file at {path} (a JSONL file, or a "
                                "`dblast data self-prompts` folder)")
    prompts = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").split("\n"), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict) or ("turns" in row) == ("prompt" in row):
            raise ValueError(f"{where}: expected an object with 'turns' (a list of user "
                             "messages) or 'prompt' (one message)")
        turns = row["turns"] if "turns" in row else [row["prompt"]]
        if isinstance(turns, str) or not isinstance(turns, list):
            raise ValueError(f"{where}: 'turns' must be a list of strings")
        try:
            prompts.append(Prompt(id=str(row.get("id", lineno)),
                                  source=str(row.get("source", path.stem)),
                                  turns=tuple(turns)))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


def target_batch_sampler(target, cfg: SelfPromptConfig) -> BatchSampler:
    """Batches of user queries from the target, prompted with its pre-query template."""
    import jax.numpy as jnp

    from dblast_jax import sampler
    from dblast_jax.config import SamplingConfig

    if target.tokenizer is None:
        raise ValueError("the target has no tokenizer: it has no chat template to write "
                         "user queries from")
    ids = pre_query_tokens(target.tokenizer, cfg.system)
    stops = tuple(int(t) for t in target.config.eos_token_ids) + _end_of_turn(target.tokenizer)
    sampling = SamplingConfig(temperature=cfg.temperature, top_p=cfg.top_p,
                              max_new_tokens=cfg.max_query_tokens, stop_tokens=stops)
    cache = 1 << math.ceil(math.log2(len(ids) + cfg.max_query_tokens + 1))

    def sample(key, batch):
        tokens = jnp.asarray([ids] * batch, jnp.int32)
        lengths = jnp.full((batch,), len(ids), jnp.int32)
        out, n = sampler.generate_tokens(target.params, tokens, lengths, key,
                                         config=target.config, sampling=sampling,
                                         cache_size=cache)
        return np.asarray(out), np.asarray(n)

    sample.stop_tokens = stops
    return sample


def _end_of_turn(tokenizer) -> tuple[int, ...]:
    """The id of the template's end-of-turn marker, when it is one token (ChatML's)."""
    for marker in ("<|im_end|>", "<|eot_id|>", "<|end|>"):
        ids = tokenizer.encode(marker)
        if len(ids) == 1:
            return (int(ids[0]),)
    return ()


def _known_prompts() -> list[Prompt]:
    """Every evaluation prompt and every pool prompt (the held-out prompts come from the
    pools): a query that repeats one is dropped."""
    from dblast_jax.data import sources
    return [p for n in list(sources.EVAL_SETS) + list(sources.TRAIN_POOLS)
            for p in sources.load_prompts(n)]


@dataclasses.dataclass
class _State:
    kept: list[str]
    batches: int = 0
    sampled: int = 0
    dropped: dict = dataclasses.field(default_factory=lambda: dict.fromkeys(
        ("unfinished", "special_tokens", "too_short", "duplicate", "known_prompt"), 0))


def _load_state(folder: Path, cfg: SelfPromptConfig) -> _State:
    state_path = folder / "state.json"
    if not state_path.exists():
        if folder.exists() and any(not f.name.startswith(".") for f in folder.iterdir()):
            raise ValueError(f"{folder} holds other files and no state.json: give a new or "
                             "empty folder for the self-written prompts")
        return _State(kept=[])
    try:
        state = json.loads(state_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{state_path} is unreadable ({e}); remove the folder to sample "
                         "again") from None
    if state.get("format") != FORMAT:
        raise ValueError(f"{state_path}: format {state.get('format')!r}, expected {FORMAT!r}")
    if state["settings"] != dataclasses.asdict(cfg):
        diff = sorted(k for k, v in dataclasses.asdict(cfg).items()
                      if state["settings"].get(k) != v)
        raise ValueError(f"{folder} was sampled with other settings ({', '.join(diff)}: "
                         f"{ {k: state['settings'].get(k) for k in diff} }); resume with "
                         "those, or use a new folder")
    try:
        prompts = read_prompt_file(folder / "prompts.jsonl") if state["kept"] else []
    except (OSError, ValueError) as e:
        raise ValueError(f"{folder}/prompts.jsonl is unreadable ({e}) while state.json "
                         f"counts {state['kept']} prompts: the folder was edited; sample "
                         "into a new one") from None
    if len(prompts) < state["kept"]:
        raise ValueError(f"{folder}/prompts.jsonl holds {len(prompts)} prompts, state.json "
                         f"says {state['kept']}: the folder was edited; sample into a new one")
    # prompts.jsonl is written before state.json: lines past the state's count are a batch
    # that was not committed, and it is sampled again (same key)
    return _State(kept=[p.turns[0] for p in prompts[: state["kept"]]],
                  batches=state["batches"], sampled=state["sampled"],
                  dropped=dict(state["dropped"]))


def _write(folder: Path, cfg: SelfPromptConfig, state: _State) -> None:
    lines = [json.dumps({"id": f"s{cfg.seed}-{i}", "source": SOURCE, "turns": [text]},
                        ensure_ascii=False) for i, text in enumerate(state.kept)]
    atomic_write_text(folder / "prompts.jsonl", "".join(line + "\n" for line in lines))
    atomic_write_json(folder / "state.json", {
        "format": FORMAT, "settings": dataclasses.asdict(cfg), "kept": len(state.kept),
        "batches": state.batches, "sampled": state.sampled, "dropped": state.dropped})


def sample_self_prompts(out_dir, count: int, sample_batch: BatchSampler, decode, *,
                        cfg: SelfPromptConfig = SelfPromptConfig(),
                        known: Optional[Sequence[Prompt]] = None, min_words: int = 3,
                        max_batches: Optional[int] = None, progress: bool = True) -> dict:
    """Sample user queries into `out_dir` until it holds `count` (resuming what is there).

    sample_batch(key, batch_size) -> (tokens [B, L], num_generated [B]); batch b uses key
    fold_in(PRNGKey(cfg.seed), b), so a resumed run samples what an unbroken one would.
    decode(ids, skip_special_tokens) -> str. known: prompts a query must not repeat
    (default: every evaluation set and training pool). Stops with a clear error after
    `max_batches` batches (default: enough for 10x `count` samples) when too few are kept.
    Returns the state (counts of kept and dropped queries)."""
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    folder = Path(out_dir)
    state = _load_state(folder, cfg)
    folder.mkdir(parents=True, exist_ok=True)
    known = _known_prompts() if known is None else list(known)
    known_index = dedup.OverlapIndex(known)
    seen = {dedup.text_hash(t) for t in state.kept}
    stop_tokens = set(getattr(sample_batch, "stop_tokens", ()))
    if max_batches is None:
        max_batches = state.batches + math.ceil(10 * max(count - len(state.kept), 1) /
                                                cfg.batch_size)
    bar = _bar(count, len(state.kept), progress)
    while len(state.kept) < count:
        if state.batches >= max_batches:
            raise ValueError(
                f"{folder}: only {len(state.kept)} of {count} queries kept after "
                f"{state.batches} batches ({state.dropped}); the target rarely ends a query "
                "within --max-query-tokens: raise it, or lower the temperature")
        key = jax.random.fold_in(jax.random.PRNGKey(cfg.seed), state.batches)
        tokens, num = sample_batch(key, cfg.batch_size)
        candidates = []
        for row, n in zip(np.asarray(tokens), np.asarray(num)):
            n = int(n)
            ended = n > 0 and (int(row[n - 1]) in stop_tokens if stop_tokens
                               else n < len(row))
            if not ended:
                state.dropped["unfinished"] += 1
                continue
            body = [int(t) for t in row[: n - 1]]
            text = decode(body, True).strip()
            if decode(body, False).strip() != text:
                state.dropped["special_tokens"] += 1
            elif len(text.split()) < min_words:
                state.dropped["too_short"] += 1
            elif dedup.text_hash(text) in seen:
                state.dropped["duplicate"] += 1
            else:
                seen.add(dedup.text_hash(text))
                candidates.append(text)
        batch_prompts = [Prompt(id=str(i), source=SOURCE, turns=(t,))
                         for i, t in enumerate(candidates)]
        clashes = {o.train for o in known_index.find(batch_prompts)}
        for p in batch_prompts:
            if f"{p.source}/{p.id}" in clashes:
                state.dropped["known_prompt"] += 1
            elif len(state.kept) < count:
                state.kept.append(p.turns[0])
                bar.update(1)
        state.batches += 1
        state.sampled += len(np.asarray(num))
        _write(folder, cfg, state)
    bar.close()
    _write(folder, cfg, state)
    return {"kept": len(state.kept), "batches": state.batches, "sampled": state.sampled,
            "dropped": dict(state.dropped)}


def _bar(total: int, initial: int, enabled: bool):
    if not enabled:
        from dblast_jax.data.regenerate import _NoBar
        return _NoBar()
    from tqdm.auto import tqdm
    return tqdm(total=total, initial=initial, unit="query", desc="self-prompts",
                dynamic_ncols=True)
