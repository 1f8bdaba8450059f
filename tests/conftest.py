import gc
import os


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


# A test process of n shares the cores with n - 1 others: the thread pools of torch (and of
# NumPy's BLAS) split them, in it and in every process it starts (ranks, torchrun, the CLI,
# the GPU script's stages). Set before torch is imported, which sizes its pools from it; as
# CI sets it. The README's command took 354 s without it, 338 s with it (CI: 316 s).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))  # set by pytest-xdist
if _WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, _cores() // _WORKERS))

import pytest  # noqa: E402
import torch  # noqa: E402

import chunkcache  # noqa: E402

os.environ["AUTOSHARD_VERIFY"] = "1"  # every pass is verified in every test, spawned ranks too
# before pytest-xdist starts its test processes, which then inherit it (tests/chunkcache.py)
CHUNKCACHE = chunkcache.activate()


def pytest_report_header(config):
    return f"frame-stack chunk cache (tests/chunkcache.py): {CHUNKCACHE}"


# The slowest modules (most spawn rank processes many times over; together about 20 of the
# whole suite's 34 minutes on 2 cores, run serially): marked ``slow``. The README's test
# command, the fast tier a newcomer runs, is ``python -m pytest -q -m "not slow" -n auto
# --dist loadgroup``; without ``-m "not slow"`` it runs every test. CI (``.ci/run``) runs that
# command, then ``-m slow``: every module, each tier on its own (tests/test_suite.py holds it).
SLOW = tuple(f"tests/{m}.py" for m in (
    "runtime/test_parity", "runtime/test_strategies", "runtime/test_predicted",
    "runtime/test_export", "runtime/test_commit", "runtime/test_checkpoint",
    "runtime/test_kernels", "runtime/test_moe", "runtime/test_faults",
    "test_readme", "test_depth", "test_cli", "test_teardown", "test_gpu_check",
    "runtime/test_export_reload_2d", "runtime/test_compile", "passes/test_remat_inplace"))


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.nodeid.split("::")[0]
        if module in SLOW:
            item.add_marker(pytest.mark.slow)
        if _shares_a_fixture(item):
            item.add_marker(pytest.mark.xdist_group(module))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _shares_a_fixture(item) -> bool:
    """Whether ``item`` uses a fixture set up once for its module (or class): its module's
    tests then run in one test process (``--dist loadgroup``), which sets it up once. Spread
    over two, each set it up: seen costing 70 s more for inductor's compiled steps."""
    info = getattr(item, "_fixtureinfo", None)
    return info is not None and any(
        d.scope in ("module", "class", "package")
        for defs in info.name2fixturedefs.values() for d in defs)


# Test processes ``-n auto`` starts (pytest-xdist): one per core, at most four. Each keeps its
# own rank pools (tests/rankpool.py: 1, 2 and 4 ranks): two took 6.5 GB at most on 2 cores
# (the whole machine's use), four would take some 13. On 2 cores two halve the suite's time
# (483-675 s against 1,049-1,220 s run serially; three processes (653 s) and ``--dist
# loadfile`` (623 s), measured on a slower machine, were no faster). ``--dist loadgroup``
# hands out one test (or one group, ``_shares_a_fixture``) at a time to whichever process is
# free, the largest groups first; ``worksteal`` split modules whose tests share a fixture.
MAX_WORKERS = 4


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: without it, pytest runs serially
def pytest_xdist_auto_num_workers(config):
    return max(1, min(_cores(), MAX_WORKERS))


def pytest_configure(config):
    if not config.pluginmanager.hasplugin("xdist"):  # its marker, which the groups above use
        config.addinivalue_line("markers", "xdist_group(name): run in one pytest-xdist process")


def pytest_sessionfinish(session, exitstatus):
    """Stop the pooled rank processes (tests/rankpool.py) the session started."""
    from rankpool import RankPool

    RankPool.close_all()


def pytest_unconfigure(config):
    """Collect the session's garbage until none is left, then freeze what lives on. pytest
    collects five times over after this, for objects whose finalizers raise, and the
    interpreter's exit once more: each a walk of every object the session made (test
    processes of the whole suite hold millions). With the survivors frozen those walks are
    short: 3.8 s less at the end of a process that ran three of the planner's modules."""
    for _ in range(5):
        if not gc.collect():
            break
    gc.freeze()
