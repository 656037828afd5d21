"""experiments/flagship/ship.py: a flagship chain's export goes into a pretrained tree with
its token counts and a manifest entry that says how it was made (steps and CPU of every
leg, its corpora, the commands); a chain with nothing to ship is refused, nothing written."""

import json
import os
import subprocess
import sys

from conftest import make_corpus, ship_random_drafter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIP = os.path.join(ROOT, "experiments", "flagship", "ship.py")


def _ship(keep, out, root, name="tiny-flagship", *flags):
    return subprocess.run([sys.executable, SHIP, f"--keep={keep}", f"--name={name}",
                           f"--out={out}", "--target=tiny-llama", f"--root={root}", *flags],
                          capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))


def _chain_with_export(tmp_path, name):
    """KEEP = tmp_path/name holding a tiny random export as its drafter, and a corpus."""
    ship_random_drafter(tmp_path / "src", "tiny-llama", 4)
    keep = tmp_path / name
    os.makedirs(keep)
    os.rename(tmp_path / "src" / "export", keep / "drafter")
    return keep, make_corpus(tmp_path / "corpus")


def test_a_chain_ships_with_token_counts_and_its_history(tmp_path):
    keep, corpus = _chain_with_export(tmp_path, "keep")
    legs = [{"leg": 1, "steps": 100, "training_cpu_s": 50.0, "data": "corpora/a",
             "prior_cpu_s": 2100},
            {"leg": 2, "steps": 300, "training_cpu_s": 150.0, "data": str(corpus), "k": 1,
             "drafter_layers": 1, "end": {"al_estimate": 0.5, "hot/al_estimate": 0.7,
                                          "greedy_accepted": 0.2,
                                          "greedy/greedy_accepted": 0.6, "top1": [0.1]}}]
    (keep / "legs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in legs))
    done = _ship(keep, tmp_path / "out", tmp_path / "pretrained")
    assert done.returncode == 0, done.stderr
    manifest = json.loads((tmp_path / "pretrained" / "manifest.json").read_text())
    entry = manifest["drafters"]["tiny-flagship"]
    assert entry["steps"] == 2000 + 400 and entry["training_cpu_s"] == 2300
    assert entry["experiment"] == "smollm2_k1_al" and entry["chain"] == "keep"
    assert "corpora/a" in entry["data"] and str(corpus) in entry["data"]
    assert entry["held_out_at_last_leg_end"] == {"al_estimate": 0.5, "hot/al_estimate": 0.7,
                                                 "greedy/greedy_accepted": 0.6}
    assert set(entry["files"]) == {"config.json", "model.safetensors", "token_counts.npy"}
    assert str(corpus) in entry["token_counts"] and "plain DFlash" in entry["description"]
    shipped = tmp_path / "pretrained" / entry["folder"]
    assert sorted(os.listdir(shipped)) == sorted(entry["files"])


def test_a_chain_without_a_finished_leg_or_an_export_is_refused(tmp_path):
    keep = tmp_path / "keep"
    os.makedirs(keep / "drafter")
    done = _ship(keep, tmp_path / "out", tmp_path / "pretrained")
    assert done.returncode != 0 and "drafter/config.json is missing" in done.stderr
    (keep / "drafter" / "config.json").write_text("{}")
    done = _ship(keep, tmp_path / "out", tmp_path / "pretrained")
    assert done.returncode != 0 and "records no finished leg" in done.stderr
    (keep / "legs.jsonl").write_text(json.dumps(
        {"leg": 1, "steps": 1, "training_cpu_s": 1.0, "data": str(tmp_path / "gone")}) + "\n")
    done = _ship(keep, tmp_path / "out", tmp_path / "pretrained")
    assert done.returncode != 0 and f"{tmp_path / 'gone'} (its token counts) is missing" \
        in done.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "pretrained").exists()


def test_a_grown_chain_says_where_its_first_leg_started(tmp_path):
    keep, corpus = _chain_with_export(tmp_path, "k4")
    (keep / "legs.jsonl").write_text(json.dumps(
        {"leg": 1, "init": "experiments/flagship/k1/drafter", "steps": 1000, "k": 4,
         "training_cpu_s": 2400.0, "prior_cpu_s": 24562, "data": str(corpus),
         "end": {"al_estimate": 0.5, "al_estimate_mixture": 0.52}}) + "\n")
    done = _ship(keep, tmp_path / "out", tmp_path / "pretrained", "tiny-k4",
                 "--prior_steps=25000")
    assert done.returncode == 0, done.stderr
    entry = json.loads((tmp_path / "pretrained" / "manifest.json").read_text())[
        "drafters"]["tiny-k4"]
    assert entry["steps"] == 26000 and entry["training_cpu_s"] == 26962
    assert entry["experiment"] == "smollm2_dblast_k4_al"
    assert ("its first leg started from experiments/flagship/k1/drafter (a drafter of "
            "25,000 steps): 1 leg of" in entry["description"])
    assert "plain DFlash" not in entry["description"]
    assert entry["command"].startswith("K=4 bash experiments/flagship/train_on_grown_corpus.sh")
    assert "# the next leg; 1 leg, each" in entry["command"]
    assert entry["command"].endswith("--name=tiny-k4 --out=OUT --prior_steps=25000")
    assert entry["held_out_at_last_leg_end"] == {"al_estimate": 0.5,
                                                 "al_estimate_mixture": 0.52}
