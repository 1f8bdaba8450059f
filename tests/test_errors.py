import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from autoshard import AutoshardError, Config, autoshard
from autoshard.core.models import GPT


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(4, 4)

    def forward(self, x):
        h = self.gate(x)
        if h.sum() > 0:  # data-dependent Python control flow
            return h * 2
        return h


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Branchy()
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.inner(x))


@torch.library.custom_op("autoshard_test::opaque", mutates_args=())
def opaque(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


class Opaque(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return opaque(self.lin(x))


def test_data_dependent_control_flow_names_module_op_and_line():
    model = autoshard(Outer())
    with pytest.raises(AutoshardError) as e:
        model(torch.randn(2, 4))
    msg = str(e.value)
    assert "module 'inner' (Branchy)" in msg
    assert "_local_scalar_dense" in msg
    assert "if h.sum() > 0" in msg and "test_errors.py" in msg
    assert "torch.where" in msg
    assert "full_state_dict()" in msg  # the parameters are sharded: how to get them back


def test_failed_capture_keeps_full_parameters_recoverable():
    torch.manual_seed(0)
    ref = Outer()
    torch.manual_seed(0)
    model = autoshard(Outer())
    with pytest.raises(AutoshardError):
        model(torch.randn(2, 4))
    full = model.full_state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(full[k], v)


@pytest.mark.parametrize("up_front", [False, True])
def test_an_int64_input_to_a_linear_fails_at_capture_naming_it(up_front):
    """World size 1: the first call (or example_inputs) refuses it at capture; eager's own
    error (mat1 and mat2 must have the same dtype) came only from running the graph."""
    x = torch.randint(0, 5, (2, 4))
    with pytest.raises(AutoshardError) as e:
        model = autoshard(Outer(), example_inputs=(x,) if up_front else None)
        model(x)
    msg = str(e.value)
    assert "module 'inner.gate' (Linear) op aten.addmm.default needs its tensors in one " \
           "dtype" in msg and "the call's input args[0] int64[2, 4]" in msg, msg
    assert "self.gate(x)" in msg and "x.to(torch.float32)" in msg


def test_op_without_fake_kernel_says_how_to_register_one():
    model = autoshard(Opaque())
    with pytest.raises(AutoshardError) as e:
        model(torch.randn(2, 4))
    msg = str(e.value)
    assert "autoshard_test.opaque" in msg or "autoshard_test::opaque" in msg
    assert "register_fake" in msg and "module '' (Opaque)" in msg


def test_example_inputs_capture_before_sharding_leaves_a_bad_model_whole():
    model = Outer()
    cls = type(model)
    with pytest.raises(AutoshardError):
        autoshard(model, example_inputs=(torch.randn(2, 4),))
    assert type(model) is cls
    assert not any(isinstance(p, DTensor) for p in model.parameters())


def test_example_inputs_compile_up_front():
    model = autoshard(GPT(), example_inputs=(torch.randint(0, 96, (2, 16)),))
    assert len(model._autoshard.programs) == 1
    model(torch.randint(0, 96, (2, 16)))
    assert len(model._autoshard.programs) == 1


def test_input_on_another_device_is_named():
    model = autoshard(GPT())
    with pytest.raises(AutoshardError, match=r"input args\[0\] \(int64\[2, 16\]\) is on the "
                       "meta device"):
        model(torch.randint(0, 96, (2, 16), device="meta"))


def test_incomplete_torchrun_environment_is_named():
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env.update(RANK="0", WORLD_SIZE="2")
    code = ("import torch, autoshard\n"
            "from autoshard.core.models import GPT\n"
            "try:\n    autoshard.autoshard(GPT())\n"
            "except autoshard.AutoshardError as e:\n    print('ERR', e)\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert "ERR the distributed environment is incomplete" in out.stdout, out.stderr
    assert "MASTER_ADDR, MASTER_PORT missing" in out.stdout and "torchrun" in out.stdout


def test_bad_arguments_get_clear_errors():
    with pytest.raises(TypeError, match="takes an nn.Module"):
        autoshard("model")
    with pytest.raises(ValueError, match="policy='magic' is not accepted"):
        Config(policy="magic")
    with pytest.raises(TypeError, match="list of lists of parameter FQNs"):
        Config(units=["a.weight"])
    model = autoshard(GPT())
    with pytest.raises(ValueError, match="already sharded"):
        autoshard(model)


class ScaledByValue(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        return h * h.detach().abs().max().item()  # a value read used as a number


def test_a_value_read_used_beyond_a_check_is_refused_naming_it():
    """A value read may stand in the graph only as a check (tests/test_capture.py); used as
    a number it is refused as before, naming the op."""
    with pytest.raises(AutoshardError) as e:
        autoshard(ScaledByValue())(torch.randn(2, 4))
    msg = str(e.value)
    assert "_local_scalar_dense" in msg and "reads a tensor's value" in msg
