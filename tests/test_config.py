"""Every Config field refuses nonsense with a message naming the field and what it accepts."""

import dataclasses
import datetime
import json

import pytest
import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

import autoshard
from autoshard import Bucket, Config, Module, Offload, Prefetch, Size
from autoshard.core.config import offloads
from autoshard.core.options import parse_bytes


class Built:
    """An option written as source and built inside the test: its own constructor is what
    refuses it (``Prefetch(depth=-3)`` raises before a Config sees it)."""

    NAMES = {"Bucket": Bucket, "Module": Module, "Offload": Offload, "Prefetch": Prefetch,
             "Size": Size}

    def __init__(self, source: str):
        self.source = source

    def __repr__(self) -> str:
        return self.source

    def build(self):
        return eval(self.source, dict(self.NAMES))


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
    ({"prefer": "fast"}, ValueError,
     "Config.prefer='fast' is not accepted; use one of 'auto', 'balanced', 'memory', 'speed'"),
    ({"policy": Module}, ValueError, "Config.policy=<class 'autoshard.core.options.Module'> is not "
                                     "accepted; use one of 'auto', 'module', 'size', "
                                     "'per-parameter', 'whole-model', Module(classes=..., "
                                     "pattern=...), Size(min_numel=...)"),
    ({"policy": Built("Module(classes=[3])")}, TypeError,
     "Config.policy.classes must be a list of class names or classes, got [3]"),
    ({"policy": Built("Module(classes={'Block'})")}, TypeError,
     "Config.policy.classes must be a list of class"),
    ({"policy": Built("Module(pattern=3)")}, TypeError,
     "Config.policy.pattern must be a regular expression string, got 3"),
    ({"policy": Built("Module(pattern='blocks.(')")}, ValueError,
     "Config.policy.pattern='blocks.(' is not a valid regular expression"),
    ({"policy": Built("Size(min_numel=0)")}, ValueError,
     "Config.policy.min_numel must be a positive int"),
    ({"policy": Built("Size(min_numel=2**63)")}, ValueError,
     "Config.policy.min_numel must be a positive int (elements per unit of the size policy), "
     "at most"),
    ({"policy": Built("Size(min_numel=True)")}, ValueError,
     "Config.policy.min_numel must be a positive int"),
    ({"reshard_after_forward": 0}, ValueError, "Config.reshard_after_forward=0 is not accepted"),
    ({"bucket": "yes"}, TypeError, "Config.bucket must be True, False, Bucket(bytes=...) or "
                                   "None (on for the per-parameter policy only), got 'yes'"),
    ({"bucket": Built("Bucket(bytes=-5)")}, ValueError, "Config.bucket.bytes=-5 must be positive"),
    ({"bucket": Built("Bucket(bytes=float('nan'))")}, ValueError,
     "Config.bucket.bytes=nan must be positive"),
    ({"bucket": Built("Bucket(bytes=True)")}, TypeError,
     "Config.bucket.bytes must be a size such as 512MiB or 1e9, or None for the default"),
    ({"prefetch": "no"}, TypeError, "Config.prefetch must be True, False or Prefetch(depth=..., "
                                    "bytes=...), got 'no'"),
    ({"prefetch": None}, TypeError, "Config.prefetch must be True, False or Prefetch("),
    ({"offload_activations": "yes"}, ValueError,
     "Config.offload_activations='yes' is not accepted; use one of None, True, False"),
    ({"offload_activations": True, "recompute": "blocks"}, ValueError,
     "Config(offload_activations=True) offloads the activations the min cut saves"),
    ({"recompute": 1}, ValueError, "Config.recompute=1 is not accepted; use one of True, "
                                   "False, 'blocks', 'auto'"),
    ({"prefetch": Built("Prefetch(bytes=0)")}, ValueError,
     "Config.prefetch.bytes=0 must be positive"),
    ({"prefetch": Built("Prefetch(bytes=float('inf'))")}, ValueError,
     "Config.prefetch.bytes=inf must be positive"),
    ({"prefetch": Built("Prefetch(depth=-3)")}, ValueError,
     "Config.prefetch.depth must be a positive int (how many units ahead an all-gather may be "
     "issued; use prefetch=False for none), at most 2**63 - 1, got -3"),
    ({"prefetch": Built("Prefetch(depth=10**20)")}, ValueError,
     "Config.prefetch.depth must be a positive int"),
    ({"prefetch": Built("Prefetch(depth=2.0)")}, ValueError,
     "Config.prefetch.depth must be a positive int"),
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
                                           "fsdp CPUOffloadPolicy() (or OffloadPolicy() for "
                                           "none), an autoshard Offload(state=..., params=...) "
                                           "or None, got 'cpu'"),
    ({"offload_policy": Built("Offload(state=0)")}, ValueError,
     "Config.offload_policy.state must be a fraction above 0 and at most 1 (of the sharded "
     "state kept in host memory) or None, got 0"),
    ({"offload_policy": Built("Offload(state=1.5)")}, ValueError,
     "Config.offload_policy.state must be a fraction above 0"),
    ({"offload_policy": Built("Offload(params=1.5)")}, ValueError,
     "Config.offload_policy.params must be a fraction from 0 to 1"),
    ({"offload_policy": Built("Offload(params=True)")}, ValueError,
     "Config.offload_policy.params must be a fraction from 0 to"),
    ({"offload_policy": Built("Offload(pin_memory='yes')")}, TypeError,
     "Config.offload_policy.pin_memory must be True or False, got 'yes'"),
    ({"strategy": "fsdp"}, ValueError, "Config.strategy='fsdp' is not accepted; use one of 'ddp'"),
    ({"strategy": "zero2", "reshard_after_forward": True}, ValueError,
     "Config(strategy='zero2') keeps every unit gathered"),
    ({"strategy": "ddp", "offload_policy": CPUOffloadPolicy()}, ValueError,
     "Config(strategy='ddp') keeps every parameter whole on the device"),
    ({"strategy": "zero1", "offload_policy": Built("Offload(state=0.5)")}, ValueError,
     "Config(strategy='zero1') keeps every parameter whole on the device"),
    ({"partial_mesh": 1}, TypeError, "Config.partial_mesh must be True or False"),
    ({"compile": "inductor"}, TypeError, "Config.compile must be True or False"),
    ({"gradient_divide_factor": 0}, ValueError, "Config.gradient_divide_factor must be a "
                                                "positive number"),
    ({"gradient_divide_factor": True}, ValueError, "Config.gradient_divide_factor must be"),
    ({"gradient_divide_factor": 10**400}, ValueError, "Config.gradient_divide_factor must be"),
    ({"force_sum_reduction_for_comms": None}, TypeError,
     "Config.force_sum_reduction_for_comms must be True or False"),
    ({"tensor_parallel": "on"}, ValueError, "Config.tensor_parallel='on' is not accepted; use "
                                            "one of 'auto', 'off', or {module pattern"),
]


@pytest.mark.parametrize("kwargs,exc,message", BAD, ids=[(next(iter(k)) + "=" + repr(
    next(iter(k.values()))))[:50] for k, _, _ in BAD])
def test_bad_field_is_named_with_what_it_accepts(kwargs, exc, message):
    with pytest.raises(exc) as info:
        Config(**{k: v.build() if isinstance(v, Built) else v for k, v in kwargs.items()})
    assert message in str(info.value)


def test_every_field_is_covered():
    covered = {next(iter(k)) for k, _, _ in BAD}
    assert covered == {f.name for f in dataclasses.fields(Config)}


def test_good_values_are_normalised():
    c = Config(memory_budget="2GiB", timeout=datetime.timedelta(minutes=2),
               policy=Module(classes=[Config]), units=[("a", "b")])
    assert c.memory_budget == 2 * 2**30 and c.timeout == 120.0
    assert c.policy.classes == ("Config",) and c.units == (("a", "b"),)
    assert c.to_dict()["units"] == [["a", "b"]]
    assert c.to_dict()["policy"] == {"name": "module", "classes": ["Config"], "pattern": None}
    assert Module(classes="Block") == Module(classes=("Block",))


def test_nothing_a_config_holds_changes_in_place():
    """Frozen all the way down: its lists are tuples, its recompute dict read-only."""
    c = Config(units=[["a"]], policy=Module(classes=["Block"]),
               recompute={"blocks.0": "block"})
    with pytest.raises(AttributeError):
        c.units.append(("b",))
    with pytest.raises(TypeError):
        c.recompute["blocks.1"] = "keep"
    assert Config.from_dict(c.to_dict()) == c
    assert dataclasses.replace(c, policy="module").recompute == {"blocks.0": "block"}
    assert Config(timeout=datetime.timedelta(days=7)).timeout == 604800.0
    c = Config(bucket=Bucket(bytes="1.5e3KiB"), prefetch=Prefetch(bytes=".5GiB"))
    assert c.bucket.bytes == 1536000 and c.prefetch.bytes == 2**29
    assert Config(policy=Size(min_numel=2**63 - 1)).policy.min_numel == 2**63 - 1
    for option in (c.bucket, c.prefetch, Module(), Size(), Offload()):
        name = dataclasses.fields(option)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(option, name, getattr(option, name))
    with pytest.raises(dataclasses.FrozenInstanceError, match=r"dataclasses\.replace\(offload, "
                                                              r"state=\.\.\.\)"):
        Offload().state = 0.5
    with pytest.raises(dataclasses.FrozenInstanceError):
        del Offload().params
    assert dataclasses.replace(Offload(state=0.5), params=0.25) == Offload(0.5, 0.25)


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
    from autoshard.core.models import GPT

    inputs = (torch.randint(0, 96, (2, 16)),)
    with pytest.raises(ValueError, match=r"Config.policy.classes names 'Blok', but no "
                                         r"submodule of GPT .*\(did you mean 'Block'\?\)"):
        plan(GPT(), inputs, world_size=2, config=Config(policy=Module(classes="Blok")))
    with pytest.raises(ValueError, match=r"its parameters: wte.weight, .*, \.\.\. \(15 more\)"):
        plan(GPT(), inputs, world_size=2, config=Config(units=[["wte"]]))


def test_the_simple_spellings_stay_as_given_and_mean_the_default_options():
    """A Config keeps what it was given; what a simple spelling means is read from it."""
    for policy, options in (("module", Module()), ("size", Size()), ("auto", None),
                            ("per-parameter", None), ("whole-model", None)):
        c = Config(policy=policy)
        assert c.policy == policy and c.policy_name == policy and c.policy_options == options
    assert Config(policy=Size(min_numel=7)).policy_name == "size"
    assert Config(policy=Module(pattern="a")).policy_options == Module(pattern="a")
    assert Config().prefetch is True and Config().prefetch_options == Prefetch(depth=2)
    assert Config(prefetch=False).prefetch_options is None
    # bucket None stays None: the policy decides, in every copy made from it
    c = Config()
    assert c.bucket is None and c.bucket_options is None
    per = dataclasses.replace(c, policy="per-parameter")
    assert per.bucket is None and per.bucket_options == Bucket()
    assert dataclasses.replace(per, units=[["a"]]).bucket_options is None
    assert Config(bucket=True).bucket is True and Config(bucket=True).bucket_options == Bucket()
    assert Config(policy="per-parameter", bucket=False).bucket_options is None
    # torch's policies are kept as they are; an Offload says what they mean
    cpu = CPUOffloadPolicy(pin_memory=False)
    c = Config(offload_policy=cpu)
    assert c.offload_policy is cpu and c.offload_options == Offload(pin_memory=False)
    assert offloads(c) == 1.0 and c.to_dict()["offload_policy"] == {"cpu": True,
                                                                    "pin_memory": False}
    none = Config(offload_policy=OffloadPolicy())
    assert none.offload_options is None and offloads(none) == 0.0
    assert Config().offload_options is None and offloads(Config()) == 0.0


def test_the_new_spellings_carry_their_options():
    options = [Module(classes=[torch.nn.Linear], pattern=r"blocks\.\d+"), Bucket(bytes="1MiB"),
               Prefetch(depth=3, bytes=1e6), Offload(state=0.5, params=0.25, pin_memory=False)]
    module, bucket, prefetch, offload = options
    c = Config(policy=module, bucket=bucket, prefetch=prefetch, offload_policy=offload)
    assert (c.policy, c.bucket, c.prefetch, c.offload_policy) == tuple(options)
    assert c.policy is module and c.offload_policy is offload  # the user's own objects
    assert module.classes == ("Linear",) and bucket.bytes == 2**20 and prefetch.bytes == 10**6
    assert c.policy_name == "module" and c.bucket_options is bucket
    assert c.prefetch_options is prefetch and c.offload_options is offload
    assert isinstance(offload, CPUOffloadPolicy) and offloads(c) == 0.5
    assert repr(offload) == "Offload(state=0.5, params=0.25, pin_memory=False)"
    assert Offload() != CPUOffloadPolicy() and offloads(Config(offload_policy=Offload())) == 1.0
    for name in ("Bucket", "Prefetch", "Offload", "Module", "Size"):
        assert name in autoshard.__all__ and getattr(autoshard, name).__name__ == name
        assert getattr(autoshard.autoshard, name) is getattr(autoshard, name)


# the flat names of 0.2 and before: each still read as those versions read it, until 0.5, with a
# DeprecationWarning naming the new spelling
MOVED = [
    ({"prefetch_depth": 3}, Config(prefetch=Prefetch(depth=3)),
     "Config(prefetch_depth=3) is deprecated and will be removed in autoshard 0.5: write "
     "Config(prefetch=Prefetch(depth=3)) (from autoshard import Prefetch)"),
    ({"prefetch_bytes": "1MiB"}, Config(prefetch=Prefetch(bytes="1MiB")),
     "write Config(prefetch=Prefetch(bytes='1MiB'))"),
    ({"bucket": True, "bucket_bytes": 4096}, Config(bucket=Bucket(bytes=4096)),
     "write Config(bucket=Bucket(bytes=4096)) (from autoshard import Bucket)"),
    ({"offload_policy": CPUOffloadPolicy(), "offload_state": 0.5},
     Config(offload_policy=Offload(state=0.5)),
     "write Config(offload_policy=Offload(state=0.5, pin_memory=True)) (from autoshard import "
     "Offload)"),
    ({"offload_policy": Offload(state=0.5), "offload_params": 0.0},
     Config(offload_policy=Offload(state=0.5, params=0.0)),
     "write Config(offload_policy=Offload(state=0.5, params=0.0, pin_memory=True))"),
    ({"policy": "module", "module_classes": ["Block"]}, Config(policy=Module(classes=["Block"])),
     "write Config(policy=Module(classes=['Block']))"),
    ({"policy": "module", "module_pattern": "blocks"}, Config(policy=Module(pattern="blocks")),
     "write Config(policy=Module(pattern='blocks'))"),
    ({"policy": "size", "min_unit_numel": 10**6}, Config(policy=Size(min_numel=10**6)),
     "write Config(policy=Size(min_numel=1000000))"),
    # a flat name whose option is off did nothing, and still does nothing
    ({"bucket_bytes": 4096}, Config(),
     "these do nothing while their option is off: bucket_bytes (bucket="),
    ({"prefetch": False, "prefetch_depth": 3}, Config(prefetch=False),
     "prefetch_depth (prefetch=False)"),
    ({"module_classes": ["Block"]}, Config(), "module_classes (policy='auto')"),
    ({"offload_state": 0.5}, Config(), "offload_state (offload_policy=None)"),
    # several at once are grouped by the option they move into, with what they join
    ({"policy": "module", "module_classes": ["Block"], "module_pattern": "h",
      "prefetch_depth": 1, "offload_policy": CPUOffloadPolicy(pin_memory=False),
      "offload_state": 0.25},
     Config(policy=Module(classes=["Block"], pattern="h"), prefetch=Prefetch(depth=1),
            offload_policy=Offload(state=0.25, pin_memory=False)),
     "Config(module_classes=['Block'], module_pattern='h', prefetch_depth=1, offload_state=0.25) "
     "is deprecated and will be removed in autoshard 0.5: write Config(policy=Module(classes="
     "['Block'], pattern='h'), prefetch=Prefetch(depth=1), offload_policy=Offload(state=0.25, "
     "pin_memory=False)) (from autoshard import Module, Prefetch, Offload)"),
]


@pytest.mark.parametrize("kwargs,now,says", MOVED, ids=[list(k)[-1] for k, _, _ in MOVED])
def test_each_flat_name_still_works_warning_of_its_new_spelling(kwargs, now, says):
    with pytest.warns(DeprecationWarning, match="deprecated") as caught:
        config = Config(**kwargs)
    assert config == now
    assert len(caught) == 1 and says in str(caught[0].message)
    assert caught[0].filename == __file__  # the warning points at the user's line
    with pytest.warns(DeprecationWarning) as caught:  # a changed copy too
        again = dataclasses.replace(Config(), **kwargs)
    assert again == now and says in str(caught[0].message)
    assert caught[0].filename == __file__
    moved = autoshard.core.config_history.MOVED
    assert not any(hasattr(config, name) for name in kwargs if name in moved)


ROUND_TRIP = [
    Config(),
    Config(policy="module", bucket=True, prefetch=False, offload_policy=CPUOffloadPolicy()),
    Config(policy="size", bucket=False, offload_policy=OffloadPolicy()),
    Config(policy=Module(classes=["Block"], pattern=r"blocks\.\d+"), bucket=Bucket(),
           prefetch=Prefetch(depth=4, bytes="1MiB"), offload_policy=Offload(params=0.5)),
    Config(policy=Size(min_numel=1234), bucket=Bucket(bytes=10**6), prefetch=Prefetch(),
           offload_policy=Offload(state=0.75, params=0.0, pin_memory=False),
           units=[["a"], ["b"]], recompute={"blocks.0": "block"}, memory_budget="1GiB"),
    Config(policy=Module(), offload_policy=Offload()),
]


@pytest.mark.parametrize("config", ROUND_TRIP, ids=range(len(ROUND_TRIP)))
def test_to_dict_and_from_dict_round_trip_through_json(config):
    d = json.loads(json.dumps(config.to_dict()))
    again = Config.from_dict(d)
    assert again == config and again.to_dict() == d
    assert type(again.offload_policy) is type(config.offload_policy)  # noqa: E721
    assert not any(k in d for k in ("prefetch_depth", "bucket_bytes", "module_classes",
                                    "offload_state", "offload_params", "min_unit_numel"))


# what Config.to_dict wrote while these options were fields of their own (exports and
# checkpoints hold such records), with the Config each now reads as
OLD = {"policy": "auto", "units": None, "memory_budget": None, "device_profile": None,
       "optimizer": "adamw", "module_classes": None, "module_pattern": None,
       "min_unit_numel": 10**8, "reshard_after_forward": "auto", "bucket": False,
       "bucket_bytes": None, "prefetch": True, "recompute": True, "prefetch_bytes": None,
       "prefetch_depth": 2, "verify": False, "timeout": 300, "mp_policy": None,
       "offload_policy": None, "offload_state": None, "offload_params": None,
       "strategy": "zero3", "partial_mesh": False, "compile": False,
       "gradient_divide_factor": None, "force_sum_reduction_for_comms": False}
OLD_READ = [
    ({}, Config()),
    ({"policy": "per-parameter", "bucket": True}, Config(policy="per-parameter")),
    ({"policy": "per-parameter", "bucket": False}, Config(policy="per-parameter", bucket=False)),
    ({"bucket": True}, Config(bucket=True)),
    ({"policy": "module", "bucket": True, "bucket_bytes": 4096},
     Config(policy="module", bucket=Bucket(bytes=4096))),
    ({"policy": "module", "module_classes": ["Block"]},
     Config(policy=Module(classes=["Block"]))),
    ({"policy": "module", "module_pattern": r"blocks\.\d+"},
     Config(policy=Module(pattern=r"blocks\.\d+"))),
    ({"policy": "size", "min_unit_numel": 5000}, Config(policy=Size(min_numel=5000))),
    ({"policy": "size"}, Config(policy="size")),
    ({"prefetch_depth": 3, "prefetch_bytes": 10**6},
     Config(prefetch=Prefetch(depth=3, bytes=10**6))),
    ({"prefetch": False, "prefetch_depth": 3}, Config(prefetch=False)),
    ({"offload_policy": {"cpu": True, "pin_memory": False}, "offload_state": 0.5,
      "offload_params": 0.25},
     Config(offload_policy=Offload(state=0.5, params=0.25, pin_memory=False))),
    ({"offload_policy": {"cpu": True, "pin_memory": True}},
     Config(offload_policy=CPUOffloadPolicy())),
    ({"offload_policy": {"cpu": False, "pin_memory": False}},
     Config(offload_policy=OffloadPolicy())),
    ({"units": [["a"]], "bucket": False, "policy": "per-parameter"},
     Config(units=[["a"]], policy="per-parameter")),
]


@pytest.mark.parametrize("changed,config", OLD_READ, ids=range(len(OLD_READ)))
def test_from_dict_reads_the_flat_records_earlier_versions_wrote(changed, config):
    old = dict(OLD, **changed)
    got = Config.from_dict(json.loads(json.dumps(old)))
    assert got == config and type(got.offload_policy) is type(config.offload_policy)  # noqa
    assert Config.from_dict(got.to_dict()) == got
    assert old == dict(OLD, **changed)  # the record itself is left as it was


def test_from_dict_still_refuses_fields_it_does_not_know():
    with pytest.raises(ValueError, match=r"unknown Config fields \['prefetch_width'\]"):
        Config.from_dict(dict(OLD, prefetch_width=3))
    with pytest.raises(ValueError, match=r"Config.policy: a record of \{'name': 'layers'\} names "
                                         r"no policy with options"):
        Config.from_dict({"policy": {"name": "layers"}})
    with pytest.raises(ValueError, match=r"Config.prefetch.depth must be a positive int"):
        Config.from_dict({"prefetch": {"depth": 0, "bytes": None}})
