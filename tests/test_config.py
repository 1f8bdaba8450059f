"""Every Config field refuses nonsense with a message naming the field and what it accepts."""

import dataclasses
import datetime

import pytest
import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

from autoshard import Config
from autoshard.config import parse_bytes

BAD = [
    ({"policy": "blocks"}, ValueError, "Config.policy='blocks' is not accepted; use one of 'auto'"),
    ({"units": "layers.0.weight"}, TypeError, "Config.units must be a list of lists"),
    ({"units": [[]]}, ValueError, "Config.units[0] is empty"),
    ({"units": [["a"], ["b", "a"]]}, ValueError, "'a' is in units[0] and units[1]"),
    ({"memory_budget": 0}, ValueError, "Config.memory_budget=0 must be positive"),
    ({"memory_budget": "lots"}, ValueError, "Config.memory_budget: cannot read 'lots'"),
    ({"memory_budget": float("inf")}, ValueError, "Config.memory_budget=inf must be positive and "
                                                  "finite, from 1 byte to 2**63 - 1 bytes"),
    ({"memory_budget": float("nan")}, ValueError, "Config.memory_budget=nan must be positive"),
    ({"memory_budget": "1e400GiB"}, ValueError, "Config.memory_budget='1e400GiB' must be"),
    ({"memory_budget": 1e300}, ValueError, "Config.memory_budget=1e+300 must be positive and "
                                           "finite, from 1 byte to 2**63 - 1 bytes"),
    ({"device_profile": "tpu"}, ValueError, "Config.device_profile='tpu' is not accepted"),
    ({"optimizer": "lion"}, ValueError, "Config.optimizer='lion' is not accepted"),
    ({"module_classes": [3]}, TypeError, "Config.module_classes must be a list of class"),
    ({"module_pattern": "blocks.("}, ValueError, "Config.module_pattern='blocks.(' is not a "
                                                 "valid regular expression"),
    ({"min_unit_numel": 0}, ValueError, "Config.min_unit_numel must be a positive int"),
    ({"min_unit_numel": 2**63}, ValueError, "Config.min_unit_numel must be a positive int "
                                            "(elements per unit of the size policy), at most"),
    ({"reshard_after_forward": 1}, ValueError, "Config.reshard_after_forward=1 is not accepted"),
    ({"bucket": "yes"}, TypeError, "Config.bucket must be True or False"),
    ({"bucket_bytes": -5}, ValueError, "Config.bucket_bytes=-5 must be positive"),
    ({"bucket_bytes": float("nan")}, ValueError, "Config.bucket_bytes=nan must be positive"),
    ({"prefetch": "no"}, TypeError, "Config.prefetch must be True or False, got 'no'"),
    ({"recompute": 1}, ValueError, "Config.recompute=1 is not accepted; use one of True, "
                                   "False, 'blocks', 'auto'"),
    ({"prefetch_bytes": 0}, ValueError, "Config.prefetch_bytes=0 must be positive"),
    ({"prefetch_bytes": float("inf")}, ValueError, "Config.prefetch_bytes=inf must be positive"),
    ({"prefetch_depth": -3}, ValueError, "Config.prefetch_depth must be a positive int"),
    ({"prefetch_depth": 10**20}, ValueError, "Config.prefetch_depth must be a positive int"),
    ({"verify": None}, TypeError, "Config.verify must be True or False"),
    ({"timeout": 0}, ValueError, "Config.timeout must be a positive number of seconds"),
    ({"timeout": 1e300}, ValueError, "Config.timeout must be a positive number of seconds, at "
                                     "most 604800 (a week)"),
    ({"timeout": datetime.timedelta(days=10**6)}, ValueError, "at most 604800 (a week)"),
    ({"mp_policy": "bf16"}, TypeError, "Config.mp_policy must be a torch.distributed.fsdp."
                                       "MixedPrecisionPolicy"),
    ({"mp_policy": MixedPrecisionPolicy(param_dtype=torch.int8)}, ValueError,
     "Config.mp_policy.param_dtype must be a floating dtype"),
    ({"offload_policy": "cpu"}, TypeError, "Config.offload_policy must be a torch.distributed."
                                           "fsdp CPUOffloadPolicy()"),
    ({"offload_state": 0}, ValueError, "Config.offload_state must be a fraction above 0"),
    ({"offload_state": 0.5}, ValueError, "it needs offload_policy=torch.distributed.fsdp."
                                         "CPUOffloadPolicy()"),
    ({"offload_params": 1.5}, ValueError, "Config.offload_params must be a fraction from 0 to 1"),
    ({"offload_params": True}, ValueError, "Config.offload_params must be a fraction from 0 to"),
    ({"strategy": "fsdp"}, ValueError, "Config.strategy='fsdp' is not accepted; use one of 'ddp'"),
    ({"strategy": "zero2", "reshard_after_forward": True}, ValueError,
     "Config(strategy='zero2') keeps every unit gathered"),
    ({"strategy": "ddp", "offload_policy": CPUOffloadPolicy()}, ValueError,
     "Config(strategy='ddp') keeps every parameter whole on the device"),
    ({"partial_mesh": 1}, TypeError, "Config.partial_mesh must be True or False"),
    ({"compile": "inductor"}, TypeError, "Config.compile must be True or False"),
    ({"gradient_divide_factor": 0}, ValueError, "Config.gradient_divide_factor must be a "
                                                "positive number"),
    ({"gradient_divide_factor": True}, ValueError, "Config.gradient_divide_factor must be"),
    ({"gradient_divide_factor": 10**400}, ValueError, "Config.gradient_divide_factor must be"),
    ({"force_sum_reduction_for_comms": None}, TypeError,
     "Config.force_sum_reduction_for_comms must be True or False"),
]


@pytest.mark.parametrize("kwargs,exc,message", BAD, ids=[(next(iter(k)) + "=" + repr(
    next(iter(k.values()))))[:50] for k, _, _ in BAD])
def test_bad_field_is_named_with_what_it_accepts(kwargs, exc, message):
    with pytest.raises(exc) as info:
        Config(**kwargs)
    assert message in str(info.value)


def test_every_field_is_covered():
    covered = {next(iter(k)) for k, _, _ in BAD}
    assert covered == {f.name for f in dataclasses.fields(Config)}


def test_good_values_are_normalised():
    c = Config(memory_budget="2GiB", timeout=datetime.timedelta(minutes=2),
               module_classes=[Config], units=[("a", "b")])
    assert c.memory_budget == 2 * 2**30 and c.timeout == 120.0
    assert c.module_classes == ("Config",) and c.units == (("a", "b"),)
    assert c.to_dict()["units"] == [["a", "b"]] and c.to_dict()["module_classes"] == ["Config"]


def test_nothing_a_config_holds_changes_in_place():
    """Frozen all the way down: its lists are tuples, its recompute dict read-only."""
    c = Config(units=[["a"]], module_classes=["Block"], recompute={"blocks.0": "block"})
    with pytest.raises(AttributeError):
        c.units.append(("b",))
    with pytest.raises(TypeError):
        c.recompute["blocks.1"] = "keep"
    assert Config.from_dict(c.to_dict()) == c
    assert dataclasses.replace(c, policy="module").recompute == {"blocks.0": "block"}
    assert Config(timeout=datetime.timedelta(days=7)).timeout == 604800.0
    assert Config(bucket_bytes="1.5e3KiB", prefetch_bytes=".5GiB").bucket_bytes == 1536000
    assert Config(prefetch_bytes=".5GiB", min_unit_numel=2**63 - 1).prefetch_bytes == 2**29


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan"), -5, 0.5,
                                   "1e400", "-1GiB", "nanGiB", 2**63])
def test_parse_bytes_refuses_what_is_no_size_naming_it(value):
    with pytest.raises(ValueError, match=r"^--budget"):
        parse_bytes(value, "--budget")


def test_fields_cannot_change_after_construction():
    c = Config(policy="module")
    for field in dataclasses.fields(Config):
        with pytest.raises(dataclasses.FrozenInstanceError) as info:
            setattr(c, field.name, getattr(c, field.name))
        assert (f"Config is frozen: Config.{field.name} cannot change" in str(info.value)
                and f"dataclasses.replace(config, {field.name}=...)" in str(info.value))
    with pytest.raises(dataclasses.FrozenInstanceError, match="Config is frozen"):
        del c.policy
    assert c.policy == "module"
    # a changed copy is checked as a new Config is
    assert dataclasses.replace(c, policy="size").policy == "size"
    with pytest.raises(ValueError, match="Config.policy='bogus' is not accepted"):
        dataclasses.replace(c, policy="bogus")


def test_a_recompute_dict_is_copied():
    modes = {"blocks.0": "block"}
    c = Config(recompute=modes)
    modes["blocks.0"] = "bogus"
    assert c.recompute == {"blocks.0": "block"}


def test_plan_refuses_names_that_match_nothing():
    from autoshard import plan
    from autoshard.models import GPT

    inputs = (torch.randint(0, 96, (2, 16)),)
    with pytest.raises(ValueError, match=r"Config.module_classes names 'Blok', but no "
                                         r"submodule of GPT .*\(did you mean 'Block'\?\)"):
        plan(GPT(), inputs, world_size=2, config=Config(policy="module", module_classes="Blok"))
    with pytest.raises(ValueError, match=r"its parameters: wte.weight, .*, \.\.\. \(15 more\)"):
        plan(GPT(), inputs, world_size=2, config=Config(units=[["wte"]]))
