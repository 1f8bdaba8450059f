"""The example model shapes are the published ones."""

import torch


def test_llama3_shapes_have_the_published_parameter_counts():
    from autoshard.examples.llama_shapes import llama3_8b, llama3_70b

    with torch.device("meta"):  # no memory: planning needs none
        counts = [sum(p.numel() for p in f().parameters()) for f in (llama3_8b, llama3_70b)]
    assert counts == [8_030_261_248, 70_553_706_496]  # Meta's model cards: 8.03B, 70.55B
