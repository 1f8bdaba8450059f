"""Meta-device models: materialised module by module, bitwise equal to building on the device;
and autoshard() is all or nothing.

A model built under ``torch.device("meta")`` and passed to autoshard() with the seed the device
build used gets, on every rank, exactly the rows of the device-built model (torch.equal), its
buffers too (BatchNorm statistics, Llama's rotary ``inv_freq``), and leaves the random number
generator where building on the device leaves it.
"""

import contextlib
import copy
import warnings

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from autoshard import AutoshardError, Config, Module, autoshard, deferred_init
from autoshard.core.models import GPT
from autoshard.core.spec import ShardLayout
from autoshard.runtime.dist import default_mesh
from harness import run_ranks
from init_workers import (DEFERRED_CASES, DEFERRED_WORLD2, META_CASES, NanoGPT, build_on_device,
                          build_on_meta, device_state, erfinv_trunc_normal_, local_state,
                          meta_init_worker, shard_deferred, shard_on_meta)
from models import CASES, MLP, Odd, call


@pytest.fixture(scope="module")
def mesh():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "running as world size 1"
        return default_mesh()


def _device_state(name):
    model = build_on_device(name)
    after = torch.rand(4)
    state = {k: v.detach() for k, v in model.named_parameters()}
    state.update({k: v.detach() for k, v in model.named_buffers()})
    return model, state, after


def _rows(full, rank, world):
    lay = ShardLayout(full.shape, world)
    if not lay.sharded:
        return full
    a, b = lay.local_range(rank)
    return full[a:b]


def _value(t):
    if t is None or t.device.type == "meta":
        return None
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def _snapshot(model):
    """Everything 'left as it was' covers: the class, each parameter and buffer object with
    its device and a copy of its values."""
    tensors = {}
    for name, mod in model.named_modules():
        for kind, table in (("p", mod._parameters), ("b", mod._buffers)):
            for key, t in table.items():
                tensors[(name, kind, key)] = (t, t.device if t is not None else None,
                                              _value(t))
    return type(model), tensors


def _assert_unchanged(model, snap):
    cls, tensors = snap
    assert type(model) is cls
    assert "_autoshard" not in model.__dict__
    now = _snapshot(model)[1]
    assert now.keys() == tensors.keys()
    for key, (t, device, value) in tensors.items():
        t2 = now[key][0]
        assert t2 is t, key  # the very same object
        assert not hasattr(t, "_autoshard_replaced"), key  # an optimizer over it may step
        if t is not None:
            assert t2.device == device, key
            if value is not None:
                assert torch.equal(_value(t2), value), key


def _refused_untouched(model, mesh, error=ValueError, match=None) -> str:
    """``autoshard(model)`` raises ``error`` (matching ``match``), leaving the model and the
    default generator as they were; the error's message."""
    snap = _snapshot(model)
    state = torch.get_rng_state()
    with pytest.raises(error, match=match) as e:
        autoshard(model, mesh=mesh)
    _assert_unchanged(model, snap)
    assert torch.equal(torch.get_rng_state(), state)
    return str(e.value)


# --- bitwise equal to the device build --------------------------------------------------------


@pytest.mark.parametrize("name", META_CASES + ["hf_gpt2", "hf_bert"])
def test_meta_init_equals_device_build_world1(mesh, name):
    ref, want, ref_after = _device_state(name)
    model = shard_on_meta(name, mesh=mesh)
    assert torch.equal(torch.rand(4), ref_after)  # the generator is where the build left it
    got = local_state(model)
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k].device.type == "cpu" and got[k].dtype == v.dtype, k
        assert torch.equal(got[k], v), k
    for fqn, p in model.named_parameters():
        assert isinstance(p, DTensor) and p.placements == ((Shard(0),) if p.dim() else
                                                           (Replicate(),)), fqn
    assert len(list(model.parameters())) == len(list(ref.parameters()))  # ties kept
    if name == "gpt":
        assert model.head.weight is model.wte.weight
    if name == "hf_llama":
        tied = ref.lm_head.weight is ref.model.embed_tokens.weight
        assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
        rotary = model.model.rotary_emb
        assert torch.equal(rotary.inv_freq, ref.model.rotary_emb.inv_freq)
        assert torch.equal(rotary.original_inv_freq, ref.model.rotary_emb.original_inv_freq)
        # Hugging Face's bookkeeping matches a model built on the device
        assert all(getattr(m, "_is_hf_initialized", False) for m in model.modules())


TORCH_LAYERS = {
    "attention": lambda: nn.MultiheadAttention(16, 4),  # _reset_parameters(), a child's bias
    "encoder": lambda: nn.TransformerEncoder(  # layers deep-copied from one: equal draws
        nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0), 2, enable_nested_tensor=False),
    "lstm": lambda: nn.LSTM(8, 16, 2),
    "layers": lambda: nn.Sequential(
        nn.Conv1d(3, 4, 3), nn.GroupNorm(2, 4), nn.Embedding(10, 4, padding_idx=1),
        nn.RMSNorm(4), nn.PReLU(), nn.BatchNorm1d(4), nn.ConvTranspose2d(2, 3, 3),
        nn.Bilinear(3, 4, 5)),
}


@pytest.mark.parametrize("name", list(TORCH_LAYERS))
def test_torch_layers_equal_device_build(mesh, name):
    torch.manual_seed(0)
    ref = TORCH_LAYERS[name]()
    ref_after = torch.rand(4)
    with torch.device("meta"):
        model = TORCH_LAYERS[name]()
    torch.manual_seed(0)
    autoshard(model, mesh=mesh)
    assert torch.equal(torch.rand(4), ref_after)
    got = local_state(model)
    for k, v in list(ref.named_parameters()) + list(ref.named_buffers()):
        assert torch.equal(got[k], v.detach()), k


def test_hf_llama_with_tied_embeddings(mesh):
    import transformers as T

    def build():
        return T.LlamaForCausalLM(T.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=96, max_position_embeddings=64, use_cache=False,
            tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0))

    torch.manual_seed(0)
    ref = build()
    assert ref.lm_head.weight is ref.model.embed_tokens.weight
    with torch.device("meta"):
        model = build()
    torch.manual_seed(0)
    autoshard(model, mesh=mesh)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    got = local_state(model)
    for k, v in list(ref.named_parameters()) + list(ref.named_buffers()):
        assert torch.equal(got[k], v.detach()), k


# --- what a constructor initialises itself ----------------------------------------------------


@pytest.mark.parametrize("name", list(DEFERRED_CASES))
def test_deferred_init_equals_device_build_world1(mesh, name):
    """Built under deferred_init(), with no param_init_fn: every value the constructor gives
    (nanoGPT's _init_weights and scaled c_proj, torch.randn parameters, arange tables, deep
    copies, a Hugging Face post_init) is the device build's, bit for bit."""
    want, ref_after = device_state(DEFERRED_CASES[name])
    model = shard_deferred(DEFERRED_CASES[name], mesh=mesh)
    assert torch.equal(torch.rand(4), ref_after)
    got = local_state(model)
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    if name == "nanogpt":
        assert model.lm_head.weight is model.transformer.wte.weight
        assert abs(got["transformer.wte.weight"].std().item() - 0.02) < 0.003
        assert abs(got["transformer.h.0.c_proj.weight"].std().item() - 0.01) < 0.002
        assert torch.count_nonzero(got["transformer.h.0.c_attn.bias"]) == 0


class QKV(nn.Module):
    """The fused-QKV init run after construction: trunc_normal_ on two temporaries,
    concatenated, viewed and copied into the parameter."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.empty(4, 3))

    def init_weights(self, draw=nn.init.trunc_normal_):
        q = self.w.new_empty(2, 3)
        k = self.w.new_empty(2, 3)
        draw(q, std=0.02)
        draw(k, std=0.02)
        fused = torch.cat([q.view(1, 2, 3), k.view(1, 2, 3)], 1).view(-1, 3)
        with torch.no_grad():
            self.w.copy_(fused)


orthogonal_ = nn.init.orthogonal_


def _build_qkv(no_grad, draw=nn.init.trunc_normal_):
    m = QKV()
    with torch.no_grad() if no_grad else contextlib.nullcontext():
        m.init_weights(draw)
    return m


@pytest.mark.parametrize("no_grad", [False, True])
@pytest.mark.parametrize("draw", [nn.init.trunc_normal_, erfinv_trunc_normal_],
                         ids=["trunc_normal_", "erfinv_chain"])
def test_init_from_drawn_temporaries_equals_device_build(mesh, no_grad, draw):
    """torchtitan's fused init, run after construction: what each temporary's draws and
    in-place ops give it reaches the parameter through cat + view + copy_, bit for bit, and
    the generator ends where the device build leaves it."""
    torch.manual_seed(0)
    ref = _build_qkv(no_grad, draw)
    ref_after = torch.rand(4)
    with deferred_init():
        model = _build_qkv(no_grad, draw)
    assert nn.init.orthogonal_ is orthogonal_  # wrapped only while the block is open
    torch.manual_seed(0)
    sharded = autoshard(model, mesh=mesh)
    assert torch.equal(torch.rand(4), ref_after)
    assert torch.equal(sharded.w.to_local(), ref.w.detach())


def _skips_meta_normal_(t, std=1.0):
    """An init function that, like torch's own trunc_normal_, does nothing on the meta device."""
    return t if t.is_meta else t.normal_(0.0, std)


def test_init_the_recording_cannot_see_is_named(mesh):
    """A temporary whose values the recording never saw written (its init skipped the meta
    tensor) is refused, naming the parameter it reaches, not replayed as uninitialised
    memory; the model and the generator are left as they were."""
    with deferred_init():
        model = _build_qkv(True, _skips_meta_normal_)
    _refused_untouched(model, mesh, AutoshardError, r"parameter 'w' \(QKV\).*never written")


def test_draws_from_an_explicit_generator_are_named(mesh):
    """autoshard rewinds the default generator only: a recorded draw from a generator the
    constructor passed cannot be replayed as it ran, so the parameter is named."""
    gen = torch.Generator().manual_seed(1)

    class Gen(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.empty(4, 3))
            nn.init.trunc_normal_(self.w, std=0.02, generator=gen)

    with deferred_init():
        model = Gen()
    with pytest.raises(AutoshardError, match=r"parameter 'w' \(Gen\).*generator"):
        autoshard(model, mesh=mesh)


@pytest.mark.parametrize("build, says", [
    (NanoGPT, "parameter 'transformer.wte.weight' (Embedding)"),
    (DEFERRED_CASES["gpt"], "parameter 'wte.weight' (Embedding)")])
def test_constructor_init_lost_on_the_meta_device_is_named(mesh, build, says):
    """Built under plain torch.device("meta"), what the constructor drew beyond
    reset_parameters() is gone: refused, naming the tensor and both fixes."""
    with torch.device("meta"):
        model = build()
    msg = _refused_untouched(model, mesh)
    assert says in msg and "deferred_init()" in msg and "param_init_fn" in msg
    assert "ln_f" not in msg  # reset_parameters() gives those what the device build does
    assert all(p._version > 1 for n, p in model.named_parameters() if n.endswith("wte.weight"))


def test_write_after_deferred_init_is_named(mesh):
    with deferred_init():
        model = MLP()
    nn.init.zeros_(model.out.weight)  # outside the recording: not replayable
    snap = _snapshot(model)
    with pytest.raises(ValueError, match=r"parameter 'out.weight' \(Linear\) was written after "
                       r"its deferred_init\(\) block ended"):
        autoshard(model, mesh=mesh)
    _assert_unchanged(model, snap)


def test_meta_init_equals_device_build_world2():
    results = run_ranks(2, meta_init_worker, META_CASES)
    for name in DEFERRED_WORLD2:  # built under deferred_init()
        want, ref_after = device_state(DEFERRED_CASES[name])
        params = dict(shard_deferred(DEFERRED_CASES[name]).named_parameters())
        for rank, res in enumerate(results):
            got = res["deferred_" + name]
            assert got["state"].keys() == want.keys(), name
            for k, v in want.items():
                expect = _rows(v, rank, 2) if k in params else v
                assert torch.equal(got["state"][k], expect), f"{name} rank {rank}: {k}"
            assert torch.equal(got["after_rng"], ref_after), name
    for name in META_CASES:
        ref, want, ref_after = _device_state(name)
        for rank, res in enumerate(results):
            got = res[name]["state"]
            assert got.keys() == want.keys(), name
            params = dict(build_on_meta(name).named_parameters())
            for k, v in want.items():
                expect = _rows(v, rank, 2) if k in params else v
                assert torch.equal(got[k], expect), f"{name} rank {rank}: {k}"
            assert torch.equal(res[name]["after_rng"], ref_after), name
            if name == "gpt":
                assert res[name]["tied"]
            if name == "hf_llama":
                assert res[name]["tied"] == (ref.lm_head.weight is
                                             ref.model.embed_tokens.weight)
    # memory: this rank's shards plus the largest module, not the model; the allocator's
    # exact count (the generator's state is kept per initialising step for pass 2)
    mem = results[0]["memory"]
    bound = mem["kept"] + mem["largest_module"] + mem["steps"] * mem["rng_state_bytes"]
    assert mem["peak"] <= bound + 64 * 1024, mem
    assert mem["peak"] < mem["full"], mem  # never the whole model at once


def test_meta_model_trains_like_the_device_build(mesh):
    """The materialised CNN (BatchNorm statistics in buffers) computes what the device build
    computes, and its statistics update as eagerly."""
    torch.manual_seed(0)
    ref = build_on_device("cnn")
    model = shard_on_meta("cnn", mesh=mesh)
    gen = torch.Generator().manual_seed(1)
    x, y = CASES["cnn"][1](gen, 4)
    loss_fn = CASES["cnn"][3]
    loss_fn(call("cnn", model, x), y).backward()
    loss_fn(call("cnn", ref, x), y).backward()
    for (k, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-6, msg=k)
    for (k, b), c in zip(model.named_buffers(), ref.buffers()):
        torch.testing.assert_close(b, c, msg=k)


# --- param_init_fn --------------------------------------------------------------------------------


def _normal_linear(m):
    if isinstance(m, nn.Linear):
        nn.init.normal_(m.weight, std=0.1)
        nn.init.zeros_(m.bias)


def test_param_init_fn_runs_after_reset_children_first(mesh):
    """param_init_fn is code run after building: the device build followed by
    model.apply(fn) gives the same values bit for bit, the fn sees each module once, children
    first, with its own tensors on the mesh device."""
    torch.manual_seed(0)
    ref = MLP()
    ref.apply(_normal_linear)
    seen = []

    def fn(m):
        seen.append(type(m).__name__)
        for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False)):
            assert t.device.type == "cpu"
        _normal_linear(m)

    with torch.device("meta"):
        model = MLP()
    torch.manual_seed(0)
    autoshard(model, mesh=mesh, param_init_fn=fn)
    assert seen == ["Linear"] * 3 + ["Sequential", "Linear", "MLP"]
    for (k, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.to_local(), q.detach()), k


@torch.no_grad()
def _halve_linear(m):
    if isinstance(m, nn.Linear):
        m.weight.mul_(0.5)  # scales what reset_parameters() drew: reads earlier values


def _assert_meta_init_matches(cls, init_fn, mesh):
    """Built on the meta device and initialised with ``init_fn``, the shards equal the model
    built on the CPU with ``init_fn`` applied, bit for bit."""
    torch.manual_seed(0)
    ref = cls()
    ref.apply(init_fn)
    with torch.device("meta"):
        model = cls()
    torch.manual_seed(0)
    autoshard(model, mesh=mesh, param_init_fn=init_fn)
    for (k, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.to_local(), q.detach()), k


def test_param_init_fn_may_scale_the_default_init(mesh):
    _assert_meta_init_matches(MLP, _halve_linear, mesh)


class Scaled(nn.Module):
    """A parent whose init writes its child's weight (as GPT-2's _init_weights does)."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(6, 4)
        self.gain = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return self.inner(x) * self.gain


@torch.no_grad()
def _scale_child(m):
    if isinstance(m, Scaled):
        nn.init.normal_(m.inner.weight, std=0.5)
        m.inner.weight.mul_(2.0)  # reads the value the line above wrote
        nn.init.ones_(m.gain)


def test_param_init_fn_may_initialise_a_child(mesh):
    _assert_meta_init_matches(Scaled, _scale_child, mesh)


class Rotary(nn.Module):
    """A buffer computed in __init__, no reset_parameters: what rotary embeddings look like."""

    def __init__(self, dim=8):
        super().__init__()
        self.dim = dim
        self.register_buffer("inv_freq", self.compute(), persistent=False)

    def compute(self, device=None):
        return 1.0 / (10000 ** (torch.arange(0, self.dim, 2, device=device).float() / self.dim))


class WithRotary(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.rot = Rotary()


def test_uninitialised_tensors_are_named_and_the_model_is_left_alone(mesh):
    with torch.device("meta"):
        odd = Odd()
    msg = _refused_untouched(odd, mesh)
    assert "parameter 'tiny' (Odd)" in msg and "parameter 'scale' (Odd)" in msg
    assert "param_init_fn" in msg and "parameter 'embed" not in msg

    with torch.device("meta"):
        model = WithRotary()
    snap = _snapshot(model)
    with pytest.raises(ValueError, match=r"buffer 'rot.inv_freq' \(Rotary\)"):
        autoshard(model, mesh=mesh)
    _assert_unchanged(model, snap)

    def fn(m):  # the rest, as param_init_fn covers it
        if isinstance(m, Rotary):
            m.inv_freq.copy_(m.compute(m.inv_freq.device))

    torch.manual_seed(0)
    ref = WithRotary()
    torch.manual_seed(0)
    autoshard(model, mesh=mesh, param_init_fn=fn)
    assert torch.equal(model.rot.inv_freq, ref.rot.inv_freq)
    assert torch.equal(model.proj.weight.to_local(), ref.proj.weight.detach())


def test_param_init_fn_that_writes_nothing_is_an_error(mesh):
    with torch.device("meta"):
        odd = Odd()
    snap = _snapshot(odd)
    with pytest.raises(ValueError, match="neither the module's reset_parameters"):
        autoshard(odd, mesh=mesh, param_init_fn=lambda m: None)
    _assert_unchanged(odd, snap)


class Broken(nn.Linear):
    def reset_parameters(self):
        if self.weight.device.type != "meta":
            raise RuntimeError("no init for you")


def test_failing_init_is_named_and_the_model_is_left_alone(mesh):
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), Broken(4, 4))
    msg = _refused_untouched(model, mesh, AutoshardError)
    assert "Broken.reset_parameters()" in msg and "'1'" in msg and "no init for you" in msg


class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(2, 2)
        self.b = nn.Linear(2, 2)


@torch.no_grad()
def _copy_sibling(m):
    if isinstance(m, Pair):
        m.b.weight.copy_(m.a.weight)  # reads another module's values


def _to_empty_everything(m):
    if isinstance(m, Pair):
        m.to_empty(device="cpu")  # replaces the submodules' tensors, not only its own


@pytest.mark.parametrize("fn, says", [(_copy_sibling, "reads the values of parameter 'a.weight'"),
                                      (_to_empty_everything, "replaced 'weight' of a submodule")])
def test_init_reaching_past_its_module_is_refused(mesh, fn, says):
    with torch.device("meta"):
        model = Pair()
    snap = _snapshot(model)
    with pytest.raises(AutoshardError, match=says):
        autoshard(model, mesh=mesh, param_init_fn=fn)
    _assert_unchanged(model, snap)
    assert all(p.device.type == "meta" for p in model.parameters())


# --- all or nothing ----------------------------------------------------------------------------


def test_fully_shard_submodule_is_named_and_nothing_changes(mesh):
    from torch.distributed.fsdp import fully_shard

    from autoshard.core.models import GPT

    torch.manual_seed(0)
    model = GPT()
    fully_shard(model.blocks[1], mesh=mesh)
    snap = _snapshot(model)
    with pytest.raises(ValueError) as e:
        autoshard(model, mesh=mesh)
    msg = str(e.value)
    assert "module 'blocks.1' (FSDPBlock)" in msg and "FSDP2's fully_shard()" in msg
    assert "autoshard it once" not in msg
    _assert_unchanged(model, snap)
    assert type(model.blocks[1]).__name__ == "FSDPBlock"


def test_dtensor_parameters_from_tensor_parallelism_are_named(mesh):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[1].weight = nn.Parameter(distribute_tensor(model[1].weight.detach(), mesh,
                                                     [Replicate()]))
    snap = _snapshot(model)
    with pytest.raises(ValueError) as e:
        autoshard(model, mesh=mesh)
    msg = str(e.value)
    assert "parameter '1.weight' is already a DTensor" in msg
    assert "tensor parallelism" in msg
    _assert_unchanged(model, snap)


def test_autosharded_submodule_is_named(mesh):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    autoshard(model[0], mesh=mesh)
    with pytest.raises(ValueError, match=r"module '0' \(ShardedLinear\) is already sharded"):
        autoshard(model, mesh=mesh)


NAMES = [
    ({"policy": Module(classes=["NoSuchBlock"])},
     "Config.policy.classes names 'NoSuchBlock', but no submodule of GPT is of that class; "
     "its classes: Embedding, ModuleList, Block, LayerNorm, Linear (did you mean 'Block'?)"),
    ({"policy": Module(pattern="layers")},
     "Config.policy.pattern='layers' matches no module path of GPT whole (re.fullmatch); its "
     "module paths: wte, wpe, blocks, blocks.0, blocks.0.ln1,"),
    ({"units": [["wte.weight"], ["blocks.0.attn.weight"]]},
     "Config.units[1] names 'blocks.0.attn.weight', which is not a parameter of GPT; its "
     "parameters: wte.weight, wpe.weight, blocks.0.ln1.weight,"),
    ({"recompute": {"blocks.0": "keep", "blocks.9": "block"}},
     "Config.recompute names block 'blocks.9', which is not a module of GPT; its repeated "
     "blocks: blocks.0, blocks.1 (did you mean 'blocks.1' or 'blocks.0'"),
]


@pytest.mark.parametrize("kwargs,says", NAMES, ids=[next(iter(k)) if len(k) == 1 else
                                                    list(k)[1] for k, _ in NAMES])
def test_config_names_that_match_nothing_are_refused_listing_what_exists(mesh, kwargs, says):
    model = GPT()
    snap = _snapshot(model)
    with pytest.raises(ValueError) as e:
        autoshard(model, mesh=mesh, config=Config(**kwargs))
    assert says in str(e.value)
    _assert_unchanged(model, snap)


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)

    def forward(self, x):
        h = self.norm(self.gate(x))
        if h.sum() > 0:  # data-dependent Python control flow: capture fails
            return h * 2
        return h


def test_capture_failure_with_example_inputs_leaves_the_model_whole(mesh):
    torch.manual_seed(0)
    model = Branchy()
    before = copy.deepcopy(model.state_dict())
    snap = _snapshot(model)
    with pytest.raises(AutoshardError, match="_local_scalar_dense"):
        autoshard(model, mesh=mesh, example_inputs=(torch.randn(3, 4),))
    _assert_unchanged(model, snap)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k

    # a meta-device model too: materialised, then put back on the meta device untouched
    with torch.device("meta"):
        meta_model = Branchy()
    snap = _snapshot(meta_model)
    with pytest.raises(AutoshardError, match="_local_scalar_dense"):
        autoshard(meta_model, mesh=mesh, example_inputs=(torch.randn(3, 4),))
    _assert_unchanged(meta_model, snap)
    assert all(p.device.type == "meta" for p in meta_model.parameters())


def test_example_inputs_compile_a_meta_model_up_front(mesh):
    ref, _, _ = _device_state("mlp")
    model = shard_on_meta("mlp", mesh=mesh, example_inputs=(torch.randn(2, 16),))
    assert len(model._autoshard.programs) == 1
    x = torch.randn(2, 16)
    torch.testing.assert_close(model(x), ref(x))
    assert len(model._autoshard.programs) == 1
