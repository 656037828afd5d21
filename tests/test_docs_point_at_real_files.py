"""The write-ups name the files behind their numbers: a renamed results folder or a log
section missing from the contents should fail here, not in a reader's hands."""
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# backticked repository paths; placeholders (OUT, {a,b}, globs, <...>) are not files
REPO_PATH = re.compile(r"`((?:experiments|corpora|pretrained|docs|dblast_jax|tests)/[^`\s]*)`")


def _read(relative: str) -> str:
    with open(os.path.join(ROOT, relative)) as f:
        return f.read()


def _named_paths(text: str) -> set[str]:
    paths = set()
    for path in REPO_PATH.findall(text):
        path = path.rstrip("/.,")
        if any(mark in path for mark in ("{", "*", "<", "OUT", ":")):
            continue
        paths.add(path)
    return paths


@pytest.mark.parametrize("doc", ["RESULTS.md", "experiments/README.md"])
def test_every_path_a_results_page_names_exists(doc):
    missing = sorted(p for p in _named_paths(_read(doc))
                     if not os.path.exists(os.path.join(ROOT, p)))
    assert not missing, f"{doc} names paths that are not in the repository: {missing}"


def test_the_path_check_sees_a_missing_path():
    assert _named_paths("see `experiments/x/results_gone/` and `experiments/{a,b}/`") == {
        "experiments/x/results_gone"}


def test_the_research_log_contents_list_every_section():
    log = _read("docs/research_log.md")
    sections = re.findall(r"^## (\d+\. .+)$", log, flags=re.M)
    listed = set(re.findall(r"^- (\d+\. .+)$", log, flags=re.M))
    assert sections, "no numbered sections found"
    assert [s for s in sections if s not in listed] == []
