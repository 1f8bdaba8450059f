"""The per-parameter description: placements, dtypes, device, and every size derived from them."""

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import Replicate, Shard

from autoshard.core.spec import ParamSpec, group_size, model_state_bytes, param_specs


def test_an_uneven_shard_is_padded_as_fsdp2_stores_it():
    spec = ParamSpec("w", (10, 3), torch.float32, True, mesh_shape=(4,))
    assert spec.placements == (Shard(0),) and spec.shards == spec.group_size == 4
    assert spec.layout.local_shape == (3, 3) and spec.layout.local_range(3) == (9, 10)
    assert spec.shard_bytes == 9 * 4
    assert spec.gathered_bytes() == 12 * 3 * 4  # four ranks' padded rows
    assert spec.reduced_bytes == 12 * 3 * 4


def test_mixed_precision_sizes_each_movement_in_its_own_dtype():
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = torch.nn.Linear(8, 6)
    specs = {s.fqn: s for s in param_specs(model, policy, mesh_shape=(2,))}
    w = specs["weight"]
    assert (w.dtype, w.compute_dtype, w.reduce_dtype) == (torch.float32, torch.bfloat16,
                                                          torch.float32)
    assert w.shard_bytes == 3 * 8 * 4 and w.gathered_bytes() == 6 * 8 * 2
    assert w.reduced_bytes == 6 * 8 * 4
    # fp32 masters + AdamW: 16 bytes per parameter over the ranks
    state = model_state_bytes(specs.values(), optimizer_states=2)
    assert sum(state[k] for k in ("params", "grads", "optimizer")) == 16 * (48 + 6) // 2


def test_a_scalar_is_replicated_and_all_reduced():
    spec = ParamSpec("scale", (), torch.float32, True, mesh_shape=(4,))
    assert spec.placements == (Replicate(),) and not spec.sharded and not spec.gathers
    assert spec.shard_bytes == spec.gathered_bytes() == 4
    assert spec.reduction == (("ar", 0, 4),) and spec.reduced_bytes == 4


def test_hybrid_placements_shard_over_the_last_mesh_dimension_only():
    spec = ParamSpec("w", (8, 2), torch.float32, True, mesh_shape=(2, 4))
    assert spec.placements == (Replicate(), Shard(0)) and spec.shards == 4
    assert spec.shard_bytes == 2 * 2 * 4
    # reduce-scattered within the shard group, then averaged across the replicas
    assert spec.reduction == (("rs", 1, 4), ("ar", 0, 2))


def test_strategies_place_and_reduce_as_their_flavour_says():
    model = torch.nn.Linear(6, 4)
    by = {s: {p.fqn: p for p in param_specs(model, mesh_shape=(4,), strategy=s)}
          for s in ("ddp", "zero1", "zero3")}
    ddp, zero1, zero3 = (by[s]["weight"] for s in ("ddp", "zero1", "zero3"))
    assert ddp.placements == (Replicate(),) and not ddp.gathers
    assert ddp.shard_bytes == 6 * 4 * 4 and ddp.reduction == (("ar", 0, 4),)
    assert zero1.replica and not zero1.gathers and zero1.reduction == (("rs", 0, 4),)
    assert zero1.replica_bytes == 6 * 4 * 4 and zero3.gathers and not zero3.replica
    state = {s: model_state_bytes(list(by[s].values()), 2) for s in by}
    # DDP stores it all; ZeRO-1 the whole parameters plus sharded gradients and state
    assert state["ddp"]["params"] == 4 * state["zero3"]["params"]
    assert state["zero1"]["params"] == state["zero3"]["params"] + state["ddp"]["params"]
    assert state["zero1"]["optimizer"] == state["zero3"]["optimizer"]


def test_host_state_is_not_counted_on_the_device():
    on = ParamSpec("a", (4, 4), torch.float32, True, mesh_shape=(2,))
    off = ParamSpec("b", (4, 4), torch.float32, True, mesh_shape=(2,), device="host")
    state = model_state_bytes([on, off], optimizer_states=2)
    assert state["params"] == state["grads"] == 32 and state["optimizer"] == 64
    assert state["host"] == 32 * 4 and state["host_grads"] == 32


def test_one_collective_needs_one_group():
    a = ParamSpec("a", (4,), torch.float32, True, mesh_shape=(2,))
    b = ParamSpec("b", (4,), torch.float32, True, mesh_shape=(4,))
    with pytest.raises(ValueError, match="different numbers of ranks"):
        group_size([a, b])


@pytest.mark.parametrize("kw, match", [
    ({"placements": (Shard(1),)}, r"only Shard\(0\) and Replicate"),
    ({"placements": (Shard(0), Shard(0))}, "2 placements for a mesh of shape"),
    ({"device": "cpu"}, "device must be one of"),
])
def test_a_bad_description_names_what_is_wrong(kw, match):
    with pytest.raises(ValueError, match=match):
        ParamSpec("w", (4, 4), torch.float32, True, mesh_shape=(2,), **kw)


def test_offloading_a_fraction_hosts_the_last_parameters_whole():
    from autoshard.core.spec import hosted

    params = [("a", (10, 4)), ("scale", ()), ("b", (20,)), ("c", (5, 2)), ("d", (10,))]
    assert hosted(params, 0.0) == set()
    assert hosted(params, 1.0) == {"a", "b", "c", "d"}  # never the scalar
    # 80 elements: the last ones, whole, until a quarter (20) and a half (40) are covered
    assert hosted(params, 0.25) == {"d", "c"}
    assert hosted(params, 0.5) == {"d", "c", "b"}
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    specs = param_specs(model, mesh_shape=(2,), offload=0.5)
    assert [s.device for s in specs] == ["device", "device", "host", "host"]
    state = model_state_bytes(specs, optimizer_states=2)
    # the last layer's weight and bias: shards, gradient shards and two AdamW moments
    assert state["host"] == 4 * (2 * 4 + 2) * 4 and state["host_grads"] == (2 * 4 + 2) * 4


def _every_kind_of_spec() -> list:
    """Specs of every strategy, a 2-D mesh, mixed precision, the host, a gradient divide."""
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.LayerNorm(3))
    model.register_parameter("scale", torch.nn.Parameter(torch.tensor(1.0),
                                                         requires_grad=False))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    specs = []
    for strategy in ("ddp", "zero1", "zero2", "zero3", "auto"):
        for mesh_shape in ((4,), (2, 2)):
            specs += param_specs(model, policy if strategy != "zero2" else None,
                                 mesh_shape=mesh_shape, offload=0.5 * (strategy == "zero3"),
                                 strategy="zero3" if strategy == "auto" else strategy,
                                 grad_divide=2.0 if strategy == "ddp" else None,
                                 force_sum=strategy == "zero1")
    specs.append(ParamSpec("half", (6, 2), torch.float16, True, reduce_dtype=torch.float32,
                           mesh_shape=(1,), device="host", grad_divide=1))
    return specs


def test_a_spec_round_trips_through_json_with_every_field():
    import dataclasses
    import json

    specs = _every_kind_of_spec()
    # the cases the round trip covers: each kind of value in each field
    assert {s.replica for s in specs} == {s.force_sum for s in specs} == {True, False}
    assert {s.device for s in specs} == {"device", "host"}
    assert {len(s.mesh_shape) for s in specs} == {1, 2} and any(not s.sharded for s in specs)
    assert {s.compute_dtype for s in specs} == {torch.float32, torch.bfloat16, torch.float16}
    assert {s.grad_divide for s in specs} == {None, 1, 2.0}
    assert {s.placements for s in specs} >= {(Shard(0),), (Replicate(),),
                                             (Replicate(), Shard(0)),
                                             (Replicate(), Replicate())}
    for spec in specs:
        d = json.loads(json.dumps(spec.to_dict()))
        assert set(d) == {f.name for f in dataclasses.fields(ParamSpec)}
        back = ParamSpec.from_dict(d)
        assert back == spec, (spec, back)
        assert back.layout.local_shape == spec.layout.local_shape
        assert back.reduction == spec.reduction and back.scaling == spec.scaling


def test_a_spec_document_that_is_not_one_names_what_is_wrong():
    good = ParamSpec("w", (4, 4), torch.float32, True, mesh_shape=(2,)).to_dict()
    for change, match in [
        (lambda d: d.pop("replica"), r"'w': no field replica"),
        (lambda d: d.update(colour="red"), r"'w': unknown field colour"),
        (lambda d: d.update(dtype="float99"), r"'float99' is not a torch dtype"),
        (lambda d: d.update(placements=["Shard(2)"]), r"placement 'Shard\(2\)' is not one"),
        (lambda d: d.update(device="gpu"), r"device must be one of"),
    ]:
        d = dict(good)
        change(d)
        with pytest.raises(ValueError, match=match):
            ParamSpec.from_dict(d)
