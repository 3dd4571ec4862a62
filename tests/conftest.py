"""Shared fixtures: small configs and a prepared slice of the embedded corpus."""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# This process forks ranks and workers (tests/dist/harness.py, the dry run, nccl_check's --nproc, prepare's
# workers), so it must stay single-threaded: forking a multi-threaded process is unsafe, and Python >= 3.12 warns
# at every such fork. Set before anything here imports torch or tokenizes, unless the caller chose otherwise:
# - with more than one OpenMP thread, importing torch alone starts a pool thread (one thread per process is also
#   what concurrent ranks on a small machine need, see FACTS);
# - Hugging Face tokenizers starts its rayon pool at the first BPE training or batch encoding (the session's
#   corpus fixtures do both), and the threads stay.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# - tqdm starts a monitor thread with its first progress bar (transformers' and datasets' bars in the reference
#   comparisons) and keeps it for the life of the process; it only redraws stalled bars, which a test never looks at.
try:
    import tqdm
except ImportError:  # an optional dependency's dependency
    pass
else:
    tqdm.tqdm.monitor_interval = 0

from hpcdist import config as config_mod
from hpcdist.data import load_tokenizer, prepare_corpus, prepare_shards, stdlib_corpus, train_bpe

# pytest rewrites each test module's asserts when it imports it, and caches the result beside the source only where
# bytecode may be written: with PYTHONDONTWRITEBYTECODE set, every xdist worker rewrites all the test modules on every
# run (a third of each worker's collection). The rewrites are cached (pytest writes them atomically, in the
# checkout's __pycache__ directories); the environment variable still holds for every process the tests start.
sys.dont_write_bytecode = False

REPO = Path(__file__).resolve().parents[1]

# A model small enough that a 2-rank step takes milliseconds on a 2-core CI box, but with every part of the
# real architecture (GQA, RoPE, SwiGLU, several layers). peak_flops is fixed so no test measures the CPU.
SMALL = [
    "model.preset=tiny",
    "model.dim=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.ffn_dim=128",
    "data.seq_len=32",
    "optim.warmup_steps=2",
    "optim.lr=0.003",
    "logging.every_steps=1",
    "logging.tensorboard=false",
    "logging.peak_flops=1e11",
    "checkpoint.every_steps=0",
    "checkpoint.save_final=false",
]


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """200k tokens of the stdlib corpus, prepared once per test session."""
    out = tmp_path_factory.mktemp("corpus")
    return prepare_shards(stdlib_corpus(), out, max_tokens=200_000)


@pytest.fixture(scope="session")
def bpe_corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A jsonl corpus (80 stdlib sources as documents) through a 400-token byte-level BPE trained by the tool, the
    way README's local-files example goes: tokenizer train -> prepare -> train."""
    root = tmp_path_factory.mktemp("bpe_corpus")
    with open(root / "docs.jsonl", "w", encoding="utf-8") as fh:
        for path in stdlib_corpus()[:80]:
            fh.write(json.dumps({"text": path.read_text(encoding="utf-8", errors="replace")}) + "\n")
    train_bpe([root / "docs.jsonl"], vocab_size=400, out_dir=root / "tok")
    return prepare_corpus([root / "docs.jsonl"], root / "ds", tokenizer=load_tokenizer(root / "tok")).path


@pytest.fixture
def small_cfg(tmp_path: Path, corpus_dir: Path):
    """Factory: a validated small JobConfig in a fresh run dir; extra overrides win."""

    def make(*overrides: str, run_dir: Path | None = None) -> config_mod.JobConfig:
        return small_config(run_dir or tmp_path / "run", corpus_dir, *overrides)

    return make


def small_config(run_dir: Path, corpus_dir: Path, *overrides: str) -> config_mod.JobConfig:
    """What small_cfg makes, for fixtures wider than one test (a reference run trained once per module)."""
    base = [*SMALL, f"run.dir={run_dir}", "data.source=files", f"data.path={corpus_dir}"]
    return config_mod.load(None, [*base, *overrides])


class _ToCaplog(logging.Handler):
    """Hands the ``hpcdist`` logger's records to caplog while that logger does not propagate to the root.

    setup_logging sets ``propagate=False`` (its stdout handler prints each line once), and caplog listens on the
    root logger. pytest >= 9.2 also attaches caplog to the loggers that are non-propagating when a test phase
    starts, so a test whose own Trainer calls setup_logging mid-test saw its log lines only when an earlier test
    had called it first: the test passed in the suite's order and failed alone. Forwarding here, unless caplog
    is attached already (no duplicates), makes what caplog sees independent of order and of the pytest version.
    """

    def __init__(self, caplog: pytest.LogCaptureFixture) -> None:
        super().__init__(logging.NOTSET)
        self.caplog = caplog

    def emit(self, record: logging.LogRecord) -> None:
        logger = logging.getLogger("hpcdist")
        target = self.caplog.handler  # looked up each time: the handler of the current test phase
        if not logger.propagate and target not in logger.handlers:
            target.handle(record)


@pytest.fixture(autouse=True)
def _hpcdist_logs_reach_caplog(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    logger = logging.getLogger("hpcdist")
    forward = _ToCaplog(caplog)
    logger.addHandler(forward)
    try:
        yield
    finally:
        logger.removeHandler(forward)


@pytest.fixture(autouse=True)
def _environment_restored() -> Iterator[None]:
    """Every test gets the environment back as it found it: a rank environment (RANK, TORCHELASTIC_RUN_ID) left in
    a worker would make every later `hpcdist train` subprocess of that worker read itself as a torchrun rank."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


_SLURM_IDS = pytest.StashKey[set[str]]()


class _SlurmTierOnOneWorker:
    """pytest-xdist's scheduler for `-n N` (the README's test command): the SLURM tier is one unit of work, so one
    worker runs it, in order, against the one sandbox (node names and ports are machine-wide), and it goes first, so
    its jobs' waits (scheduling, requeue holds) overlap with the other workers' tests instead of ending the run.
    (xdist's own `--dist loadgroup` cannot group here: with pytest >= 9.2 it no longer renames an item's id.)"""

    @pytest.hookimpl(tryfirst=True)
    def pytest_xdist_make_scheduler(self, config: pytest.Config, log: object) -> object | None:
        if config.getvalue("dist") not in ("load", "loadgroup"):
            return None  # another mode was asked for (loadfile, worksteal, ...): xdist's own
        from xdist.scheduler import LoadScopeScheduling

        class SlurmTierTogether(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                return "tests/slurm" if nodeid.startswith("tests/slurm/") else nodeid

        return SlurmTierTogether(config, log)  # type: ignore[arg-type]


def _compile_package() -> None:
    """Write hpcdist's bytecode once, before any test starts a process. The run starts several hundred Python
    processes that import hpcdist (ranks, SLURM tasks, CLI calls); an editable install leaves its sources
    uncompiled, and where PYTHONDONTWRITEBYTECODE is set no process caches what it compiled, so each one compiled
    the package again (about 1 s of CPU per trainer process on a 2-core machine). Python reads a valid .pyc even
    with that variable set; pip compiled the installed dependencies alike."""
    import compileall

    compileall.compile_dir(REPO / "hpcdist", quiet=2, workers=1)


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the controller, before xdist's workers start: once per run
        _compile_package()
    if config.pluginmanager.hasplugin("xdist"):  # its hook exists only with the plugin
        config.pluginmanager.register(_SlurmTierOnOneWorker(), "hpcdist-slurm-tier-scheduler")


def _cpu_order(item: pytest.Item) -> int:
    """The unit tier before the multi-process tiers: unit tests wait (subprocesses, sleeps, timeouts) and leave a core
    idle, which the SLURM tier's jobs, running at the same time, use; a dist test keeps both cores busy alone, so
    those at the end leave no core idle while the last worker finishes (measured: the run's last ~150 s used one
    core of two when the unit tier came last)."""
    path = str(item.path)
    return 2 if "/tests/dist/" in path else 0 if "/tests/unit/" in path else 1


@pytest.hookimpl(trylast=True)  # after tests/slurm/conftest.py has marked (and ordered) its tests
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    slurm = [item for item in items if item.get_closest_marker("slurm")]
    config.stash[_SLURM_IDS] = {item.nodeid for item in slurm}
    ids = {id(item) for item in slurm}
    rest = sorted((item for item in items if id(item) not in ids), key=_cpu_order)  # stable: file order kept
    items[:] = slurm + rest  # the SLURM tier first: see above


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config) -> None:
    """Say in one line, last, whether the real-SLURM tier ran: a skipped tier must not pass unnoticed in `-q`."""
    # under xdist the workers collect, not this process: a report is a SLURM test's by its path
    slurm_ids = config.stash.get(_SLURM_IDS, set())

    def in_tier(nodeid: str) -> bool:
        return nodeid in slurm_ids or nodeid.startswith("tests/slurm/")

    reports = [
        r
        for kind in ("passed", "failed", "skipped", "error")
        for r in terminalreporter.stats.get(kind, [])
        if in_tier(getattr(r, "nodeid", "")) and getattr(r, "when", "call") in ("setup", "call")
    ]
    if not reports:
        return  # the tier was not selected (-m "not slurm", a single file): nothing to say
    skipped = {r.nodeid: r for r in reports if r.skipped}
    ran = {r.nodeid for r in reports if not r.skipped and r.when == "call"}
    if not skipped:
        terminalreporter.write_line(f"SLURM tier: ran {len(ran)} tests on a real slurmctld + slurmd")
        return
    reason = next(iter(skipped.values())).longrepr
    text = reason[2] if isinstance(reason, tuple) else str(reason)
    terminalreporter.write_line(
        f"SLURM tier: NOT RUN for {len(skipped)} of {len(skipped) + len(ran)} tests: {text.removeprefix('Skipped: ')}",
        red=True,
        bold=True,
    )
