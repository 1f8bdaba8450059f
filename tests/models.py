"""Models the tests train: small, deterministic given a seed, and each exercising a case."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from autoshard.core.models import GPT, gpt_loss, tiny_hf

VOCAB = 96


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(16, 16) for _ in range(3)])
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.out(x)


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        )
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        return self.head(self.features(x).mean(dim=(2, 3)))


class Odd(nn.Module):
    """A frozen parameter, dim-0 sizes 7, 1 and 5 (not divisible by 2 or 4), and a scalar."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(6, 7)
        self.frozen = nn.Linear(7, 7)
        self.frozen.requires_grad_(False)
        self.tiny = nn.Parameter(torch.randn(1, 7))
        self.scale = nn.Parameter(torch.tensor(0.5))
        self.out = nn.Linear(7, 5)

    def forward(self, x):
        h = torch.relu(self.embed(x)) + self.tiny
        h = self.frozen(h) * self.scale
        return self.out(h)


class CheckpointedGPT(GPT):
    """The GPT with each block under torch.utils.checkpoint: even blocks non-reentrant, odd
    blocks reentrant."""

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for i, blk in enumerate(self.blocks):
            x = checkpoint(blk, x, use_reentrant=bool(i % 2))
        return self.head(self.ln_f(x))


def _hf(name):
    return tiny_hf(name, VOCAB)


def t5():
    """Hugging Face T5 (encoder-decoder) at a tiny random configuration."""
    return tiny_hf("t5", VOCAB)


def vit():
    """Hugging Face ViT image classifier at a tiny random configuration."""
    return tiny_hf("vit", 5, qkv_bias=False)


def _logits(out, y):
    return F.cross_entropy(out.logits, y)


def _lm_loss(out, y):
    logits = out.logits if hasattr(out, "logits") else out
    return gpt_loss(logits, y)


def _tokens(gen, batch):
    x = torch.randint(0, VOCAB, (batch, 16), generator=gen)
    return x, torch.roll(x, -1, dims=1)


# name -> (build, data(gen, batch) -> (x, y), inputs(x) -> model args or kwargs, loss(out, y))
CASES = {
    "mlp": (MLP, lambda g, b: (torch.randn(b, 16, generator=g), torch.randn(b, 4, generator=g)),
            lambda x: (x,), F.mse_loss),
    "gpt": (GPT, _tokens, lambda x: (x,), _lm_loss),
    "cnn": (CNN, lambda g, b: (torch.randn(b, 3, 8, 8, generator=g),
                               torch.randint(0, 5, (b,), generator=g)),
            lambda x: (x,), F.cross_entropy),
    "odd": (Odd, lambda g, b: (torch.randn(b, 6, generator=g), torch.randn(b, 5, generator=g)),
            lambda x: (x,), F.mse_loss),
    "hf_gpt2": (lambda: _hf("gpt2"), _tokens, lambda x: {"input_ids": x}, _lm_loss),
    "hf_llama": (lambda: _hf("llama"), _tokens, lambda x: {"input_ids": x}, _lm_loss),
    "hf_bert": (lambda: _hf("bert"), _tokens, lambda x: {"input_ids": x}, _lm_loss),
    "hf_mixtral": (lambda: _hf("mixtral"), _tokens, lambda x: {"input_ids": x}, _lm_loss),
    "hf_qwen3_moe": (lambda: _hf("qwen3_moe"), _tokens, lambda x: {"input_ids": x}, _lm_loss),
    "hf_deepseek_v3": (lambda: _hf("deepseek_v3"), _tokens, lambda x: {"input_ids": x},
                       _lm_loss),
    "gpt_ckpt": (CheckpointedGPT, _tokens, lambda x: (x,), _lm_loss),
    "hf_t5": (t5, _tokens, lambda x: {"input_ids": x, "decoder_input_ids": x}, _lm_loss),
    "hf_vit": (vit, lambda g, b: (torch.randn(b, 3, 16, 16, generator=g),
                                  torch.randint(0, 5, (b,), generator=g)),
               lambda x: {"pixel_values": x}, _logits),
}


def call(name, model, x):
    """The model on input ``x`` as the case calls it."""
    inputs = CASES[name][2](x)
    return model(**inputs) if isinstance(inputs, dict) else model(*inputs)


def build(name):
    torch.manual_seed(0)
    return CASES[name][0]()


class Recurrent(nn.Module):
    """A recurrent layer (nn.LSTM or nn.GRU: bidirectional, two layers) and a linear head on
    (batch, time, features) inputs, the layer called batch-first or time-first, with dropout
    between its layers or none, optionally under torch.utils.checkpoint."""

    def __init__(self, cls=nn.LSTM, batch_first=True, dropout=0.0, checkpointed=False):
        super().__init__()
        self.rnn = cls(5, 6, num_layers=2, bidirectional=True, batch_first=batch_first,
                       dropout=dropout)
        self.head = nn.Linear(12, 3)
        self.checkpointed = checkpointed

    def _rnn(self, x):
        if not self.rnn.batch_first:
            return self.rnn(x.transpose(0, 1))[0].transpose(0, 1)
        return self.rnn(x)[0]

    def forward(self, x):
        h = checkpoint(self._rnn, x, use_reentrant=False) if self.checkpointed else self._rnn(x)
        return self.head(h)


class TinyNorm(nn.Module):
    """Parameters no larger than two ranks: a BatchNorm1d(2) (one row per rank at world size
    2), a Linear into it with 2 rows, and a (1, 3) parameter (fewer rows than ranks)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 2)
        self.norm = nn.BatchNorm1d(2)
        self.out = nn.Linear(2, 3)
        self.shift = nn.Parameter(torch.randn(1, 3))

    def forward(self, x):
        return self.out(torch.relu(self.norm(self.inp(x)))) + self.shift
