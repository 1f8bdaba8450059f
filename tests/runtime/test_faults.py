"""Faults across ranks end in an AutoshardError on every live rank, naming what went wrong;
no process aborts (gloo, world size 2)."""

import math
import re

import pytest

from fault_workers import fault_worker, hang_worker, message_worker
from harness import run_ranks


CASES = ["partial_batch", "eval_on_rank0", "dtype_on_rank1", "skipped_backward",
         "refused_sync"]


@pytest.fixture(scope="module")
def out_of_step():
    return run_ranks(2, fault_worker, CASES, fresh=True)  # timeouts break the group


@pytest.mark.parametrize("case", CASES)
def test_ranks_out_of_step_get_an_error_naming_each_rank(out_of_step, case):
    results = [r[case] for r in out_of_step]
    for rank, r in enumerate(results):
        msg = r["error"]
        assert "not at the same step" in msg, (rank, msg)
        assert "rank 0:" in msg and "rank 1:" in msg, msg
    if case != "eval_on_rank0":  # the group is intact and the step counts agree: it trains
        assert all(r["after"] == "ok" for r in results), results
    if case == "partial_batch":
        assert "args[0] float32[4, 8]" in results[0]["error"]
        assert "args[0] float32[3, 8]" in results[0]["error"]
    if case == "dtype_on_rank1":
        assert "parameters float64" in results[0]["error"], results[0]["error"]
    if case == "refused_sync":
        assert "backward" in results[0]["error"] and "forward" in results[0]["error"]
    if case == "eval_on_rank0":
        assert "eval, no grad" in results[0]["error"] and "train, grad" in results[0]["error"]


@pytest.mark.parametrize("where", ["before", "inside", "inside-compiled"])
def test_a_rank_that_hangs_is_named_after_the_timeout(where):
    """autoshard creates the process group (torchrun environment) with Config(timeout=3)."""
    live = run_ranks(2, hang_worker, where, torchrun_env=True)[0]
    msg = live["error"]
    assert "step" in msg and "peer ranks [1] within 3 s" in msg, msg
    assert "own timeout" not in msg
    assert live["seconds"] < 30 and live["group_timeout"] == 3.0  # Config.timeout's
    if where == "before":
        assert "agreement before step 2: forward" in msg, msg
    else:
        assert "all-gather of unit 1" in msg and "forward" in msg, msg


@pytest.mark.parametrize("where", ["before", "inside"])
def test_a_timeout_is_reported_as_the_process_groups_own(where):
    """The ranks made the group with a 3 s timeout; Config.timeout is left at 300 s."""
    live = run_ranks(2, hang_worker, f"own-group:{where}", torchrun_env=True)[0]
    msg = live["error"]
    assert "peer ranks [1] within 3 s (the process group's own timeout; Config.timeout=300 " \
           "sets only a group autoshard creates)" in msg, msg
    assert live["group_timeout"] == 3.0 and live["seconds"] < 30


MESSAGES = ["config_differs", "extra_layer", "first_difference", "int64_input", "nan_inputs",
            "empty_batch", "meta_input", "two_models", "ddp", "group_timeouts"]


@pytest.fixture(scope="module")
def messages():
    results = run_ranks(2, message_worker, MESSAGES, fresh=True)  # groups with timeouts
    return {case: [r[case] for r in results] for case in MESSAGES}


def test_a_config_that_differs_between_ranks_is_named(messages):
    for r in messages["config_differs"]:
        assert r["error"].startswith(
            "Config.prefetch differs between ranks: rank 0: Prefetch(depth=2, bytes=None), "
            "rank 1: Prefetch(depth=3, bytes=None)."), r["error"]
        assert "partial" not in r["error"] and r["untouched"]


def test_a_parameter_that_differs_between_ranks_is_named(messages):
    for r in messages["extra_layer"]:
        msg = r["error"]
        assert "the model differs between ranks at parameter 'layers.3.weight':\n" \
               "  rank 0: 'layers.3.weight' float32[8, 8]\n" \
               "  rank 1: (no such parameter; module 'layers' (ModuleList) holds 3 " \
               "modules)" in msg, msg
        assert "rank 0: 10 parameters, rank 1: 8 parameters" in msg and "partial" not in msg


def test_the_first_difference_of_long_lists_is_found_within_the_notes(messages):
    """20000 parameter lines do not fit one 2048-byte note: digests of slices narrow it."""
    for r in messages["first_difference"]:
        assert r["at"] == [12345, 19999, None]


def test_an_input_of_a_dtype_the_model_cannot_take_fails_at_capture(messages):
    for r in messages["int64_input"]:
        msg = r["error"]
        assert msg.startswith("AutoshardError: autoshard could not capture"), msg
        assert "module 'a' (Linear) op aten.addmm.default needs its tensors in one dtype" in msg
        assert "mat1 int64" in msg and "the call's input args[0] int64[4, 8]" in msg
        assert "fault_workers.py" in msg and "self.a(x)" in msg  # the source line
        assert r["ran"] == 0  # no program ran: none of the step's collectives was issued
        assert r["after"] == "ok"


def test_nan_and_inf_inputs_train_as_eager_does(messages):
    r0, r1 = messages["nan_inputs"]
    assert r0["equal"] and r1["equal"]  # gradients and parameters, NaN where eager's are
    assert math.isnan(r0["losses"][0][0]) and math.isnan(r0["eager_losses"][0][0])
    assert all(math.isnan(x) for r in (r0, r1) for x in r["losses"][1] + r["eager_losses"][1])


def test_an_empty_batch_trains_as_eager_does(messages):
    for r in messages["empty_batch"]:
        assert r["equal"]  # zero gradients, then the next batch as eager
        assert math.isnan(r["losses"][0][0]) and math.isnan(r["eager_losses"][0][0])


def test_an_input_on_the_meta_device_is_named(messages):
    for r in messages["meta_input"]:
        assert r["error"].startswith("input args[0] (float32[4, 8]) is on the meta device"), \
            r["error"]
        assert r["after"] == "ok"


def test_two_sharded_models_train_interleaved_as_eager(messages):
    for r in messages["two_models"]:
        assert r["equal"]
        assert len(r["losses"]) == 3 and len(r["losses"][0]) == 2


def test_a_model_wrapped_in_ddp_is_refused_naming_ddp(messages):
    for r in messages["ddp"]:
        assert "is already distributed by DistributedDataParallel" in r["error"], r["error"]
        assert "pass the wrapped module (ddp.module) to autoshard()" in r["error"]
        assert r["untouched"] and r["after"] == "ok"


def test_the_groups_autoshard_creates_wait_config_timeout(messages):
    """The agreement's own gloo group (here for a 2-D mesh) and, in the hang tests above,
    the default group autoshard makes from a torchrun environment."""
    assert [r["agreement"] for r in messages["group_timeouts"]] == [7.0, 7.0]


def test_sigterm_to_one_rank_under_torchrun():
    """torchrun stops every rank when one fails, and exits naming it;
    the live rank, reaching the next step first, names the lost peer. Polling its workers
    every 2 s (default 0.1 s) makes the live rank's error reach the output surely."""
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([root, os.path.dirname(here), here]))
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "2", "--monitor-interval", "2",
                          os.path.join(here, "fault_workers.py")],
                         env=env, capture_output=True, text=True, timeout=120)
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    assert "rank 0 after" in text and "rank 0: no answer from peer ranks [1]" in text, \
        text
    # torchrun's report: rank 1 stopped by the signal (the root cause, or rank 0 if its own
    # exit was observed in the same second)
    assert re.search(r"rank\s+: 1 \(local_rank: 1\)\s+exitcode\s+: -15", text), text
    assert "Signal 15 (SIGTERM) received by PID" in text, text
    waited = float(re.search(r"rank 0 after ([\d.]+) s", text).group(1))
    assert waited < 20  # the lost connection, not the 20 s timeout
