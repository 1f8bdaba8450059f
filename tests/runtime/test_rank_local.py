"""One rank's Python changes between steps and the others' does not (the Trainer's save on
rank 0 writes the model's config): that rank captures the step again, and so does every
rank, so that all run the same collectives, each its own Python, as eager does. Before, the
changed rank compiled while the others ran their program's all-gathers: gloo aborted the
processes. 2 gloo ranks; tolerance: parameters 1e-5 against eager with its gradients
averaged over the ranks."""

from harness import run_ranks
from rank_local_workers import STEPS, rank_local_worker


def test_a_change_on_one_rank_that_computes_nothing_trains_on():
    got = run_ranks(2, rank_local_worker, "tags")
    for r in got:
        assert len(r["losses"]) == STEPS and r["diff"] <= 1e-5, r


def test_a_change_on_one_rank_that_computes_is_each_ranks_own_step():
    got = run_ranks(2, rank_local_worker, "power")
    for r in got:
        assert len(r["losses"]) == STEPS and r["diff"] <= 1e-5, r
