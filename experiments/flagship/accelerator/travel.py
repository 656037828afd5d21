"""What travels to and back from a lent accelerator, kept inside the tool's limits.

The device tool copies the working tree (tracked files present in it, untracked files git
does not ignore, shared/) plus up to 8 carried ignored paths, 64 MiB per call, and brings
back at most 8 files of $OUT (16 MiB each, 64 MiB together, at most 2 folders down, names
of letters, digits, '.', '_' and '-'). The repository alone is ~99 MB and the target's GGUF
98 MB, so prepare.sh shrinks the tree (sparse checkout), gzips the GGUF and splits it over
two back-to-back calls, and this module measures every call before it is made and checks
$OUT before it comes back: a call over a limit is refused by the tool only after the
machine has started, i.e. after device minutes are spent.

    python travel.py split MODEL.gguf .device --first-bytes N     # gzip, then 2 parts
    python travel.py join .device/manifest.json OUT.gguf PART1 PART2
    python travel.py tree-size --patterns-file sparse_patterns.txt  # planned sparse tree
    python travel.py measure --carry .device/gguf.part1 .device/drafter
    python travel.py pack-corpus CORPUS OUTDIR --stem corpus_seed3 --max-archives 2
    python travel.py check-out OUTDIR
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile

MIB = 1 << 20
TOOL_TREE_LIMIT = 64 * MIB  # the tool's limit on what one call sends
TREE_LIMIT = 60 * MIB  # ours: a margin for what we cannot see (the tool's own accounting)
OUT_MAX_FILES = 8
OUT_MAX_FILE = 16 * MIB
OUT_MAX_TOTAL = 64 * MIB
OUT_MAX_DEPTH = 2  # $OUT/a/b/file comes back, $OUT/a/b/c/file does not
OUT_NAME = re.compile(r"^[A-Za-z0-9._-]+$")
_CHUNK = 1 << 20


class TravelError(ValueError):
    """A call or $OUT would break one of the tool's limits (the message says which)."""


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def path_bytes(path: str) -> int:
    """Bytes under `path` (a file, or every file below a folder); links count as links."""
    if os.path.islink(path) or os.path.isfile(path):
        return os.lstat(path).st_size
    total = 0
    for root, dirs, files in os.walk(path):
        total += sum(os.lstat(os.path.join(root, f)).st_size for f in files)
        total += sum(os.lstat(os.path.join(root, d)).st_size for d in dirs
                     if os.path.islink(os.path.join(root, d)))
    return total


# ---- the model in two parts ---------------------------------------------------------------

def split(src: str, dest: str, first_bytes: int, name: str = "gguf") -> dict:
    """gzip `src` (level 1: ~6% smaller for a Q4 GGUF, seconds to make and undo) and cut
    the stream after `first_bytes` into DEST/NAME.part1 and NAME.part2; returns (and
    writes to DEST/NAME.json) the sizes and sha256 of the original and of each part."""
    buf = io.BytesIO()
    with open(src, "rb") as f, gzip.GzipFile(fileobj=buf, mode="wb", compresslevel=1,
                                            mtime=0) as gz:
        shutil.copyfileobj(f, gz, _CHUNK)
    data = buf.getvalue()
    if not 0 < first_bytes < len(data):
        raise TravelError(f"--first-bytes {first_bytes} must cut the {len(data)}-byte "
                          "gzip stream into two non-empty parts")
    os.makedirs(dest, exist_ok=True)
    parts = []
    for i, chunk in enumerate((data[:first_bytes], data[first_bytes:]), 1):
        path = os.path.join(dest, f"{name}.part{i}")
        with open(path, "wb") as f:
            f.write(chunk)
        parts.append({"file": os.path.basename(path), "bytes": len(chunk),
                      "sha256": hashlib.sha256(chunk).hexdigest()})
    record = {"source": os.path.basename(src), "bytes": os.path.getsize(src),
              "sha256": sha256_file(src), "gzip_bytes": len(data), "parts": parts}
    with open(os.path.join(dest, f"{name}.json"), "w") as f:
        json.dump(record, f, indent=1)
    return record


def join(record: dict, parts: list[str], out: str) -> str:
    """Check each part's sha256, gunzip their concatenation into `out` (atomically) and
    check the result's sha256 against the original's: byte-exact or an error."""
    if len(parts) != len(record["parts"]):
        raise TravelError(f"{len(parts)} parts given, the record lists {len(record['parts'])}")
    for path, want in zip(parts, record["parts"]):
        if not os.path.isfile(path):
            raise TravelError(f"part {path} is missing (carried by the other call: were the "
                              "two calls back to back on one warm machine?)")
        got = sha256_file(path)
        if got != want["sha256"]:
            raise TravelError(f"part {path}: sha256 {got}, expected {want['sha256']}")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp = out + ".partial"

    class _Cat(io.RawIOBase):  # the parts as one stream, without a copy on disk
        def __init__(self):
            self.files = [open(p, "rb") for p in parts]

        def readable(self):
            return True

        def readinto(self, b):
            while self.files:
                n = self.files[0].readinto(b)
                if n:
                    return n
                self.files.pop(0).close()
            return 0

    with gzip.GzipFile(fileobj=io.BufferedReader(_Cat(), _CHUNK)) as src, open(tmp, "wb") as f:
        shutil.copyfileobj(src, f, _CHUNK)
    got = sha256_file(tmp)
    if got != record["sha256"]:
        os.unlink(tmp)
        raise TravelError(f"joined file sha256 {got}, expected {record['sha256']}")
    os.replace(tmp, out)
    return got


def balanced_first_part(gzip_bytes: int, call1_other: int, call2_other: int) -> int:
    """Where to cut the gzip stream so that both calls send about as much: call 1 sends
    part 1 + `call1_other` bytes, call 2 part 2 + `call2_other` (each: tree + carries)."""
    cut = (gzip_bytes + call2_other - call1_other) // 2
    return min(max(cut, 1), gzip_bytes - 1)


# ---- what a call sends --------------------------------------------------------------------

def _git(repo: str, *args: str) -> list[str]:
    out = subprocess.run(["git", "-C", repo, args[0], "-z", *args[1:]], check=True,
                         capture_output=True).stdout.decode()
    return [p for p in out.split("\0") if p]


def tree_files(repo: str) -> dict[str, list[tuple[str, int]]]:
    """What the tool sends of the working tree now: tracked files present in it (a sparse
    checkout leaves the others out), untracked files git does not ignore, and shared/."""
    sized = lambda paths: [(p, os.lstat(os.path.join(repo, p)).st_size) for p in paths
                           if os.path.lexists(os.path.join(repo, p))]
    tracked = sized(_git(repo, "ls-files"))
    untracked = sized(_git(repo, "ls-files", "--others", "--exclude-standard"))
    shared = os.path.join(repo, "shared")
    extra = [("shared/", path_bytes(shared))] if os.path.isdir(shared) else []
    return {"tracked": tracked, "untracked": untracked, "shared": extra}


def planned_tree_bytes(repo: str, keep: list[str]) -> dict:
    """What the tree would send after a sparse checkout of `keep` (paths: folders or
    files), measured before it: tracked files under `keep`, plus what a sparse checkout
    leaves in place anyway (untracked files not ignored, tracked files with local changes,
    shared/)."""
    now = tree_files(repo)
    inside = set(_git(repo, "ls-files", "--", *keep))
    changed = set(_git(repo, "ls-files", "--modified"))
    sizes = dict(now["tracked"])
    kept = [(p, sizes.get(p, 0)) for p in sorted(inside)]
    stay = [(p, sizes[p]) for p in sorted(changed - inside) if p in sizes]
    total = sum(s for _, s in kept + stay + now["untracked"] + now["shared"])
    return {"bytes": total, "tracked": sum(s for _, s in kept),
            "left_in_place": stay + now["untracked"] + now["shared"]}


def measure(repo: str, carry: list[str], limit: int = TREE_LIMIT) -> dict:
    """Bytes one call would send (tree now + each carried path); TravelError past `limit`,
    naming the biggest things that travel."""
    files = tree_files(repo)
    tree = sum(s for group in files.values() for _, s in group)
    carried = {c: path_bytes(os.path.join(repo, c)) for c in carry}
    missing = [c for c in carry if not os.path.lexists(os.path.join(repo, c))]
    if missing:
        raise TravelError(f"carried path(s) {missing} do not exist (run prepare.sh first)")
    if len(carry) > 8:
        raise TravelError(f"{len(carry)} carried paths: the tool takes 8 at most")
    total = tree + sum(carried.values())
    report = {"tree_bytes": tree, "carry_bytes": carried, "total_bytes": total,
              "limit_bytes": limit}
    if total > limit:
        big = sorted(((p, s) for group in files.values() for p, s in group),
                     key=lambda x: -x[1])[:8]
        raise TravelError(
            f"this call would send {total / MIB:.1f} MiB (tree {tree / MIB:.1f} MiB + carried "
            f"{sum(carried.values()) / MIB:.1f} MiB), over {limit / MIB:.0f} MiB (the tool's "
            f"limit is 64 MiB). Shrink the tree (README: sparse checkout) or carry less. "
            "Biggest in the tree: " + ", ".join(f"{p} {s / MIB:.1f} MiB" for p, s in big))
    return report


# ---- what comes back ----------------------------------------------------------------------

def check_out(folder: str) -> list[str]:
    """Problems that would keep files of `folder` ($OUT) from coming back ([]: none)."""
    problems, files, total = [], 0, 0
    for root, dirs, names in os.walk(folder):
        rel = os.path.relpath(root, folder)
        depth = 0 if rel == "." else rel.count(os.sep) + 1
        for n in dirs + names:
            if not OUT_NAME.match(n):
                problems.append(f"{os.path.join(rel, n)}: name outside [A-Za-z0-9._-]")
        for n in names:
            path = os.path.join(root, n)
            if os.path.islink(path) or not os.path.isfile(path):
                problems.append(f"{os.path.join(rel, n)}: not a plain file")
                continue
            files += 1
            size = os.path.getsize(path)
            total += size
            if size > OUT_MAX_FILE:
                problems.append(f"{os.path.join(rel, n)}: {size / MIB:.1f} MiB > 16 MiB")
            if depth > OUT_MAX_DEPTH:
                problems.append(f"{os.path.join(rel, n)}: more than 2 folders down")
    if files > OUT_MAX_FILES:
        problems.append(f"{files} files > {OUT_MAX_FILES}")
    if total > OUT_MAX_TOTAL:
        problems.append(f"{total / MIB:.1f} MiB in all > 64 MiB")
    return problems


def pack_corpus(corpus: str, out_dir: str, stem: str, max_archives: int = 2,
                max_bytes: int = OUT_MAX_FILE - MIB) -> dict:
    """The corpus's shards as at most `max_archives` .tar.gz files of at most `max_bytes`
    each (shards are compressed .npz: their raw size bounds the archive's). Shards are
    taken in index order; those past the limit are dropped and listed, and the manifest
    packed (in the first archive) lists only the shards packed, so the unpacked folder is a
    valid corpus that `dblast data regenerate` resumes with the dropped shards."""
    with open(os.path.join(corpus, "manifest.json")) as f:
        manifest = json.load(f)
    shards = sorted(manifest["shards"], key=lambda e: e["index"])
    groups: list[list[dict]] = [[]]
    used = 4096  # the manifest and tar headers
    dropped = []
    for e in shards:
        size = os.path.getsize(os.path.join(corpus, e["file"])) + 1024
        if not dropped and used + size > max_bytes and groups[-1] and len(groups) < max_archives:
            groups.append([])
            used = 4096
        if dropped or used + size > max_bytes:  # a prefix is kept: no hole in the shards
            dropped.append(e)
            continue
        groups[-1].append(e)
        used += size
    kept = [e for g in groups for e in g]
    new = dict(manifest, shards=kept, complete=len(kept) == manifest["num_shards"])
    new["totals"] = {"shards": len(kept),
                     **{k: sum(e[k] for e in kept)
                        for k in ("sequences", "tokens", "response_tokens")},
                     "generation_seconds": round(sum(e.get("seconds", 0) for e in kept), 3)}
    os.makedirs(out_dir, exist_ok=True)
    archives = []
    for i, group in enumerate(g for g in groups if g):
        name = f"{stem}.tar.gz" if i == 0 else f"{stem}_{i + 1}.tar.gz"
        path = os.path.join(out_dir, name)
        with tarfile.open(path, "w:gz", compresslevel=6) as tar:
            if i == 0:
                data = json.dumps(new, indent=1).encode()
                info = tarfile.TarInfo("manifest.json")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            for e in group:
                tar.add(os.path.join(corpus, e["file"]), arcname=e["file"])
        if os.path.getsize(path) > OUT_MAX_FILE:
            raise TravelError(f"{path} is {os.path.getsize(path) / MIB:.1f} MiB > 16 MiB")
        archives.append(name)
    return {"archives": archives, "shards": len(kept),
            "dropped": [e["index"] for e in dropped], "sequences": new["totals"]["sequences"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("split")
    s.add_argument("src")
    s.add_argument("dest")
    s.add_argument("--first-bytes", type=int, required=True)
    s.add_argument("--name", default="gguf")
    j = sub.add_parser("join")
    j.add_argument("record")
    j.add_argument("out")
    j.add_argument("parts", nargs="+")
    t = sub.add_parser("tree-size")
    t.add_argument("--repo", default=".")
    t.add_argument("--patterns-file", required=True, help="sparse-checkout patterns")
    m = sub.add_parser("measure")
    m.add_argument("--repo", default=".")
    m.add_argument("--carry", nargs="*", default=[])
    m.add_argument("--limit-mib", type=float, default=TREE_LIMIT / MIB)
    b = sub.add_parser("balance")
    b.add_argument("gzip_bytes", type=int)
    b.add_argument("call1_other", type=int)
    b.add_argument("call2_other", type=int)
    c = sub.add_parser("pack-corpus")
    c.add_argument("corpus")
    c.add_argument("out_dir")
    c.add_argument("--stem", required=True)
    c.add_argument("--max-archives", type=int, default=2)
    c.add_argument("--max-mib", type=float, default=(OUT_MAX_FILE - MIB) / MIB)
    o = sub.add_parser("check-out")
    o.add_argument("folder")
    a = p.parse_args(argv)
    try:
        if a.cmd == "split":
            print(json.dumps(split(a.src, a.dest, a.first_bytes, a.name)))
        elif a.cmd == "join":
            with open(a.record) as f:
                print(join(json.load(f), a.parts, a.out))
        elif a.cmd == "tree-size":
            with open(a.patterns_file) as f:
                keep = [ln.strip().lstrip("/") for ln in f
                        if ln.strip() and not ln.startswith("#")]
            r = planned_tree_bytes(a.repo, keep)
            print(json.dumps({"bytes": r["bytes"], "tracked": r["tracked"],
                              "left_in_place": r["left_in_place"][:20]}))
        elif a.cmd == "measure":
            print(json.dumps(measure(a.repo, a.carry, int(a.limit_mib * MIB))))
        elif a.cmd == "balance":
            print(balanced_first_part(a.gzip_bytes, a.call1_other, a.call2_other))
        elif a.cmd == "pack-corpus":
            print(json.dumps(pack_corpus(a.corpus, a.out_dir, a.stem, a.max_archives,
                                         int(a.max_mib * MIB))))
        elif a.cmd == "check-out":
            problems = check_out(a.folder)
            if problems:
                raise TravelError(f"{a.folder} would not come back whole: "
                                  + "; ".join(problems))
            print(f"{a.folder}: within the tool's limits for files back")
    except TravelError as e:
        print(f"travel.py {a.cmd}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
