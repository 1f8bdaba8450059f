"""``autoshard.check`` on every test model: one step eagerly and compiled (world size 1, this
process, one unit per repeated block) agrees parameter by parameter within check's fp32
tolerances. (The default "auto" policy tries every candidate grouping on graphs this small;
tests/test_check.py runs check under it.)"""

import pytest
import torch

from autoshard import Config, check
from models import CASES, build


@pytest.mark.parametrize("name", list(CASES))
def test_check_passes_on_every_test_model(name):
    _, data, inputs, _ = CASES[name]
    x, _ = data(torch.Generator().manual_seed(0), 4)
    report = check(build(name), inputs(x), config=Config(policy="module"))
    assert report.ok, str(report)
    assert len(report.params) == sum(p.requires_grad for p in build(name).parameters())
