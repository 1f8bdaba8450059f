import os

import pytest
import torch

os.environ["AUTOSHARD_VERIFY"] = "1"  # every pass is verified in every test, spawned ranks too


# The slowest modules (most spawn rank processes many times over; together about 20 of the
# whole suite's 34 minutes on 2 cores): marked ``slow``. The README's test command, which CI
# runs within its time limit, is ``python -m pytest -q -m "not slow"``; ``python -m pytest
# -q`` runs every test.
SLOW = tuple(f"tests/{m}.py" for m in (
    "runtime/test_parity", "runtime/test_strategies", "runtime/test_predicted",
    "runtime/test_export", "runtime/test_commit", "runtime/test_checkpoint",
    "runtime/test_kernels", "runtime/test_moe", "runtime/test_faults",
    "test_readme", "test_depth", "test_cli", "test_teardown"))


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.split("::")[0] in SLOW:
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_sessionfinish(session, exitstatus):
    """Stop the pooled rank processes (tests/rankpool.py) the session started."""
    from rankpool import RankPool

    RankPool.close_all()
