"""Models the tests train: small, deterministic given a seed, and each exercising a case."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from autoshard.models import GPT, gpt_loss, tiny_hf

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


def _hf(name):
    return tiny_hf(name, VOCAB)


def _lm_loss(out, y):
    logits = out.logits if hasattr(out, "logits") else out
    return gpt_loss(logits, y)


def _tokens(gen, batch):
    x = torch.randint(0, VOCAB, (batch, 16), generator=gen)
    return x, torch.roll(x, -1, dims=1)


# name -> (build, data(gen, batch) -> (x, y), call(model, x), loss(out, y))
CASES = {
    "mlp": (MLP, lambda g, b: (torch.randn(b, 16, generator=g), torch.randn(b, 4, generator=g)),
            lambda m, x: m(x), F.mse_loss),
    "gpt": (GPT, _tokens, lambda m, x: m(x), _lm_loss),
    "cnn": (CNN, lambda g, b: (torch.randn(b, 3, 8, 8, generator=g),
                               torch.randint(0, 5, (b,), generator=g)),
            lambda m, x: m(x), F.cross_entropy),
    "odd": (Odd, lambda g, b: (torch.randn(b, 6, generator=g), torch.randn(b, 5, generator=g)),
            lambda m, x: m(x), F.mse_loss),
    "hf_gpt2": (lambda: _hf("gpt2"), _tokens, lambda m, x: m(input_ids=x), _lm_loss),
    "hf_llama": (lambda: _hf("llama"), _tokens, lambda m, x: m(input_ids=x), _lm_loss),
    "hf_bert": (lambda: _hf("bert"), _tokens, lambda m, x: m(input_ids=x), _lm_loss),
}


def build(name):
    torch.manual_seed(0)
    return CASES[name][0]()
