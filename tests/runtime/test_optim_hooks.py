"""autoshard's optimizer hooks are process-wide only while they have work: registered with
the first sharded module, removed with the last; ``AUTOSHARD_OPTIMIZER_HOOKS=0``
(or ``optim.enable_hooks(False)``) keeps them out, and training stays correct without them.

The lifetime and the environment variable are checked in a fresh interpreter, since other
tests' sharded modules may be alive in this one."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from autoshard import autoshard
from autoshard.core.models import GPT
from autoshard.runtime import optim

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_LIFETIME = """
    import gc
    import torch
    from autoshard import autoshard
    from autoshard.core.models import GPT
    from autoshard.runtime import optim

    seen = [optim.hooks_installed()]
    first = autoshard(GPT())
    seen.append(optim.hooks_installed())
    second = autoshard(GPT())
    opt = torch.optim.AdamW(first.parameters())
    del first
    gc.collect()
    seen.append(optim.hooks_installed())  # the second still lives
    del second
    gc.collect()
    seen.append(optim.hooks_installed())  # none: an optimizer over their parameters is
    opt.step()  # a plain one now
    print(seen)
"""

# with the hooks off, ZeRO-1's replicas must still follow the optimizer: foreach updates
# advance no version counter, so only a noted update (or a gather every call) sees them
_OFF = """
    import torch
    from autoshard import Config, autoshard
    from autoshard.core.models import GPT, gpt_loss
    from autoshard.runtime import optim

    def train(strategy):
        torch.manual_seed(0)
        model = GPT()
        early = torch.optim.SGD(model.parameters(), lr=0.1)
        sharded = autoshard(model, config=Config(strategy=strategy))
        opt = torch.optim.AdamW(sharded.parameters(), lr=1e-2, foreach=True)
        g = torch.Generator().manual_seed(0)
        losses = []
        for _ in range(3):
            x = torch.randint(0, 96, (2, 16), generator=g)
            loss = gpt_loss(sharded(x), torch.roll(x, -1, 1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        early.step()  # built before autoshard(): not refused without the hooks
        return losses

    print(optim.hooks_installed(), train("zero1") == train("zero3"))
"""


def _run(script: str, **env) -> str:
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", textwrap.dedent(script)],
                         cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", **env},
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def test_hooks_are_registered_only_while_a_sharded_module_lives():
    assert _run(_LIFETIME, AUTOSHARD_OPTIMIZER_HOOKS="1") == "[False, True, True, False]"


def test_the_environment_switch_keeps_them_out_and_zero1_still_trains_right():
    assert _run(_OFF, AUTOSHARD_OPTIMIZER_HOOKS="0") == "False True"


@pytest.mark.filterwarnings("ignore:autoshard. no process group")
def test_enable_hooks_removes_and_restores_them():
    torch.manual_seed(0)
    sharded = autoshard(GPT())
    try:
        assert optim.hooks_installed()
        optim.enable_hooks(False)
        assert not optim.hooks_installed()
        opt = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
        x = torch.randint(0, 96, (2, 16))
        sharded(x).sum().backward()
        opt.step()  # the per-parameter loop: nothing switched it
        assert all(g["foreach"] is None for g in opt.param_groups)
        optim.enable_hooks(True)
        assert optim.hooks_installed()
    finally:
        optim._enabled = None
        optim._sync_hooks()
