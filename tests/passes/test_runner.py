"""The pass runner: the declared order is checked, and a failing pass says what ran before."""

import pytest
import torch

from autoshard.core.models import GPT
from autoshard.passes import (assign_units_pass, insert_collectives_pass, prefetch_pass,
                              run_passes, split_pass)
from graphs import captured


def _gpt():
    return captured(GPT(), torch.randint(0, 96, (2, 16)))


def test_a_pass_listed_before_one_it_follows_is_refused_naming_both():
    gm, ctx = _gpt()
    with pytest.raises(ValueError, match="pass assign_units_pass must run before "
                                         "insert_collectives_pass"):
        run_passes(gm, ctx, [(insert_collectives_pass, {}), (assign_units_pass, {})])


def test_a_pass_whose_input_no_earlier_pass_provides_is_refused():
    gm, ctx = _gpt()
    with pytest.raises(ValueError, match=r"prefetch_pass needs ctx.collectives_inserted, "
                                         r"which insert_collectives_pass provides"):
        run_passes(gm, ctx, [(assign_units_pass, {}), (prefetch_pass, {})])


def test_an_input_the_context_already_holds_lets_a_later_run_go_on():
    gm, ctx = _gpt()
    gm, ctx = run_passes(gm, ctx, [(assign_units_pass, {}), (insert_collectives_pass, {})])
    _, done = run_passes(gm, ctx, [(prefetch_pass, {}), (split_pass, {})])
    assert done.split is not None and ctx.split is None  # the context given is not changed


def test_a_failing_pass_says_which_passes_ran_before_it():
    def broken_pass(gm, ctx, *, options):
        raise RuntimeError("broken")

    gm, ctx = _gpt()
    with pytest.raises(RuntimeError, match="broken") as info:
        run_passes(gm, ctx, [(assign_units_pass, {}), (broken_pass, {})])
    assert ("in pass broken_pass, after ['assign_units_pass'] in this run"
            in getattr(info.value, "__notes__", []))
