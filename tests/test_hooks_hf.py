"""Hugging Face's output recorders: transformers 5 records hidden states and router logits
through forward hooks it installs on the first call that asks for them, and the same
forward returns what they recorded. The hooks are traced with the step in every capture
(train, eval, another input shape, a model called eagerly before ``autoshard()``); kept out
of it, they would record into nothing after the step ran. World size 1, against eager."""

import copy
import warnings

import pytest
import torch

from autoshard import autoshard
from autoshard.core.models import tiny_hf

VOCAB = 96


def _pair(name, called_before=False, **kw):
    torch.manual_seed(0)
    ref = tiny_hf(name, vocab=VOCAB, hidden=32, layers=2)
    model = copy.deepcopy(ref)
    if called_before:  # transformers installs its recorders on this call
        model(torch.randint(0, VOCAB, (2, 8)), **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # world size 1 says so
        return ref, autoshard(model)


def _compare(ref, sharded, x, field, kw, expect):
    a, b = ref(x, **kw), sharded(x, **kw)
    want, got = getattr(a, field), getattr(b, field)
    assert len(want) == expect and len(got) == expect, (field, len(want), len(got))
    for w, g in zip((a.logits, *want), (b.logits, *got)):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5)
    return a, b


def test_llama_hidden_states_in_every_capture():
    kw = {"output_hidden_states": True}
    ref, sharded = _pair("llama")
    x = torch.randint(0, VOCAB, (2, 8))
    a, b = _compare(ref, sharded, x, "hidden_states", kw, 3)  # train: layers + 1
    a.logits.sum().backward()
    b.logits.sum().backward()
    _compare(ref, sharded, torch.randint(0, VOCAB, (2, 12)), "hidden_states", kw, 3)
    ref.eval(), sharded.eval()
    with torch.no_grad():
        _compare(ref, sharded, x, "hidden_states", kw, 3)


@pytest.mark.parametrize("called_before", [False, True])
def test_qwen3_moe_router_logits_in_every_capture(called_before):
    kw = {"output_router_logits": True}
    ref, sharded = _pair("qwen3_moe", called_before, **kw)
    x = torch.randint(0, VOCAB, (2, 8))
    a, b = _compare(ref, sharded, x, "router_logits", kw, 2)  # one per MoE layer
    a.logits.sum().backward()
    b.logits.sum().backward()
    for (k, p), q in zip(ref.named_parameters(), sharded.parameters()):
        torch.testing.assert_close(q.grad.full_tensor(), p.grad, rtol=0, atol=1e-5, msg=k)
    ref.eval(), sharded.eval()
    with torch.no_grad():
        _compare(ref, sharded, x, "router_logits", kw, 2)
