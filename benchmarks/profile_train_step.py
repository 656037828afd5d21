"""Where does a drafter training step's time go? Op time per step by source line.

Builds one Trainer of an experiment (the flagship's recipe by default: five taps,
distillation, the sampled training head, seq_len 384, a bfloat16 feature cache of a few
corpus shards), times a few steps, then traces a few more with the JAX profiler and
attributes every XLA op's time to the line of this library that made it and that line's
caller (from the optimised HLO's stack frames). What it prints is what to optimise next; the op times
add up to about the step's wall time on a 2-core CPU, where ops run one after another.

    python benchmarks/profile_train_step.py                       # the flagship recipe
    python benchmarks/profile_train_step.py --override seq_len=256 --top 40
    python benchmarks/profile_train_step.py --out benchmarks/results_profile_train_step.json

XLA_FLAGS is set here (per-op trace events, an HLO dump), so run it as its own process.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import statistics
import sys
import tempfile

FLAGSHIP = ["data=corpora/smollm2_t1", "data_shards=2", "batch_size=8", "seq_len=384",
            "anchors_per_sequence=16", "drafter_layers=1", "target_layer_ids=1,7,14,20,27",
            "distill_weight=1.0", "train_head_tokens=4096", "train_head_sampled=1024",
            "feature_cache_dtype=bfloat16"]


def _stack_frames(hlo_text: str) -> tuple[dict, dict]:
    """(instruction name -> stack_frame_id, frame id -> [(file, function, line) innermost
    first]) from an optimised HLO module's text."""
    files, funcs, locs, frames, inst = {}, {}, {}, {}, {}
    section = None
    for line in hlo_text.splitlines():
        s = line.strip()
        if s in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = s
            continue
        if section and re.match(r"^\d+ ", s):
            i, rest = s.split(" ", 1)
            i = int(i)
            if section == "FileNames":
                files[i] = os.path.basename(rest.strip('"'))
            elif section == "FunctionNames":
                funcs[i] = rest.strip('"')
            elif section == "FileLocations":
                m = re.search(r"file_name_id=(\d+) function_name_id=(\d+) line=(\d+)", rest)
                locs[i] = (files[int(m[1])], funcs[int(m[2])], int(m[3]))
            else:
                m = re.search(r"file_location_id=(\d+) parent_frame_id=(\d+)", rest)
                frames[i] = (int(m[1]), int(m[2]))
            continue
        section = None
        m = re.match(r"(?:ROOT )?%?([\w.\-]+) = .*stack_frame_id=(\d+)", s)
        if m:
            inst[m[1]] = int(m[2])

    def chain(fid: int) -> list:
        out = []
        while fid in frames and len(out) < 64:
            loc, parent = frames[fid]
            out.append(locs[loc])
            if parent in (0, fid):
                break
            fid = parent
        return out

    return inst, {fid: chain(fid) for fid in set(inst.values())}


def attribute(trace_file: str, hlo_file: str, steps: int) -> tuple[float, list]:
    """(op ms per step, [(file:function:line, ms per step)] largest first)."""
    inst, chains = _stack_frames(open(hlo_file).read())
    events = json.load(gzip.open(trace_file))["traceEvents"]
    threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    by_line, total = collections.Counter(), 0.0
    for e in events:
        if e.get("ph") != "X" or "XLA" not in threads.get((e["pid"], e.get("tid")), ""):
            continue
        name = e["name"]
        if name.startswith(("ThunkExecutor", "SlinkyThreadPool", "H2D", "D2H")):
            continue  # waits and transfers, not ops
        total += e["dur"]
        chain = chains.get(inst.get(name, -1), [])
        # the innermost line and its caller: a shared helper (a linear layer) is then
        # told apart by who called it
        distinct = [loc for i, loc in enumerate(chain) if loc not in chain[:i]]
        key = " <- ".join(f"{f}:{fn.split('.')[-1]}:{ln}" for f, fn, ln in distinct[:2]) or name
        by_line[key] += e["dur"]
    return total / steps / 1e3, [(k, v / steps / 1e3) for k, v in by_line.most_common()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experiment", default="smollm2_k1_al")
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--override", action="append", default=[],
                   help="key=value on top of the flagship recipe (repeatable)")
    p.add_argument("--timed-steps", type=int, default=5)
    p.add_argument("--traced-steps", type=int, default=4)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--workdir", default="", help="scratch folder (default: a new temp dir)")
    p.add_argument("--out", default="")
    args = p.parse_args()
    root = args.workdir or tempfile.mkdtemp(prefix="profile_train_")
    hlo_dir, trace_dir = os.path.join(root, "hlo"), os.path.join(root, "trace")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_xprof_traceme"
                               f"=true --xla_dump_to={hlo_dir} --xla_dump_hlo_pass_re=NONE")
    import jax  # after XLA_FLAGS

    from dblast_jax.generation import load_target
    from dblast_jax.train import get_experiment
    from dblast_jax.train.trainer import Trainer

    overrides = FLAGSHIP + ["num_steps=100000", "checkpoint_every=100000", "log_every=1",
                            "export=false", f"feature_cache={root}/features"] + args.override
    trainer = Trainer(get_experiment(args.experiment, overrides), os.path.join(root, "work"),
                      target=load_target(args.target), progress=False, log=lambda s: None)
    step = trainer.run(stop_at=2).step  # compile
    res = trainer.run(stop_at=step + args.timed_steps)
    step_s = [h["step_time_s"] for h in res.history if "step_time_s" in h]
    jax.profiler.start_trace(trace_dir, create_perfetto_trace=False)
    trainer.run(stop_at=res.step + args.traced_steps)
    jax.profiler.stop_trace()
    trainer.close()
    trace = sorted(glob.glob(os.path.join(trace_dir, "plugins", "profile", "*", "*.trace.json.gz")))
    hlo = sorted(glob.glob(os.path.join(hlo_dir, "*jit_step_fn.cpu_after_optimizations.txt")),
                 key=os.path.getsize)
    if not trace or not hlo:
        sys.exit(f"no trace or no optimised HLO of the step under {root}")
    op_ms, lines = attribute(trace[-1], hlo[-1], args.traced_steps)
    median = statistics.median(step_s)
    print(f"{args.experiment} {' '.join(args.override)}: {median:.3f} s per step (median of "
          f"{len(step_s)}), XLA ops {op_ms:.0f} ms per step")
    print("| ms per step | share | source line of the op <- its caller |")
    print("|---|---|---|")
    for key, ms in lines[:args.top]:
        print(f"| {ms:.1f} | {ms / op_ms:.0%} | {key} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"settings": vars(args), "s_per_step": step_s, "op_ms_per_step": op_ms,
                       "by_line_ms_per_step": lines}, f, indent=1)
        print(f"written to {args.out}")


if __name__ == "__main__":
    main()
