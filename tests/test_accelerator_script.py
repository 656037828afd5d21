"""experiments/flagship/accelerator/: the parts of the lent-accelerator procedure that can
be checked without the device or the model. The GGUF's gzip-and-split round trip is
byte-exact and refuses a damaged or missing part; a call's size is measured as the tool
counts it (tracked files present, untracked files not ignored, carried paths) and refused
over the limit, and a sparse checkout brings it under; $OUT is checked against the tool's
limits on what comes back; the new corpus is packed into at most two archives, dropping a
tail of shards (never a hole) with a manifest that lists what was packed; shrink_checkout.sh
refuses while another process works in the checkout and restores it afterwards."""

import hashlib
import json
import os
import subprocess
import sys
import tarfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.join(ROOT, "experiments", "flagship", "accelerator")
sys.path.insert(0, HERE)
import travel  # noqa: E402

MIB = 1 << 20


def _fake_model(path, size=3 * MIB + 12345):
    rng = __import__("random").Random(0)
    # half noise, half repetitive: like a quantized GGUF, gzip shrinks it a little
    data = bytes(rng.getrandbits(8) for _ in range(size // 2)) + b"blk.0.attn" * (size // 20)
    path.write_bytes(data[:size])
    return hashlib.sha256(data[:size]).hexdigest()


def test_split_and_join_are_byte_exact(tmp_path):
    digest = _fake_model(tmp_path / "model.gguf")
    rec = travel.split(str(tmp_path / "model.gguf"), str(tmp_path / "dev"), first_bytes=MIB)
    assert rec["sha256"] == digest and rec["gzip_bytes"] < rec["bytes"]
    assert [p["bytes"] for p in rec["parts"]] == [MIB, rec["gzip_bytes"] - MIB]
    assert json.load(open(tmp_path / "dev" / "gguf.json")) == rec
    parts = [str(tmp_path / "dev" / p["file"]) for p in rec["parts"]]
    out = tmp_path / "cache" / "sub" / "model.gguf"
    assert travel.join(rec, parts, str(out)) == digest
    assert out.read_bytes() == (tmp_path / "model.gguf").read_bytes()


def test_a_damaged_or_missing_part_is_refused_and_nothing_is_left(tmp_path):
    _fake_model(tmp_path / "model.gguf", size=MIB)
    rec = travel.split(str(tmp_path / "model.gguf"), str(tmp_path / "dev"), first_bytes=1000)
    parts = [str(tmp_path / "dev" / p["file"]) for p in rec["parts"]]
    with pytest.raises(travel.TravelError, match="back to back"):
        travel.join(rec, [parts[0], str(tmp_path / "absent")], str(tmp_path / "out.gguf"))
    with open(parts[1], "r+b") as f:
        f.seek(10)
        f.write(b"\0\0\0")
    with pytest.raises(travel.TravelError, match="sha256"):
        travel.join(rec, parts, str(tmp_path / "out.gguf"))
    assert not os.path.exists(tmp_path / "out.gguf")
    with pytest.raises(travel.TravelError, match="non-empty"):
        travel.split(str(tmp_path / "model.gguf"), str(tmp_path / "dev2"), first_bytes=0)


def test_the_cut_balances_the_two_calls():
    cut = travel.balanced_first_part(100, call1_other=30, call2_other=10)
    assert cut + 30 == (100 - cut) + 10
    assert travel.balanced_first_part(100, 500, 0) == 1  # never an empty part


def _git(repo, *args):
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


@pytest.fixture
def repo(tmp_path):
    """A repository with a big tracked corpus, small code, an ignored carry folder and an
    untracked file."""
    r = tmp_path / "repo"
    (r / "corpora").mkdir(parents=True)
    (r / "code").mkdir()
    (r / "corpora" / "big.npz").write_bytes(b"x" * (3 * MIB))
    (r / "code" / "a.py").write_text("print(1)\n")
    (r / ".gitignore").write_text("/.device/\n")
    _git(r, "init", "-q")
    _git(r, "add", ".")
    _git(r, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    (r / ".device").mkdir()
    (r / ".device" / "part").write_bytes(b"y" * MIB)
    (r / "notes.txt").write_text("untracked, not ignored: travels\n")
    return r


def test_a_call_over_the_limit_is_refused_naming_the_biggest_files(repo):
    with pytest.raises(travel.TravelError, match=r"corpora/big.npz 3.0 MiB"):
        travel.measure(str(repo), [".device/part"], limit=3 * MIB)
    ok = travel.measure(str(repo), [".device/part"], limit=5 * MIB)
    files = travel.tree_files(str(repo))
    assert ("notes.txt", 32) in files["untracked"]
    assert ok["carry_bytes"] == {".device/part": MIB}
    assert ok["total_bytes"] == ok["tree_bytes"] + MIB > 4 * MIB
    with pytest.raises(travel.TravelError, match="do not exist"):
        travel.measure(str(repo), [".device/absent"], limit=5 * MIB)


def test_a_sparse_checkout_brings_the_call_under_the_limit_as_planned(repo):
    planned = travel.planned_tree_bytes(str(repo), ["code/", ".gitignore"])
    _git(repo, "sparse-checkout", "set", "--no-cone", "/code/", "/.gitignore")
    assert not (repo / "corpora" / "big.npz").exists()
    report = travel.measure(str(repo), [".device/part"], limit=2 * MIB)
    assert report["tree_bytes"] == planned["bytes"] < 100
    _git(repo, "sparse-checkout", "disable")
    assert (repo / "corpora" / "big.npz").stat().st_size == 3 * MIB


def test_out_limits(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    for i in range(8):
        (out / f"f{i}.json").write_text("{}")
    assert travel.check_out(str(out)) == []
    (out / "f8.json").write_text("{}")
    (out / "a" / "b" / "c").mkdir(parents=True)
    (out / "a" / "b" / "c" / "deep.txt").write_text("x")
    with open(out / "big.tar", "wb") as f:
        f.truncate(17 * MIB)
    (out / "bad name!.txt").write_text("x")
    problems = "; ".join(travel.check_out(str(out)))
    for needle in ("12 files > 8", "big.tar: 17.0 MiB > 16 MiB", "more than 2 folders down",
                   "bad name!.txt: name outside"):
        assert needle in problems
    assert travel.main(["check-out", str(out)]) == 1


def _corpus(folder, sizes):
    folder.mkdir(parents=True)
    shards = []
    for i, size in enumerate(sizes):
        name = f"shard-{i:05d}.npz"
        (folder / name).write_bytes(os.urandom(size))
        shards.append({"index": i, "file": name, "sha256": "-", "sequences": 32,
                       "tokens": 100, "response_tokens": 60, "seconds": 1.5})
    manifest = {"format": "dblast-corpus-v1", "num_shards": 204, "shards": shards,
                "complete": False, "settings": {"seed": 3}}
    (folder / "manifest.json").write_text(json.dumps(manifest))


def test_the_corpus_is_packed_in_two_archives_and_a_tail_past_them_is_dropped(tmp_path):
    _corpus(tmp_path / "corpus", [100_000] * 7)
    r = travel.pack_corpus(str(tmp_path / "corpus"), str(tmp_path / "out"), "corpus_seed3",
                           max_archives=2, max_bytes=250_000)
    assert r["archives"] == ["corpus_seed3.tar.gz", "corpus_seed3_2.tar.gz"]
    assert (r["shards"], r["dropped"], r["sequences"]) == (4, [4, 5, 6], 128)
    with tarfile.open(tmp_path / "out" / "corpus_seed3.tar.gz") as tar:
        names = tar.getnames()
        manifest = json.load(tar.extractfile("manifest.json"))
    assert names == ["manifest.json", "shard-00000.npz", "shard-00001.npz"]
    assert [e["index"] for e in manifest["shards"]] == [0, 1, 2, 3]
    assert manifest["totals"]["sequences"] == 128 and manifest["complete"] is False
    everything = travel.pack_corpus(str(tmp_path / "corpus"), str(tmp_path / "out2"), "c")
    assert everything["dropped"] == [] and everything["archives"] == ["c.tar.gz"]


def _script_repo(repo):
    """The repo fixture with the accelerator scripts in place and prepared .device/."""
    dest = repo / "experiments" / "flagship" / "accelerator"
    dest.mkdir(parents=True)
    for name in ("shrink_checkout.sh", "travel.py"):
        (dest / name).write_bytes(open(os.path.join(HERE, name), "rb").read())
    (dest / "sparse_patterns.txt").write_text("# code only\n/code/\n/.gitignore\n"
                                              "/experiments/flagship/accelerator/\n")
    _git(repo, "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "scripts")
    for name in ("gguf.part1", "gguf.part2"):
        (repo / ".device" / name).write_bytes(b"z" * 1000)
    for name in ("drafter", "meta", "wheels", "data"):
        (repo / ".device" / name).mkdir()
    (repo / ".device" / "meta" / "manifest.json").write_text("{}")
    return dest / "shrink_checkout.sh"


def test_shrink_refuses_while_a_process_works_in_the_checkout_then_shrinks_and_restores(repo):
    script = _script_repo(repo)
    run = lambda *a: subprocess.run(["bash", str(script), *a], capture_output=True, text=True)
    busy = subprocess.Popen(["sleep", "60"], cwd=repo / "code")
    try:
        done = run("shrink")
        assert done.returncode == 1 and "processes work in" in done.stderr
        assert f"{busy.pid} sleep 60" in done.stderr
        assert (repo / "corpora" / "big.npz").exists()
    finally:
        busy.kill()
        busy.wait()
    done = run("shrink")
    assert done.returncode == 0, done.stderr
    assert not (repo / "corpora" / "big.npz").exists()
    assert "call 1: 0.0 MiB" in done.stdout and "call 2: 0.0 MiB" in done.stdout
    done = run("restore")
    assert done.returncode == 0 and "0 files left out" in done.stdout
    assert (repo / "corpora" / "big.npz").stat().st_size == 3 * MIB


def test_the_device_script_needs_out_unless_it_is_a_dry_run(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "DRY_RUN")}
    done = subprocess.run(["bash", os.path.join(HERE, "run_on_accelerator.sh")], env=env,
                          capture_output=True, text=True)
    assert done.returncode != 0 and "OUT is unset" in done.stderr


def test_the_schedule_is_sized_to_the_time_left():
    from train_until_deadline import planned_steps
    assert planned_steps(40, 0.1, 100.0, 20.0, 100000, 1) == 40 + 800
    assert planned_steps(40, 0.1, 100.0, 20.0, 500, 1) == 500  # the longest schedule
    assert planned_steps(40, 0.1, 5.0, 20.0, 500, 1) == 41  # late: one step more
    assert planned_steps(500, 0.1, 5.0, 20.0, 500, 1) == 500  # never past the longest


def _device_files(tmp_path, start_sha, next_leg=13, seed=3):
    """What run_on_accelerator.sh sends back, with stand-in weights."""
    out = tmp_path / "files"
    _corpus(tmp_path / "corpus_src", [1000] * 3)
    manifest = json.loads((tmp_path / "corpus_src" / "manifest.json").read_text())
    for e in manifest["shards"]:
        e["sha256"] = hashlib.sha256((tmp_path / "corpus_src" / e["file"]).read_bytes()).hexdigest()
    (tmp_path / "corpus_src" / "manifest.json").write_text(json.dumps(manifest))
    travel.pack_corpus(str(tmp_path / "corpus_src"), str(out), f"corpus_seed{seed}")
    export = tmp_path / "export"
    export.mkdir()
    (export / "config.json").write_text("{}")
    (export / "model.safetensors").write_bytes(b"new weights")
    with tarfile.open(out / "drafter.tar", "w") as tar:
        tar.add(export, arcname=".")
    rows = [{"step": 0, "cpu_s": 0.0, "time": 1.8e9, "al_estimate": 0.53, "top1": [0.2]},
            {"step": 900, "cpu_s": 120.0, "time": 1.8e9, "al_estimate": 0.56, "top1": [0.21],
             "wall_s": 300.0}]
    (out / "train_curve.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {"dry_run": False, "seed": seed, "device": "NVIDIA H100 80GB HBM3",
               "started_from": {"drafter": "experiments/flagship/k1/drafter",
                                "drafter_sha256": start_sha, "next_leg": next_leg},
               "train": {"steps": 900, "settings": {"batch_size": 64, "seq_len": 384,
                                                    "learning_rate": 0.001}}}
    (out / "summary.json").write_text(json.dumps(summary))
    return out


def test_results_unpack_into_a_corpus_folder_and_the_next_leg(tmp_path):
    from unpack_results import main as unpack
    keep = tmp_path / "keep"
    (keep / "drafter").mkdir(parents=True)
    (keep / "drafter" / "model.safetensors").write_bytes(b"old weights")
    legs = [{"leg": i, "steps": 3000, "training_cpu_s": 3000.0} for i in range(1, 13)]
    (keep / "legs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in legs))
    for i in range(1, 13):
        (keep / f"curve_leg{i}.jsonl").write_text(json.dumps(
            {"step": 0, "cpu_s": 0.0, "al_estimate": 0.5}) + "\n")
    files = _device_files(tmp_path, hashlib.sha256(b"old weights").hexdigest())
    corpus = tmp_path / "corpora" / "smollm2_t1_more_seed3"
    assert unpack([str(files), "--keep", str(keep), "--corpus_out", str(corpus)]) == 0
    assert sorted(os.listdir(corpus)) == ["manifest.json", "shard-00000.npz",
                                          "shard-00001.npz", "shard-00002.npz"]
    assert (keep / "drafter" / "model.safetensors").read_bytes() == b"new weights"
    row = json.loads((keep / "legs.jsonl").read_text().splitlines()[-1])
    assert (row["leg"], row["steps"], row["data"], row["batch_size"]) == (
        13, 900, "runs/corpora/smollm2_t0_t1pass7", 64)
    assert row["start"]["al_estimate"] == 0.53 and row["end"]["al_estimate"] == 0.56
    assert (keep / "curve_leg13.jsonl").exists() and (keep / "learning_curve.png").exists()
    # a second unpack: the chain moved on (its drafter is the new one), nothing is written
    with pytest.raises(SystemExit, match="no longer the drafter"):
        unpack([str(files), "--keep", str(keep), "--corpus_out", str(tmp_path / "again")])
    assert not (tmp_path / "again").exists()
