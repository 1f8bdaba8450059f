"""Train a tiny model 3 steps with autoshard on the ranks torchrun starts, then simply end.

    python -m torch.distributed.run --nproc-per-node 2 tests/teardown_script.py [--own-group]

Without ``--own-group`` autoshard makes the process group from torchrun's environment and the
script ends without synchronising or destroying anything; with it the script makes the group
itself and destroys it at its end, as torch asks. Either way the model lives in the module's
globals until the interpreter finalises. Every rank must exit 0 (tests/test_teardown.py).

``--fail-in-flight``: then rank 0 fails with a collective issued that rank 1, stuck elsewhere,
never joins, as an error inside a step leaves one; rank 0 must exit at once, not at the
group's timeout.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

from autoshard import autoshard

own_group = "--own-group" in sys.argv[1:]
torch.set_num_threads(1)
if own_group:
    dist.init_process_group("gloo")
torch.manual_seed(0)
model = autoshard(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                      torch.nn.Linear(32, 4)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    loss = model(torch.randn(8, 16)).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
if "--fail-in-flight" in sys.argv[1:]:
    if dist.get_rank() == 0:
        torch.ops._c10d_functional.all_reduce(torch.ones(4), "sum", dist.group.WORLD.group_name)
        raise RuntimeError("rank 0 failed with a collective in flight")
    time.sleep(90)  # stuck elsewhere: only rank 0's exit ends the run (torchrun stops us)
if own_group:
    dist.destroy_process_group()
