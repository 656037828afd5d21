"""The `dblast data fetch | regenerate | merge | drop-scores | tfds | stats` subcommands.

Wired into dblast_jax.cli by `add_data_subcommands`; the same functions back
`launch/make_data.py`."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Optional, Sequence

import jax

from dblast_jax import generation
from dblast_jax.data import dedup, sources
from dblast_jax.data.stats import corpus_stats, format_stats
from dblast_jax.distributed import add_cluster_args, initialize_from, local_mesh, mesh_arg
from dblast_jax.dtypes import dtype_from_name
from dblast_jax.errors import UnknownNameError, int_arg, parse_finite
from dblast_jax.io.fetch import ChecksumError, FetchError
from dblast_jax.io.output_folder import check_output_folder

__all__ = ["add_data_subcommands", "cmd_data_drop_scores", "cmd_data_fetch", "cmd_data_merge",
           "cmd_data_regenerate", "cmd_data_self_prompts", "cmd_data_stats", "cmd_data_tfds", "run_regenerate"]


def _floats(text: str) -> tuple[float, ...]:
    """Comma-separated temperatures: finite and >= 0 (nan / inf are refused)."""
    try:
        return tuple(parse_finite(x, "value", minimum=0.0, example="0.7,1.0")
                     for x in str(text).split(",") if x.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers >= 0, got {text!r} "
                                         f"({str(e).removeprefix('value: ')})") from None


def _floats_or_none(text: str) -> tuple[float, ...]:
    """`_floats`, or () for "none"."""
    return () if str(text).strip().lower() == "none" else _floats(text)


def _top_p(text: str) -> float:
    try:
        return parse_finite(text, "value", minimum=0.0, strict=True, maximum=1.0,
                            example="0.95")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("value: ")) from None


def _positive(text: str) -> float:
    try:
        return parse_finite(text, "value", minimum=0.0, strict=True, example="1.0")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("value: ")) from None


_count = int_arg(1, "8")  # sizes, lengths, numbers of things: >= 1
_nonneg = int_arg(0, "0")  # seeds; top-k (0 disables)


def _names(text: Optional[str]) -> Optional[list[str]]:
    return [x.strip() for x in text.split(",") if x.strip()] if text else None


def cmd_data_fetch(args) -> int:
    names = list(args.names or sources.SOURCES)
    unknown = [n for n in names if n not in sources.SOURCES]
    if unknown:  # one line, status 2 (dblast's error path)
        raise UnknownNameError(f"unknown prompt sets {unknown}; known: "
                               f"{', '.join(sources.SOURCES)}")
    try:
        paths = sources.fetch_sources(names)
    except (FetchError, ChecksumError) as e:
        print(f"dblast data fetch: error: {e}", file=sys.stderr)
        return 2
    for name in names:
        spec = sources.SOURCES[name]
        n = len(sources.load_prompts(name))
        print(f"{name:<24} {spec.split:<5} {n:>5} prompts  {paths[name]}")
    if set(sources.SOURCES) <= set(names):
        kept, dropped = dedup.training_prompts()
        print(f"training pools: {len(kept)} unique prompts disjoint from the evaluation sets "
              f"({len(dropped)} overlapping prompt(s) dropped: "
              f"{', '.join(o.train for o in dropped) or 'none'})")
    return 0


def run_regenerate(model: str, out: str, *, pools: Optional[Sequence[str]] = None,
                   limit: Optional[int] = None, gen_temperatures=(1.0,),
                   verify_temperatures=(1.0,), top_k: int = 0, top_p: float = 1.0,
                   max_new_tokens: int = 512, max_prompt_tokens: int = 1024,
                   batch_size: int = 8, shard_size: int = 256, seed: int = 0,
                   max_shards: Optional[int] = None, dtype: str = "float32",
                   system: Optional[str] = None, progress: bool = True,
                   prompts_from: Optional[str] = None, mesh: Optional[str] = None,
                   prompts_file: Optional[str] = None) -> dict:
    """Load the target, pick the training prompts, regenerate (or resume) into `out`.

    prompts_from: "CORPUS:A:B" answers the prompts of that corpus's shards A .. B-1
    instead of the training pools (e.g. a held-out range again at another temperature).
    prompts_file: a JSONL of text prompts (or a `dblast data self-prompts` folder) answered
    instead of the pools, in its order, after dropping repeats and any prompt that overlaps
    an evaluation set.
    mesh: "data,fsdp,tensor" over this process's devices (e.g. "-1,1,1": batches over
    every local device). Several processes (`dblast_jax.distributed.initialize` called
    first) share the shards; each calls this with the same arguments."""
    # startup: `dblast` imports this module; regeneration is slow to import
    from dblast_jax.data.regenerate import (RegenConfig, corpus_prompts, regenerate,
                                            training_work)
    device_mesh = local_mesh(mesh)  # a bad spec fails before the target loads
    # a folder of other files is refused before the target loads (every process alike)
    check_output_folder(out, "corpus", "--out")
    generation.check_target_source(model)  # before the prompt pools are read or fetched
    if prompts_from and prompts_file:
        raise ValueError("--prompts-from and --prompts-file both replace the training pools: "
                         "give one")
    if prompts_file:
        if pools:
            raise ValueError("--prompts-file replaces the training pools: drop --pools")
        prompts, dropped = _file_prompts(prompts_file, limit)
    elif prompts_from:
        if pools or limit is not None or system:
            raise ValueError("--prompts-from replaces the training pools: drop --pools / "
                             "--limit / --system (the prompts are already templated)")
        folder, first, stop = (prompts_from.rsplit(":", 2) + ["", ""])[:3]
        prompts, dropped = corpus_prompts(folder, f"{first}:{stop}"), []
    else:
        prompts, dropped = training_work(pools, limit, shuffle_seed=seed)
    target = generation.load_target(model, dtype=dtype_from_name(dtype))
    if not prompts_from and target.tokenizer is None:
        raise ValueError(f"target {model!r} has no tokenizer; text prompt pools need one "
                         "(use the Python API with token prompts)")
    cfg = RegenConfig(gen_temperatures=tuple(gen_temperatures),
                      verify_temperatures=tuple(verify_temperatures), top_k=top_k, top_p=top_p,
                      max_new_tokens=max_new_tokens, max_prompt_tokens=max_prompt_tokens,
                      batch_size=batch_size, shard_size=shard_size, seed=seed, system=system)
    t0 = time.perf_counter()
    manifest = regenerate(target, prompts, out, cfg, max_shards=max_shards, progress=progress,
                          mesh=device_mesh)
    manifest = dict(manifest, wall_seconds_this_run=round(time.perf_counter() - t0, 1),
                    overlaps_dropped=[o.train for o in dropped])
    return manifest


def _file_prompts(path: str, limit: Optional[int]) -> tuple[list, list]:
    """A prompt file's prompts, deduplicated, without those overlapping an evaluation set."""
    from dblast_jax.data.self_prompts import read_prompt_file
    evals = [p for n in sources.EVAL_SETS for p in sources.load_prompts(n)]
    kept, dropped = dedup.remove_overlaps(dedup.dedup_prompts(read_prompt_file(path)), evals)
    return kept[:limit] if limit is not None else kept, dropped


def cmd_data_self_prompts(args) -> int:
    from dblast_jax.data.self_prompts import (SelfPromptConfig, sample_self_prompts,
                                              target_batch_sampler)
    cfg = SelfPromptConfig(seed=args.seed, temperature=args.temperature, top_p=args.top_p,
                           max_query_tokens=args.max_query_tokens,
                           batch_size=args.batch_size, system=args.system)
    check_output_folder(args.out, "self-prompts", "--out")
    generation.check_target_source(args.model)
    target = generation.load_target(args.model, dtype=dtype_from_name(args.dtype))
    summary = sample_self_prompts(args.out, args.count, target_batch_sampler(target, cfg),
                                  target.tokenizer.decode, cfg=cfg,
                                  progress=not args.no_progress)
    print(f"{args.out}: {summary['kept']} prompts from {summary['sampled']} samples "
          f"({summary['batches']} batches); dropped: "
          + ", ".join(f"{k} {v}" for k, v in summary["dropped"].items()))
    return 0


def cmd_data_regenerate(args) -> int:
    initialize_from(args)
    manifest = run_regenerate(
        args.model, args.out, pools=_names(args.pools), limit=args.limit,
        gen_temperatures=args.gen_temperatures, verify_temperatures=args.verify_temperatures,
        top_k=args.top_k, top_p=args.top_p, max_new_tokens=args.max_new_tokens,
        max_prompt_tokens=args.max_prompt_tokens, batch_size=args.batch_size,
        shard_size=args.shard_size, seed=args.seed, max_shards=args.max_shards,
        dtype=args.dtype, system=args.system, progress=not args.no_progress,
        prompts_from=args.prompts_from, mesh=args.mesh, prompts_file=args.prompts_file)
    if jax.process_index() != 0:
        return 0
    t = manifest["totals"]
    print(f"{args.out}: {t['shards']}/{manifest['num_shards']} shards, {t['sequences']} "
          f"sequences, {t['tokens']} tokens ({t['response_tokens']} response); "
          f"{'complete' if manifest['complete'] else 'incomplete (run again to continue)'}; "
          f"this run {manifest['wall_seconds_this_run']} s")
    return 0


def cmd_data_merge(args) -> int:
    from dblast_jax.data.merge import merge_corpora
    merge_corpora(args.sources, args.out, verify_temperatures=args.verify_temperatures,
                  exclude_prompts_of=args.exclude_prompts_of or ())
    return 0


def cmd_data_drop_scores(args) -> int:
    from dblast_jax.data.drop_scores import drop_scores
    drop_scores(args.corpus, args.out)
    return 0


def cmd_data_stats(args) -> int:
    s = corpus_stats(args.corpus, verify=not args.no_verify)
    print(json.dumps(s, indent=1) if args.json else format_stats(s))
    return 0


def cmd_data_tfds(args) -> int:
    if not args.corpus and not args.prompts:
        raise ValueError("nothing to build: pass --corpus FOLDER and/or --prompts NAME[,NAME]")
    if os.path.exists(args.data_dir) and not os.path.isdir(args.data_dir):
        raise ValueError(f"--data-dir {args.data_dir!r} is a file, not a folder; give TFDS's "
                         "data folder (created if absent)")
    for name in _names(args.prompts) or []:  # before anything is built
        if name not in sources.SOURCES:
            raise UnknownNameError(f"unknown prompt set {name!r}; known: "
                                   f"{', '.join(sources.SOURCES)}")
    from dblast_jax.data import tfds_builders  # optional dependency: tensorflow_datasets
    if args.corpus:
        path = tfds_builders.build_corpus_dataset(args.corpus, args.data_dir, args.max_shards)
        print(f"corpus {args.corpus}: {path} (train with --data {path})")
    for name in _names(args.prompts) or []:
        print(f"{name}: {tfds_builders.build_prompt_dataset(name, args.data_dir)}")
    return 0


def add_data_subcommands(subparsers) -> argparse.ArgumentParser:
    """Add `data {fetch,regenerate,merge,drop-scores,tfds,stats}` to a `dblast` subparsers object."""
    data = subparsers.add_parser("data", help="prompt sets, corpus regeneration, corpus stats")
    sub = data.add_subparsers(dest="data_command", required=True)

    p = sub.add_parser("fetch", help="extract + verify the pinned evaluation / training sets")
    p.add_argument("names", nargs="*", help="prompt sets (default: all)")
    p.set_defaults(func=cmd_data_fetch)

    p = sub.add_parser("regenerate", help="the target answers the training prompts "
                       "(sharded, resumable)")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--out", required=True, help="corpus folder, local or gs://BUCKET/PATH "
                   "(re-run to resume / grow)")
    p.add_argument("--pools", help="comma-separated training pools (default: all)")
    p.add_argument("--limit", type=_count, help="use the first N prompts of the shuffled pools")
    p.add_argument("--prompts-from", metavar="CORPUS:A:B",
                   help="answer the prompts of corpus shards A .. B-1 instead of the pools "
                        "(a held-out set sampled at another temperature)")
    p.add_argument("--prompts-file", metavar="FILE.jsonl",
                   help="answer these text prompts instead of the pools: one {\"turns\": "
                        "[...]} or {\"prompt\": ...} per line, or a `dblast data "
                        "self-prompts` folder")
    p.add_argument("--gen-temperatures", type=_floats, default=(1.0,),
                   help="comma-separated sampling temperatures (one answer per prompt each)")
    p.add_argument("--verify-temperatures", type=_floats_or_none, default=(1.0,),
                   help="comma-separated temperatures to store target log-probs at; 'none': "
                        "an unscored corpus (tokens only, ~10x smaller; a training run "
                        "with a feature cache scores it there)")
    p.add_argument("--top-k", type=_nonneg, default=0)
    p.add_argument("--top-p", type=_top_p, default=1.0)
    p.add_argument("--max-new-tokens", type=_count, default=512)
    p.add_argument("--max-prompt-tokens", type=_count, default=1024)
    p.add_argument("--batch-size", type=_count, default=8)
    p.add_argument("--shard-size", type=_count, default=256)
    p.add_argument("--seed", type=_nonneg, default=0)
    p.add_argument("--max-shards", type=_count, help="stop after this many new shards")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--system", help="system message for every prompt")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--mesh", metavar="DATA,FSDP,TENSOR", type=mesh_arg,
                   help="device mesh over this process's devices, e.g. -1,1,1 (batches split "
                        "over the data axis; the answers equal a one-device run's, the "
                        "log-probs agree to float rounding)")
    add_cluster_args(p, "the shards are shared out, --out must be one shared folder")
    p.set_defaults(func=cmd_data_regenerate)

    p = sub.add_parser("self-prompts", help="new training prompts written by the target "
                       "(user queries sampled from its chat template; resumable)")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--out", required=True, help="folder for prompts.jsonl + state.json "
                   "(re-run to resume, or with a larger --count to extend)")
    p.add_argument("--count", type=_count, required=True, help="prompts to keep")
    p.add_argument("--seed", type=_nonneg, default=0)
    p.add_argument("--temperature", type=_positive, default=1.0,
                   help="sampling temperature of the queries (> 0)")
    p.add_argument("--top-p", type=_top_p, default=1.0,
                   help="nucleus filter (it sorts the vocabulary every step: ~4x slower "
                        "on CPU; the unfinished-query filter already drops most rambling)")
    p.add_argument("--max-query-tokens", type=_count, default=128,
                   help="a query the target has not ended by then is dropped")
    p.add_argument("--batch-size", type=_count, default=16)
    p.add_argument("--system", help="system message (default: the template's own)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_data_self_prompts)

    p = sub.add_parser("merge", help="one corpus from shard ranges of several (e.g. more "
                       "answers to the same prompts, made in another folder)")
    p.add_argument("sources", nargs="+", metavar="CORPUS[:A:B]",
                   help="source corpus folders in order; :A:B takes its shards A .. B-1 "
                        "(all finished), a bare folder the shards finished so far")
    p.add_argument("--out", required=True, help="the merged corpus folder (new, or the same "
                   "merge to resume)")
    p.add_argument("--verify-temperatures", type=_floats,
                   help="log-prob temperatures to keep (default: those every source stores)")
    p.add_argument("--exclude-prompts-of", action="append", metavar="CORPUS:A:B",
                   help="leave out every record answering a prompt of these shards (the "
                        "held-out set; repeatable)")
    p.set_defaults(func=cmd_data_merge)

    p = sub.add_parser("drop-scores", help="a tokens-only copy of a regenerated corpus (~10x "
                       "smaller; `regenerate --verify-temperatures none` resumes it)")
    p.add_argument("corpus", help="the regenerated (scored) corpus folder")
    p.add_argument("--out", required=True, help="the unscored copy (new, or the same copy "
                   "to resume)")
    p.set_defaults(func=cmd_data_drop_scores)

    p = sub.add_parser("tfds", help="TFDS (array_record) copies of a corpus / prompt sets, "
                       "for tfds.data_source + grain")
    p.add_argument("--corpus", help="a `dblast data regenerate` folder")
    p.add_argument("--max-shards", type=_count, help="only the corpus's first N shards")
    p.add_argument("--prompts", help="comma-separated prompt sets (e.g. gsm8k,mt-bench)")
    p.add_argument("--data-dir", required=True, help="TFDS data_dir")
    p.set_defaults(func=cmd_data_tfds)

    p = sub.add_parser("stats", help="corpus report: sizes, lengths, target entropy")
    p.add_argument("corpus", help="corpus folder")
    p.add_argument("--json", action="store_true")
    p.add_argument("--no-verify", action="store_true", help="skip shard checksums")
    p.set_defaults(func=cmd_data_stats)
    return data
