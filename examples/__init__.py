"""Runnable examples, installed as ``autoshard.examples``.

- ``gpt_shapes``: GPT 1.3B, 13B, 175B and 1T factories for ``python -m autoshard plan``;
- ``train_gpt``: a plain training loop for torchrun
  (``torchrun --nproc-per-node 2 -m autoshard.examples.train_gpt``).
"""
