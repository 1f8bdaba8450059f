"""``autoshard.check`` on every test model: one step eagerly and compiled (world size 1, this
process, the default Config) agrees parameter by parameter within check's fp32 tolerances."""

import pytest
import torch

from autoshard import check
from models import CASES, build


@pytest.mark.parametrize("name", list(CASES))
def test_check_passes_on_every_test_model(name):
    _, data, inputs, _ = CASES[name]
    x, _ = data(torch.Generator().manual_seed(0), 4)
    report = check(build(name), inputs(x))
    assert report.ok, str(report)
    assert len(report.params) == sum(p.requires_grad for p in build(name).parameters())
