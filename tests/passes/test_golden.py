"""The small GPT's schedule at world size 2, against a golden text.

Regenerate with UPDATE_GOLDEN=1 after an intended change, and read the diff."""

import os
import pathlib

import torch

import autoshard
from autoshard.core.models import GPT

GOLDEN = pathlib.Path(__file__).parent.parent / "golden" / "gpt_world2_schedule.txt"


def test_gpt_schedule_matches_golden():
    with torch.device("meta"):
        model = GPT()
    plan = autoshard.plan(model, (torch.randint(0, 96, (2, 16)),), world_size=2,
                          config=autoshard.Config(policy="module"))
    text = plan.units_table() + "\n\n" + plan.schedule_table(frees=True) + "\n"
    if os.environ.get("UPDATE_GOLDEN"):
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text()


def test_plan_round_trips_through_json():
    with torch.device("meta"):
        model = GPT()
    plan = autoshard.plan(model, (torch.randint(0, 96, (2, 16)),), world_size=4)
    assert autoshard.Plan.from_json(plan.to_json()) == plan
    assert plan.world_size == 4 and plan.comm_bytes() > 0
