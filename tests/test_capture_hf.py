"""Hugging Face models whose forward checks a tensor's value: LLaVA asserts that its input
holds one image token per image feature (``torch_compilable_check`` on a count read from
``input_ids``). The check runs inside the captured step, as eager runs it: the sharded
model trains as eager does, and a wrong count raises at run time, naming the check."""

import pytest
import torch

from autoshard.core.models import tiny_hf
from tests.harness import eager_and_sharded

VOCAB, FEATURES = 96, 16  # tiny_hf("llava"): 16 image features per 16 x 16 image


def _batch(images_tokens: int = FEATURES):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB - 1, (2, 24), generator=g)
    ids[:, 2:2 + images_tokens] = VOCAB - 1  # the image token, once per image feature
    pixels = torch.randn(2, 3, 16, 16, generator=g)
    return ids, pixels


def test_llava_trains_as_eager_with_its_image_token_check_in_the_step():
    ref, sharded = eager_and_sharded(lambda: tiny_hf("llava", vocab=VOCAB, hidden=32))
    ids, pixels = _batch()
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt_s = torch.optim.SGD(sharded.parameters(), lr=0.1)
    for step in range(3):
        a = ref(input_ids=ids, pixel_values=pixels, labels=ids).loss
        b = sharded(input_ids=ids, pixel_values=pixels, labels=ids).loss
        assert abs(a.item() - b.item()) <= 1e-5, (step, a.item(), b.item())
        for loss, opt in ((a, opt_r), (b, opt_s)):
            loss.backward()
            opt.step()
            opt.zero_grad()
    for (name, p), q in zip(ref.named_parameters(), sharded.parameters()):
        torch.testing.assert_close(q.full_tensor(), p.detach(), rtol=0, atol=1e-5, msg=name)
    assert sum(len(v) for v in sharded._autoshard.variants.values()) == 1  # one capture


def test_llava_with_a_wrong_image_token_count_raises_at_run_time_naming_the_check():
    ref, sharded = eager_and_sharded(lambda: tiny_hf("llava", vocab=VOCAB, hidden=32))
    ids, pixels = _batch()
    sharded(input_ids=ids, pixel_values=pixels, labels=ids).loss.backward()  # captured
    bad, _ = _batch(FEATURES - 1)  # the same shapes: the captured step runs again
    with pytest.raises(ValueError, match="Image features and image tokens do not match"):
        ref(input_ids=bad, pixel_values=pixels, labels=bad)
    with pytest.raises(RuntimeError, match="Image features and image tokens do not match"):
        sharded(input_ids=bad, pixel_values=pixels, labels=bad)
