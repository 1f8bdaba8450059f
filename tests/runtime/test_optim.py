"""The user's optimizer over autoshard's CPU parameters takes the foreach path, bit for bit
equal to the per-parameter loop, and leaves its param groups as the user set them."""

import copy

import pytest
import torch

from autoshard import autoshard
from autoshard.models import GPT, gpt_loss
from autoshard.runtime import optim


def _train(make_opt, steps=4):
    torch.manual_seed(0)
    sharded = autoshard(GPT())
    opt = make_opt(sharded.parameters())
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randint(0, 96, (2, 16), generator=g)
        gpt_loss(sharded(x), torch.roll(x, -1, 1)).backward()
        opt.step()
        opt.zero_grad()
    return sharded, opt


OPTIMIZERS = {
    "adamw": lambda ps, **k: torch.optim.AdamW(ps, lr=1e-2, **k),
    "adam_l2": lambda ps, **k: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1, **k),
    "sgd_nesterov": lambda ps, **k: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True,
                                                   weight_decay=0.01, **k),
    "rmsprop": lambda ps, **k: torch.optim.RMSprop(ps, lr=1e-3, centered=True, momentum=0.5,
                                                  **k),
}


@pytest.mark.filterwarnings("ignore:autoshard. no process group")
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_default_flags_equal_the_per_parameter_loop_bit_for_bit(name, monkeypatch):
    make = OPTIMIZERS[name]
    calls = []
    real = torch._foreach_add_
    monkeypatch.setattr(torch, "_foreach_add_", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    fast, opt = _train(make)
    assert calls, "the default-flag optimizer did not take the foreach path"
    assert all(g["foreach"] is None for g in opt.param_groups)  # restored after each step
    calls.clear()
    loop, _ = _train(lambda ps: make(ps, foreach=False))
    assert not calls
    for (n, a), b in zip(fast.named_parameters(), loop.parameters()):
        assert torch.equal(a.to_local(), b.to_local()), n


@pytest.mark.filterwarnings("ignore:autoshard. no process group")
def test_groups_the_user_configured_and_other_tensors_are_left_alone():
    torch.manual_seed(0)
    sharded = autoshard(GPT())
    plain = torch.nn.Parameter(torch.randn(3))
    opt = torch.optim.AdamW([{"params": list(sharded.parameters()), "foreach": False},
                             {"params": [plain]}])
    assert not optim._eligible(opt.param_groups[0])  # the user chose the loop
    assert not optim._eligible(opt.param_groups[1])  # not autoshard's parameters
    nadam = torch.optim.NAdam(copy.copy(list(sharded.parameters())))
    assert optim._eligible(nadam.param_groups[0])
    optim._pre(nadam, (), {})  # NAdam's foreach arithmetic differs: it keeps the loop
    assert nadam.param_groups[0]["foreach"] is None
