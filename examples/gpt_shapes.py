"""GPT factories at the sizes people plan FSDP runs for, for ``python -m autoshard plan``.

    python -m autoshard plan autoshard.examples.gpt_shapes:gpt_175b --world-size 512 \
        --device-profile h100

1.3B, 13B and 175B are GPT-3's shapes (Brown et al., 2020: layers x width x heads
24x2048x16, 40x5120x40, 96x12288x96); 1T is the 128-layer, 25600-wide shape of
trillion-parameter GPT training (Narayanan et al., 2021), the scale the PyTorch FSDP paper
(Zhao et al., 2023) reports for GPT. Context 2048, vocabulary 50257, tied embeddings, and
attention through ``F.scaled_dot_product_attention`` as such runs use a fused kernel (written
out, the attention scores alone of one GPT-1T layer at batch 1 take 2.5 GiB in fp32).
The CLI builds them on the meta device: planning needs no parameter memory.
"""

from autoshard.core.models import GPT

SEQ = 2048
VOCAB = 50257


def _gpt(layers, dim, heads):
    return GPT(vocab=VOCAB, dim=dim, heads=heads, layers=layers, seq=SEQ, fused_attention=True)


def gpt_1_3b():
    return _gpt(24, 2048, 16)


def gpt_13b():
    return _gpt(40, 5120, 40)


def gpt_175b():
    return _gpt(96, 12288, 96)


def gpt_1t():
    return _gpt(128, 25600, 160)


def gpt_small():
    """The small GPT of the tests, for quick looks."""
    return GPT()
