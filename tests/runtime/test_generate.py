"""Hugging Face ``generate`` with the KV cache: the cache object passes into the captured
forward, is updated in place as eager updates it, and comes back out; a cache the forward
creates is returned built from the graph's outputs. The tokens equal eager's."""

import warnings

import torch

from autoshard import autoshard
from autoshard.core.models import tiny_hf
from entry_workers import generate_worker
from harness import run_ranks


def _pair():
    torch.manual_seed(0)
    ref, model = tiny_hf("llama", use_cache=True), tiny_hf("llama", use_cache=True)
    model.load_state_dict(ref.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # world size 1 says so
        return ref.eval(), autoshard(model.eval())


def test_cache_objects_pass_in_and_out_of_forward_as_in_eager():
    from transformers import DynamicCache

    ref, sharded = _pair()
    x = torch.randint(1, 96, (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = ref(x, use_cache=True), sharded(x, use_cache=True)  # the forward creates one
        assert isinstance(b.past_key_values, DynamicCache)
        ca, cb = a.past_key_values, b.past_key_values
        nxt = torch.randint(1, 96, (2, 1), generator=torch.Generator().manual_seed(2))
        a2 = ref(nxt, past_key_values=ca, use_cache=True)  # passed in, updated in place
        b2 = sharded(nxt, past_key_values=cb, use_cache=True)
    assert b2.past_key_values is cb
    torch.testing.assert_close(b2.logits, a2.logits, rtol=0, atol=1e-6)
    for la, lb in zip(ca.layers, cb.layers):
        assert lb.keys.shape == la.keys.shape and la.keys.shape[2] == 6  # 5 + 1 positions
        torch.testing.assert_close(lb.keys, la.keys, rtol=0, atol=1e-6)
        torch.testing.assert_close(lb.values, la.values, rtol=0, atol=1e-6)


def test_generate_with_the_kv_cache_gives_eagers_tokens_world_1():
    ref, sharded = _pair()
    x = torch.randint(1, 96, (2, 5), generator=torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=5, do_sample=False, attention_mask=torch.ones_like(x))
    assert torch.equal(sharded.generate(x, **kw), ref.generate(x, **kw))


def test_generate_with_the_kv_cache_gives_eagers_tokens_world_2():
    for r in run_ranks(2, generate_worker, None):
        assert torch.equal(r["got"], r["want"])
