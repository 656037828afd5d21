"""TFDS datasets (array_record files, no TensorFlow) of the prompt sets and corpora.

Why: a prepared TFDS dataset is a standard, self-describing copy (features.json,
dataset_info.json, array_record shards) that `tfds.data_source(...)` or
`tfds.builder_from_directory(dir).as_data_source()` reads with random access, which is
what a grain `MapDataset.source(...)` wants. Writing and reading go through TFDS's own
proto serializer and array_record; tensorflow is never imported (tfds 4.9.10).

Layout under `data_dir`::

    dblast_prompts/<set>-<fingerprint[:16]>/1.0.0/    one prompt set
    dblast_corpus/corpus-<fingerprint[:16]>/1.0.0/    one regenerated corpus

The config name carries a fingerprint of the content (the prompts themselves; the
corpus manifest's shard sha256s), so a build is reused only for the identical content:
re-running a build is a no-op, and a changed corpus gets a new config (its old dataset
is never read in its place). Records keep the source order (`disable_shuffling`), so
record i of the corpus dataset is `Corpus(folder)[i]`.

Corpus features: tokens int32 [L], loss_mask bool [L], logp_<T> / entropy_<T> float32
[L] per stored verification temperature T (`temperature_key`), id str,
prompt_length int32, gen_temperature float32, stopped bool.
Prompt features: id str, source str, turns [str], meta_json str (the `Prompt.meta` pairs).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import numpy as np
import tensorflow_datasets as tfds

from dblast_jax.data import sources
from dblast_jax.data.corpus import FORMAT, Corpus, read_manifest, temperature_key

__all__ = ["CORPUS_DATASET", "PROMPTS_DATASET", "VERSION", "corpus_fingerprint",
           "prompts_fingerprint", "CorpusBuilder", "PromptsBuilder", "build_corpus_dataset",
           "build_prompt_dataset", "corpus_dataset_dir", "TfdsCorpusSource",
           "corpus_data_source", "read_prompt_dataset"]

CORPUS_DATASET = "dblast_corpus"
PROMPTS_DATASET = "dblast_prompts"
VERSION = "1.0.0"
_SPLIT = "train"
_SKIP_STATS = tfds.download.DownloadConfig(
    compute_stats=tfds.download.ComputeStatsMode.SKIP)


def _sha256_json(payload: Any) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _decode(value: bytes | str) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


# ---- identity --------------------------------------------------------------------------

def _corpus_shards(folder: os.PathLike | str, max_shards: Optional[int]) -> tuple[dict, list[dict]]:
    manifest = read_manifest(folder)
    if manifest is None:
        raise FileNotFoundError(f"no corpus at {folder} (missing manifest.json); make one "
                                "with `dblast data regenerate`")
    shards = sorted(manifest["shards"], key=lambda s: s["index"])
    if max_shards:
        shards = [s for s in shards if s["index"] < max_shards]
    return manifest, shards


def corpus_fingerprint(folder: os.PathLike | str, max_shards: Optional[int] = None) -> str:
    """sha256 over the corpus content identity: format, temperatures and each used
    shard's (index, sha256, sequences) from the manifest. Any rewritten shard changes it."""
    manifest, shards = _corpus_shards(folder, max_shards)  # local or gs://
    temps = [temperature_key(t) for t in manifest["settings"]["verify_temperatures"]]
    return _sha256_json({"format": FORMAT, "temperatures": temps,
                         "shards": [[s["index"], s["sha256"], s["sequences"]] for s in shards]})


def prompts_fingerprint(prompts: Sequence[sources.Prompt]) -> str:
    """sha256 over every prompt's id, source, turns and meta, in order."""
    return _sha256_json([[p.id, p.source, list(p.turns), [list(kv) for kv in p.meta]]
                         for p in prompts])


def _corpus_config_name(fingerprint: str) -> str:
    return f"corpus-{fingerprint[:16]}"


def _prompts_config_name(name: str, fingerprint: str) -> str:
    return f"{re.sub(r'[^A-Za-z0-9_-]', '_', name)}-{fingerprint[:16]}"


# ---- builders ----------------------------------------------------------------------------

def _vector(dtype) -> tfds.features.Tensor:
    return tfds.features.Tensor(shape=(None,), dtype=dtype)


def _scalar(dtype) -> tfds.features.Tensor:
    return tfds.features.Tensor(shape=(), dtype=dtype)


class _LocalBuilder(tfds.core.GeneratorBasedBuilder):
    """Base of the builders here: no code folder (no checksums / metadata files).

    `code_path = None` also sidesteps a tfds 4.9.10 bug: its default `code_path` of a
    builder defined inside a package touches `importlib_resources`, a module tfds only
    requires on Python < 3.9 (tensorflow/datasets#11212), so `download_and_prepare`
    would fail here with ModuleNotFoundError.
    """

    code_path = None


class CorpusBuilder(_LocalBuilder):
    """One regenerated corpus folder as a TFDS dataset (single split "train", in order).

    The builder config is derived from the corpus (`corpus_fingerprint`), so it is built
    with `CorpusBuilder(corpus_folder=..., data_dir=...)`, never by config name; reading
    needs no corpus (`tfds.data_source("dblast_corpus/corpus-<fp16>", data_dir=...)`).
    """

    name = CORPUS_DATASET
    VERSION = tfds.core.Version(VERSION)
    RELEASE_NOTES = {str(VERSION): "dblast-corpus-v1 shards as array_record records."}

    def __init__(self, *, corpus_folder: os.PathLike | str, max_shards: Optional[int] = None,
                 **kwargs: Any):
        self._corpus = Corpus(corpus_folder, verify=True, max_shards=max_shards)
        self.fingerprint = corpus_fingerprint(corpus_folder, max_shards)
        self._temps = [temperature_key(t) for t in self._corpus.temperatures]
        config = tfds.core.BuilderConfig(
            name=_corpus_config_name(self.fingerprint),
            description=f"corpus {self._corpus.folder}; fingerprint {self.fingerprint}")
        super().__init__(config=config, file_format="array_record", **kwargs)

    def _info(self) -> tfds.core.DatasetInfo:
        feats: dict[str, Any] = {"tokens": _vector(np.int32), "loss_mask": _vector(np.bool_),
                                 "id": tfds.features.Text(),
                                 "prompt_length": _scalar(np.int32),
                                 "gen_temperature": _scalar(np.float32),
                                 "stopped": _scalar(np.bool_)}
        for key in self._temps:
            feats[f"logp_{key}"] = _vector(np.float32)
            feats[f"entropy_{key}"] = _vector(np.float32)
        return tfds.core.DatasetInfo(
            builder=self, description="dblast regenerated corpus (target answers + log-probs)",
            features=tfds.features.FeaturesDict(feats), disable_shuffling=True)

    def _split_generators(self, dl_manager) -> dict[str, Iterator]:
        del dl_manager  # nothing to download: the corpus folder is local
        return {_SPLIT: self._generate_examples()}

    def _generate_examples(self) -> Iterator[tuple[int, dict[str, Any]]]:
        for i in range(len(self._corpus)):
            r = self._corpus[i]
            ex = {"tokens": r["tokens"], "loss_mask": r["loss_mask"], "id": r["id"],
                  "prompt_length": np.int32(r["prompt_length"]),
                  "gen_temperature": np.float32(r["gen_temperature"]),
                  "stopped": bool(r["stopped"])}
            for key in self._temps:
                ex[f"logp_{key}"] = r["logp"][key]
                ex[f"entropy_{key}"] = r["entropy"][key]
            yield i, ex  # integer keys + disable_shuffling: written in corpus order


class PromptsBuilder(_LocalBuilder):
    """One prompt set (`sources.load_prompts(name)`, or a given list) as a TFDS dataset."""

    name = PROMPTS_DATASET
    VERSION = tfds.core.Version(VERSION)
    RELEASE_NOTES = {str(VERSION): "Prompt records: id, source, turns, meta_json."}

    def __init__(self, *, prompt_set: str,
                 prompts: Optional[Sequence[sources.Prompt]] = None, **kwargs: Any):
        self._prompts = list(prompts) if prompts is not None else sources.load_prompts(prompt_set)
        if not self._prompts:
            raise ValueError(f"prompt set {prompt_set!r} is empty; nothing to build")
        self.fingerprint = prompts_fingerprint(self._prompts)
        config = tfds.core.BuilderConfig(
            name=_prompts_config_name(prompt_set, self.fingerprint),
            description=f"prompt set {prompt_set}; fingerprint {self.fingerprint}")
        super().__init__(config=config, file_format="array_record", **kwargs)

    def _info(self) -> tfds.core.DatasetInfo:
        feats = {"id": tfds.features.Text(), "source": tfds.features.Text(),
                 "turns": tfds.features.Sequence(tfds.features.Text()),
                 "meta_json": tfds.features.Text()}
        return tfds.core.DatasetInfo(
            builder=self, description="dblast prompt set (raw user turns)",
            features=tfds.features.FeaturesDict(feats), disable_shuffling=True)

    def _split_generators(self, dl_manager) -> dict[str, Iterator]:
        del dl_manager  # prompts come from the project's verified cache (`fetch_sources`)
        return {_SPLIT: self._generate_examples()}

    def _generate_examples(self) -> Iterator[tuple[int, dict[str, Any]]]:
        for i, p in enumerate(self._prompts):
            yield i, {"id": p.id, "source": p.source, "turns": list(p.turns),
                      "meta_json": json.dumps([list(kv) for kv in p.meta])}


def _prepare(builder: tfds.core.DatasetBuilder) -> Path:
    """download_and_prepare unless this exact config is already on disk (then it is a
    no-op: TFDS finds dataset_info.json and reuses it). Returns the dataset folder."""
    builder.download_and_prepare(download_config=_SKIP_STATS)
    return Path(builder.data_dir)


def build_corpus_dataset(corpus_folder: os.PathLike | str, data_dir: os.PathLike | str,
                         max_shards: Optional[int] = None) -> Path:
    """Build (once) the TFDS dataset of a corpus; returns its folder
    (`data_dir/dblast_corpus/corpus-<fp16>/1.0.0`). Shards are sha256-checked on read."""
    return _prepare(CorpusBuilder(corpus_folder=corpus_folder, max_shards=max_shards,
                                  data_dir=os.fspath(data_dir)))


def build_prompt_dataset(name: str, data_dir: os.PathLike | str,
                         prompts: Optional[Sequence[sources.Prompt]] = None) -> Path:
    """Build (once) the TFDS dataset of prompt set `name` (from `load_prompts(name)`
    unless `prompts` is given); returns its folder."""
    return _prepare(PromptsBuilder(prompt_set=name, prompts=prompts,
                                   data_dir=os.fspath(data_dir)))


def corpus_dataset_dir(corpus_folder: os.PathLike | str, data_dir: os.PathLike | str,
                       max_shards: Optional[int] = None) -> Path:
    """Where the dataset of this corpus's current content lives (built or not)."""
    config = _corpus_config_name(corpus_fingerprint(corpus_folder, max_shards))
    return Path(data_dir) / CORPUS_DATASET / config / VERSION


# ---- readers -----------------------------------------------------------------------------

class TfdsCorpusSource:
    """grain random-access source over a prepared corpus dataset folder.

    `src[i]` has the fields of `Corpus(folder, verify_temperature)[i]`: tokens [L] int32,
    loss_mask [L] bool, logp {T: [L] float32} (one [L] array when verify_temperature is
    given), entropy {T: [L]}, id str, prompt_length int, gen_temperature float,
    stopped bool. The TFDS reader opens lazily, so the source pickles for grain workers.
    """

    def __init__(self, dataset_dir: os.PathLike | str,
                 verify_temperature: Optional[float] = None):
        self.dataset_dir = Path(dataset_dir)
        if not (self.dataset_dir / "dataset_info.json").is_file():
            raise FileNotFoundError(f"no prepared TFDS dataset at {self.dataset_dir}")
        self._source = None
        names = self._open().dataset_info.features.keys()  # ArrayRecordDataSource
        self.temperatures = sorted(n[len("logp_"):] for n in names if n.startswith("logp_"))
        self.verify_key = None
        if verify_temperature is not None:
            self.verify_key = temperature_key(verify_temperature)
            if self.verify_key not in self.temperatures:
                raise ValueError(f"{self.dataset_dir} stores log-probs at temperatures "
                                 f"{self.temperatures}, not at {self.verify_key}")
        self._lengths: Optional[tuple[np.ndarray, np.ndarray]] = None

    def _open(self):
        if self._source is None:
            builder = tfds.builder_from_directory(self.dataset_dir)
            self._source = builder.as_data_source(split=_SPLIT)
        return self._source

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_source"] = None  # array_record readers are reopened in the worker
        return state

    def __len__(self) -> int:
        return len(self._open())

    def _record(self, ex: dict[str, Any]) -> dict[str, Any]:
        logp = {t: ex[f"logp_{t}"] for t in self.temperatures}
        return {"tokens": ex["tokens"], "loss_mask": ex["loss_mask"].astype(bool),
                "logp": logp[self.verify_key] if self.verify_key else logp,
                "entropy": {t: ex[f"entropy_{t}"] for t in self.temperatures},
                "id": _decode(ex["id"]), "prompt_length": int(ex["prompt_length"]),
                "gen_temperature": float(ex["gen_temperature"]),
                "stopped": bool(ex["stopped"])}

    def __getitem__(self, i: int) -> dict[str, Any]:
        i = int(i)
        if not 0 <= i < len(self):
            raise IndexError(f"record {i} out of range for a dataset of {len(self)}")
        return self._record(self._open()[i])

    def pipeline_record(self, i: int) -> dict[str, Any]:
        """The fields `pipeline.CorpusDataSource` yields (tokens, loss_mask, logp at the
        verify temperature): `pipeline.make_dataset(source, ...)` reads this source."""
        rec = self[i]
        out = {"tokens": rec["tokens"], "loss_mask": rec["loss_mask"]}
        if self.verify_key is not None:
            out["logp"] = rec["logp"]
        return out

    def __getitems__(self, keys: Sequence[int]) -> list[dict[str, Any]]:
        return [self._record(ex) for ex in self._open().__getitems__([int(k) for k in keys])]

    def __repr__(self) -> str:
        return f"TfdsCorpusSource({str(self.dataset_dir)!r}, {len(self)} records)"

    def lengths(self, chunk: int = 1024) -> tuple[np.ndarray, np.ndarray]:
        """(sequence lengths [S], prompt lengths [S]); one decoding pass, then cached."""
        if self._lengths is None:
            seq, prompt = [], []
            for lo in range(0, len(self), chunk):
                for ex in self._open().__getitems__(range(lo, min(lo + chunk, len(self)))):
                    seq.append(len(ex["tokens"]))
                    prompt.append(int(ex["prompt_length"]))
            self._lengths = np.array(seq, np.int64), np.array(prompt, np.int64)
        return self._lengths

    def usable_indices(self, seq_len: int, block_size: int) -> np.ndarray:
        """Same rule as `Corpus.usable_indices`: a response token followed by a whole
        block within seq_len."""
        seq, prompt = self.lengths()
        last = np.minimum(seq, seq_len) - block_size
        ok = (last >= 0) & (prompt <= last) & (seq > prompt)
        if not ok.any():
            raise ValueError(f"{self.dataset_dir}: no record has a response token followed by "
                             f"a block of {block_size} within seq_len {seq_len}")
        return np.nonzero(ok)[0]


def corpus_data_source(corpus_folder: os.PathLike | str, data_dir: os.PathLike | str, *,
                       verify_temperature: Optional[float] = None, build: bool = False,
                       max_shards: Optional[int] = None) -> TfdsCorpusSource:
    """The TFDS source of a corpus's *current* content. A dataset prepared from an older
    version of the corpus is refused (its fingerprint differs): the error names the stale
    builds; `build=True` prepares the current one instead."""
    target = corpus_dataset_dir(corpus_folder, data_dir, max_shards)
    if not (target / "dataset_info.json").is_file():
        if build:
            build_corpus_dataset(corpus_folder, data_dir, max_shards)
        else:
            others = sorted(p.name for p in (Path(data_dir) / CORPUS_DATASET).glob("corpus-*"))
            raise FileNotFoundError(
                f"no TFDS dataset of corpus {corpus_folder} as it is now (expected {target}); "
                f"prepared builds of other corpus contents: {others or 'none'}. Run "
                "build_corpus_dataset(corpus_folder, data_dir) or pass build=True")
    return TfdsCorpusSource(target, verify_temperature=verify_temperature)


def read_prompt_dataset(dataset_dir: os.PathLike | str) -> list[sources.Prompt]:
    """The prompts of a prepared prompt dataset folder, as `Prompt` records, in order."""
    src = tfds.builder_from_directory(os.fspath(dataset_dir)).as_data_source(split=_SPLIT)
    return [sources.Prompt(_decode(ex["id"]), _decode(ex["source"]),
                           tuple(_decode(t) for t in ex["turns"]),
                           tuple(tuple(kv) for kv in json.loads(_decode(ex["meta_json"]))))
            for ex in src.__getitems__(range(len(src)))]


# ---- pipeline ----------------------------------------------------------------------------
