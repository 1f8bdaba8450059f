"""A captured step never goes stale: every Python-level value its forward read is guarded.

Each test changes something the forward reads between calls, as a training loop does, and
compares the sharded model (world size 1, in this process) with an unsharded copy run
eagerly beside it. On a step with no guards each of these kept the value it was captured
with, silently.
"""

import types
import warnings

import pytest
import torch
import torch.nn as nn

from autoshard import AutoshardError
from autoshard.front.calls import RECAPTURE_LIMIT
from harness import eager_and_sharded

SCALE = 1.0  # a module-level global the forward reads


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.act = nn.GELU()
        self.b = nn.Linear(16, 4)
        self.temperature = 1.0  # annealed by the loop
        self.double_it = False  # a flag
        self.offset = torch.zeros(4)  # a plain tensor attribute, not a buffer
        self.cfg = types.SimpleNamespace(shift=0.0, scales={"out": 1.0})  # a config object
        self.level = 0  # an int the graph's shape of computation depends on

    def forward(self, x):
        h = self.act(self.a(x)) / self.temperature
        if self.double_it:
            h = h * 2
        for _ in range(self.level):
            h = h + 1
        return self.b(h) * SCALE * self.cfg.scales["out"] + self.offset + self.cfg.shift


def _pair(cls=Net):
    return eager_and_sharded(cls)


def _same(ref, sharded, x, tol=1e-6):
    a, b = ref(x), sharded(x)
    assert (a - b).abs().max().item() <= tol, f"{a} vs {b}"
    return a, b


def _programs(sharded) -> int:
    return sum(len(v) for v in sharded._autoshard.variants.values())


def test_changes_to_what_forward_reads_are_followed():
    ref, sharded = _pair()
    x = torch.randn(3, 8)
    _same(ref, sharded, x)
    for t in (0.9, 0.8, 0.7, 0.6):  # annealed every step: read as an input after one change
        ref.temperature = sharded.temperature = t
        _same(ref, sharded, x)
    assert _programs(sharded) == 2
    ref.double_it = sharded.double_it = True
    _same(ref, sharded, x)
    ref.offset = sharded.offset = torch.full((4,), 3.0)  # reassigned
    _same(ref, sharded, x)
    with torch.no_grad():  # written in place
        ref.offset.add_(1.0)
        sharded.offset.add_(1.0)
    _same(ref, sharded, x)
    ref.cfg.shift = sharded.cfg.shift = 0.5
    _same(ref, sharded, x)
    ref.cfg.scales["out"] = sharded.cfg.scales["out"] = 2.0  # a dict inside the config
    _same(ref, sharded, x)
    global SCALE
    try:
        SCALE = 3.0
        _same(ref, sharded, x)
    finally:
        SCALE = 1.0
    _same(ref, sharded, x)
    ref.act = nn.ReLU()  # a parameter-free submodule replaced: captured again
    sharded.act = nn.ReLU()
    _same(ref, sharded, x)
    ref.act.train(False)  # a submodule's own mode
    sharded.act.train(False)
    _same(ref, sharded, x)


def test_a_value_changing_on_every_call_is_refused_after_the_limit_naming_it():
    ref, sharded = _pair()
    x = torch.randn(3, 8)
    with pytest.raises(AutoshardError, match="attribute 'level' of module '\\(root\\)'"):
        for level in range(RECAPTURE_LIMIT + 2):
            sharded.level = ref.level = level
            _same(ref, sharded, x)
    assert sharded.level == RECAPTURE_LIMIT  # refused at the limit-th change, not before


def test_closure_variables_are_guarded():
    def make(k):
        def scaled(x):
            return x * k
        return scaled

    class Closure(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.k = [2.0]

        def forward(self, x):
            return fn(self.lin(x))

    fn = make(2.0)
    ref, sharded = _pair(Closure)
    x = torch.randn(2, 4)
    _same(ref, sharded, x)
    fn.__closure__[0].cell_contents = 5.0
    _same(ref, sharded, x)


def test_a_new_parameter_after_autoshard_is_refused_naming_it():
    ref, sharded = _pair()
    x = torch.randn(3, 8)
    _same(ref, sharded, x)
    sharded.b = nn.Linear(16, 4)
    with pytest.raises(AutoshardError, match="'b' replaced.*parameter 'b.weight' is not sharded"):
        sharded(x)


class CastsItsInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x):
        return self.lin(x.to(self.lin.weight.dtype))


def test_a_dtype_change_after_a_call_captures_again():
    ref, sharded = _pair(CastsItsInput)
    x = torch.randn(3, 8)
    _same(ref, sharded, x)
    ref.double()
    sharded.double()  # the same float32 input: only the parameters say what changed
    a, b = _same(ref, sharded, x, tol=1e-12)
    assert b.dtype == torch.float64
    b.sum().backward()
    assert all(p.grad.dtype == torch.float64 for p in sharded.parameters())


class Noisy(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.how = how

    def forward(self, x):
        import random
        import time

        import numpy as np

        if self.how == "random" and random.random() < 2.0:
            x = x * 2
        if self.how == "randint" and random.randint(0, 3) >= 0:
            x = x * 2
        if self.how == "unseeded" and random.Random().random() < 2.0:
            x = x * 2
        if self.how == "seeded" and random.Random(0).random() < 2.0:
            x = x * 2  # the same draw on every call: nothing to refuse
        if self.how == "numpy":
            x = x * float(np.random.rand())
        if self.how == "time":
            x = x * (time.time() > 0)
        if self.how == "print":
            print("forward ran")
        return self.lin(x)


@pytest.mark.parametrize("how,call", [
    ("random", "random.random at .*test_guards.py"),
    ("randint", "random.randint at .*test_guards.py"),
    ("unseeded", "random.__init__ at .*test_guards.py"),
    ("numpy", "numpy.random"),  # a compiled function: seen by the state it advanced
    ("time", "time.time at .*test_guards.py")])
def test_python_random_and_the_clock_in_forward_are_refused_naming_the_call(how, call):
    _, sharded = _pair(lambda: Noisy(how))
    with pytest.raises(AutoshardError, match=f"calls {call}"):
        sharded(torch.randn(2, 4))


def test_a_generator_the_forward_seeds_itself_is_allowed():
    _, sharded = _pair(lambda: Noisy("seeded"))
    sharded(torch.randn(2, 4))


def test_print_in_forward_warns_that_it_ran_at_capture_only():
    _, sharded = _pair(lambda: Noisy("print"))
    with pytest.warns(UserWarning, match="print\\(\\) in the model's forward .* ran once"):
        sharded(torch.randn(2, 4))


def _watched():
    """A pair of models (eager, sharded), an input, and a record per model of what its hooks
    saw."""
    return (*_pair(), torch.randn(3, 8), {"ref": [], "sharded": []})


def test_forward_hooks_run_on_every_call_with_real_tensors():
    ref, sharded, x, seen = _watched()

    def watcher(tag):
        def hook(mod, args, out):
            assert type(out) is torch.Tensor  # a real tensor, not a fake one
            seen[tag].append(out.detach().clone())
        return hook

    def pre(tag):
        def hook(mod, args, kwargs):
            seen[tag].append(args[0].detach().clone())
        return hook

    ref.a.register_forward_hook(watcher("ref"))  # registered before the first call
    sharded.a.register_forward_hook(watcher("sharded"))
    for _ in range(2):
        _same(ref, sharded, x)
    ref.b.register_forward_pre_hook(pre("ref"), with_kwargs=True)  # and after it
    sharded.b.register_forward_pre_hook(pre("sharded"), with_kwargs=True)
    for _ in range(2):
        _same(ref, sharded, x)
    assert len(seen["ref"]) == len(seen["sharded"]) == 6
    for a, b in zip(seen["ref"], seen["sharded"]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_a_hook_that_changes_the_output_is_traced_and_trains_as_in_eager():
    ref, sharded = _pair()
    x = torch.randn(3, 8)
    _same(ref, sharded, x)  # captured without hooks; they come after
    for m in (ref, sharded):
        m.a.register_forward_hook(lambda mod, args, out: out * 0.5)
        m.register_forward_pre_hook(lambda mod, args: (args[0] + 1,))
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt_s = torch.optim.SGD(sharded.parameters(), lr=0.1)
    for _ in range(3):
        a, b = _same(ref, sharded, x, tol=1e-5)
        a.square().sum().backward()
        b.square().sum().backward()
        opt_r.step(), opt_s.step(), opt_r.zero_grad(), opt_s.zero_grad()
    for p, q in zip(ref.parameters(), sharded.parameters()):
        torch.testing.assert_close(p.detach(), q.full_tensor(), rtol=0, atol=1e-6)


def test_a_hook_traced_into_the_step_says_once_that_its_python_runs_at_capture():
    """A forward hook that returns a value runs inside the step: its Python side effects
    (a counter here) do not run once per call as in eager, and autoshard says so, once."""
    _, sharded = _pair()
    calls = []

    def doubling(mod, args, out):
        calls.append(1)
        return out * 2

    sharded.a.register_forward_hook(doubling)
    x = torch.randn(3, 8)
    with pytest.warns(UserWarning, match="forward hook .*doubling on Linear returned a value"):
        sharded(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once: not again at later calls
        for _ in range(3):
            sharded(x)
    assert 1 <= len(calls) < 4  # at captures only, as the warning says


def test_module_backward_hooks_run_on_every_backward_with_real_gradients():
    ref, sharded, x, seen = _watched()

    def watcher(tag):
        def full(mod, grad_input, grad_output):
            seen[tag].append([None if g is None else g.clone() for g in grad_input + grad_output])

        def pre(mod, grad_output):
            seen[tag].append([g.clone() for g in grad_output])
        return full, pre

    for tag, m in (("ref", ref), ("sharded", sharded)):
        full, pre = watcher(tag)
        m.a.register_full_backward_hook(full)  # its input needs no gradient: None, as in eager
        m.b.register_full_backward_pre_hook(pre)
    for _ in range(2):
        a, b = _same(ref, sharded, x)
        a.square().sum().backward()
        b.square().sum().backward()
    assert len(seen["ref"]) == len(seen["sharded"]) == 4
    for want, got in zip(seen["ref"], seen["sharded"]):
        assert [g is None for g in want] == [g is None for g in got]
        for w, g in zip(want, got):
            if w is not None:
                torch.testing.assert_close(g, w, rtol=0, atol=1e-6)


def test_a_backward_hook_that_replaces_gradients_is_named_then_traced():
    ref, sharded = _pair()
    x = torch.randn(3, 8)
    for m in (ref, sharded):
        m.b.register_full_backward_hook(lambda mod, gin, gout: (gin[0] * 0.5,))
    ref(x).square().sum().backward()
    with pytest.raises(AutoshardError, match="returned replacement gradients.*not accumulated"):
        sharded(x).square().sum().backward()
    assert all(p.grad is None for p in sharded.parameters())
    sharded(x).square().sum().backward()  # traced from now on
    for p, q in zip(ref.parameters(), sharded.parameters()):
        torch.testing.assert_close(q.grad.full_tensor(), p.grad, rtol=0, atol=1e-6)


def test_a_deprecated_backward_hook_is_refused_naming_the_module():
    _, sharded = _pair()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sharded.b.register_backward_hook(lambda mod, gin, gout: None)
    with pytest.raises(AutoshardError, match="module 'b' \\(Linear\\) has a backward hook "
                                             "registered with register_backward_hook"):
        sharded(torch.randn(3, 8))


def test_optimizer_in_backward_trains_like_the_plain_loop():
    """torchtune's optimizer-in-backward: one optimizer per parameter, stepped from the
    parameter's post-accumulate-grad hook (FSDP2 calls it once per backward, sharded)."""
    ref, sharded = _pair()
    x = torch.randn(3, 8)
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opts = {p: torch.optim.AdamW([p], lr=1e-2) for p in sharded.parameters()}
    calls = []

    def step(p):
        calls.append(p)
        opts[p].step()
        opts[p].zero_grad()

    for p in sharded.parameters():
        p.register_post_accumulate_grad_hook(step)
    for _ in range(3):
        a, b = _same(ref, sharded, x, tol=1e-5)
        a.square().sum().backward()
        opt_r.step()
        opt_r.zero_grad()
        b.square().sum().backward()
    assert len(calls) == 3 * len(list(sharded.parameters()))
    for p, q in zip(ref.parameters(), sharded.parameters()):
        torch.testing.assert_close(p.detach(), q.full_tensor(), rtol=0, atol=1e-6)


def test_capture_under_another_profiler_says_what_goes_unguarded():
    import cProfile

    ref, sharded = _pair()
    x = torch.randn(3, 8)
    with pytest.warns(UserWarning, match="profiler was running.*not guarded"):
        with cProfile.Profile():
            _same(ref, sharded, x)
    ref.temperature = sharded.temperature = 0.5  # module attributes are still guarded
    _same(ref, sharded, x)


class Recording(nn.Module):
    """A forward that records its layers' outputs through forward hooks it installs on its
    first call, and returns what they recorded (as Hugging Face's output recorders do)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.installed = False
        self.recorded = None

    def forward(self, x):
        if not self.installed:
            for layer in self.layers:
                layer.register_forward_hook(
                    lambda mod, args, out: None if self.recorded is None
                    else self.recorded.append(out))
            self.installed = True
        self.recorded = []
        try:
            for layer in self.layers:
                x = torch.tanh(layer(x))
            return x, tuple(self.recorded)
        finally:
            self.recorded = None


def test_hooks_the_forward_installs_and_reads_stay_in_every_capture():
    """The hooks run inside the step in every capture (train, eval, a new input shape), not
    only in the one that installed them: after the step they would record into nothing."""
    ref, sharded = _pair(Recording)
    for x, train in ((torch.randn(3, 8), True), (torch.randn(3, 8), False),
                     (torch.randn(5, 8), True)):
        ref.train(train), sharded.train(train)
        (a, ra), (b, rb) = ref(x), sharded(x)
        assert len(ra) == len(rb) == 3, (train, x.shape, len(rb))
        for want, got in zip((a, *ra), (b, *rb)):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)



def test_the_checks_made_together_name_what_the_scan_in_order_names():
    """The tree, hook and identity guards are checked together, in C (``Guards.failure``);
    a change still fails the program naming the guard a scan in order names, and a value
    reassigned to an equal new object still holds."""
    ref, sharded = _pair()
    x = torch.randn(3, 8)
    _same(ref, sharded, x)
    g = sharded._autoshard.last.captured.guards
    assert g.failure() is None
    sharded.temperature = float("1.0")  # equal, another object
    assert sharded.temperature is not ref.temperature and g.failure() is None
    h = sharded.b.register_forward_hook(lambda m, i, o: None)
    assert g.failure().what == "hooks of module 'b'"
    h.remove()
    assert g.failure() is None
    h1 = sharded.a.register_forward_hook(lambda m, i, o: None)
    h2 = sharded.a.register_forward_hook(lambda m, i, o: None)
    was = g.failure().what
    h1.remove()
    h2.remove()
    h3 = sharded.a.register_forward_hook(lambda m, i, o: None, prepend=True)
    assert was == g.failure().what == "hooks of module 'a'"
    h3.remove()
    h = nn.modules.module.register_module_forward_hook(lambda m, i, o: None)
    try:
        assert g.failure().what == "global module hooks"
    finally:
        h.remove()
    assert g.failure() is None
    act = sharded.act
    sharded.act = nn.GELU()  # the same kind of module, another object
    assert g.failure().what == "module '(root)' modules"
    sharded.act = act
    assert g.failure() is None
    sharded.double_it = 0  # == False, but an int: a change, as the scan in order says
    assert g.failure().what.startswith("attribute 'double_it'")
