"""Recomputation never changes a value: random forwards that mix in-place writes (on tensors
and on views of them) with reads before and after train to eager's outputs and gradients, with
recomputation on and off (world size 1, this process, fp32)."""

import copy
import random

import pytest
import torch
import torch.nn as nn

from autoshard import Config, autoshard
from autoshard.core import meta
from autoshard.passes import recompute_activations_pass, run_passes
from autoshard.passes.verify import VerificationError, _check_split_recomputed
from autoshard.passes.split import split_pass
import autoshard.passes.remat as remat
from graphs import captured

SEEDS = range(40)
TOL = 1e-5
ROWS = torch.tensor([0, 2, 3])


def _pick(rng, pool):
    return rng.randrange(len(pool))


# each op: (name, fn(model, pool, rng) -> None), appending new values or writing one in place
def _read(m, pool, rng):
    t = pool[_pick(rng, pool)]
    f = rng.choice([torch.tanh, torch.sigmoid, torch.exp, lambda z: z * z,
                    lambda z: z.sum(-1, keepdim=True).expand_as(z),
                    lambda z: torch.softmax(z, -1), lambda z: m.mix(z)])
    pool.append(f(t))


def _binary(m, pool, rng):
    a, b = pool[_pick(rng, pool)], pool[_pick(rng, pool)]
    pool.append(rng.choice([torch.add, torch.mul, torch.sub])(a, b))


def _mul_(m, pool, rng):
    pool[_pick(rng, pool)].mul_(pool[_pick(rng, pool)])


def _div_(m, pool, rng):
    pool[_pick(rng, pool)].div_(pool[_pick(rng, pool)].abs() + 1.5)


def _relu_(m, pool, rng):
    pool[_pick(rng, pool)].relu_()


def _masked_fill_(m, pool, rng):
    pool[_pick(rng, pool)].masked_fill_(pool[_pick(rng, pool)] > 0.1, 0.25)


def _index_put_(m, pool, rng):
    dst, src = pool[_pick(rng, pool)], pool[_pick(rng, pool)]
    dst.index_put_((ROWS,), src[: len(ROWS)] * 0.5, accumulate=rng.random() < 0.5)


def _copy_(m, pool, rng):
    pool[_pick(rng, pool)].copy_(pool[_pick(rng, pool)] * 1.5)


def _view_write(m, pool, rng):
    t = pool[_pick(rng, pool)]
    view = rng.choice([lambda z: z[:, :4], lambda z: z.t()[2:6], lambda z: z.view(-1)[::3],
                       lambda z: z.unsqueeze(0)[0, 1:]])(t)
    rng.choice([lambda v: v.mul_(-2.0), lambda v: v.add_(1.0), lambda v: v.relu_(),
                lambda v: v.div_(3.0)])(view)


def _router(m, pool, rng):
    """Top-k routing weights renormalised in place, as Mixtral-style routers do."""
    v, i = torch.topk(torch.softmax(m.gate(pool[_pick(rng, pool)]), -1), 2)
    v /= v.sum(-1, keepdim=True)
    pool.append(v.repeat(1, 4) * (i.float() + 1).repeat(1, 4))


def _fork(m, pool, rng):
    """A fresh value nothing saves yet: somewhere for later writes to land."""
    pool.append(pool[_pick(rng, pool)] + pool[_pick(rng, pool)])


OPS = [_fork, _fork, _read, _binary, _mul_, _div_, _relu_, _masked_fill_, _index_put_, _copy_,
       _view_write, _router]


class RandomNet(nn.Module):
    def __init__(self, seed):
        super().__init__()
        self.seed = seed
        self.inp = nn.Linear(8, 8)
        self.mix = nn.Linear(8, 8)
        self.gate = nn.Linear(8, 4)
        g = torch.Generator().manual_seed(seed)
        self.register_buffer("proj", torch.randn(8, 8, generator=g))

    def forward(self, x):
        rng = random.Random(self.seed)  # the same program on every call
        pool = [self.inp(x), torch.tanh(self.mix(x))]
        for _ in range(rng.randint(4, 9)):
            rng.choice(OPS)(self, pool, rng)
        return sum((t * self.proj[k % 8]).sum() for k, t in enumerate(pool))


def _eager(model, x):
    out = model(x)
    out.backward()
    return out.detach(), {n: p.grad for n, p in model.named_parameters()}


def _compiled(model, x, recompute):
    sharded = autoshard(model, config=Config(recompute=recompute, verify=True,
                                             policy="whole-model"))
    out = sharded(x)
    out.backward()
    grads = {n: None if p.grad is None else p.grad.full_tensor()
             for n, p in sharded.named_parameters()}
    again = sum(1 for n in sharded._autoshard.last.split.bwd.graph.nodes
                if meta.tag(n, meta.RECOMPUTED))
    return out.detach(), grads, again


def _valid_program(seed, x):
    """The first program from ``seed``'s sub-seeds that eager accepts (eager refuses to
    backward through a value it saved that was then overwritten)."""
    for sub in range(50):
        torch.manual_seed(seed)
        model = RandomNet(1000 * seed + sub)
        try:
            return model, _eager(copy.deepcopy(model), x)
        except RuntimeError as e:
            assert "inplace operation" in str(e) or "memory location" in str(e), e
    raise AssertionError(f"no valid program among seed {seed}'s sub-seeds")


def test_random_inplace_forwards_match_eager_with_and_without_recompute():
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(7))
    recomputed = 0
    for seed in SEEDS:
        model, (ref_out, ref_grads) = _valid_program(seed, x)
        for recompute in (True, False):
            out, grads, again = _compiled(copy.deepcopy(model), x, recompute)
            recomputed += again > 0
            assert (out - ref_out).abs().item() <= TOL * max(1.0, ref_out.abs().item()), seed
            for name, g in ref_grads.items():
                assert (g is None) == (grads[name] is None), (seed, name)
                if g is not None:
                    d = (grads[name] - g).abs().max().item()
                    scale = max(1.0, g.abs().max().item())
                    assert d <= TOL * scale, f"seed {seed} recompute {recompute} {name}: {d:.3g}"
    assert recomputed >= len(SEEDS) // 2, f"only {recomputed} programs recomputed anything"


def test_unsafe_recomputation_is_rejected_on_the_joint_and_on_the_split_graphs(monkeypatch):
    """Recomputing a read of the router's top-k weights after ``v /= v.sum()`` rewrote them is
    what gave wrong router gradients; the verifier refuses such a graph."""

    class Router(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate, self.out = nn.Linear(8, 4), nn.Linear(8, 2)

        def forward(self, x):
            v, _ = torch.topk(torch.softmax(self.gate(x), -1), 2)
            v /= v.sum(-1, keepdim=True)
            return (self.out(x) * v).sum()

    monkeypatch.setattr(remat, "reads_mutated", lambda n, mutated: False)
    gm, ctx = captured(Router(), torch.randn(5, 8))
    with pytest.raises(VerificationError, match="written in place"):
        run_passes(gm, ctx, [(recompute_activations_pass, {})], verify_each=True)
    monkeypatch.delenv("AUTOSHARD_VERIFY")
    gm, ctx = captured(Router(), torch.randn(5, 8))
    _, ctx = run_passes(gm, ctx, [(recompute_activations_pass, {}), (split_pass, {})])
    with pytest.raises(VerificationError, match="written in place"):
        _check_split_recomputed(ctx.split)
