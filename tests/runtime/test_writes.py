"""A ZeRO-1 model keeps a full replica of each parameter from one call to the next; any write
to the parameters between two calls (an optimizer step, or anything a training loop does
outside one) is read by the next call, with gradients or without, on 2 gloo ranks.

Tolerance: max |Δoutput| <= 1e-5 against eager on the parameters as they are after the write
(a stale replica is off by the size of the write, 1e-2 and more)."""

import pytest

from harness import run_ranks
from write_workers import WRITES, writes_worker

TOL = 1e-5


@pytest.fixture(scope="module")
def written():
    return run_ranks(2, writes_worker, ("gpt", "odd"))


@pytest.mark.parametrize("name", ["gpt", "odd"])
def test_the_call_after_a_write_reads_it(written, name):
    stale = {(rank, kind): r[(name, kind)][0] for rank, r in enumerate(written)
             for kind in WRITES if r[(name, kind)][0] > TOL}
    assert not stale, f"{name}: max |Δoutput| after a write: {stale}"
    for r in written:  # every write but p.data = ... changes the parameters
        assert {k for k in WRITES if r[(name, k)][1] > 1e-3} == set(WRITES) - {"data"}
