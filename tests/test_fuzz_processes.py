"""The fuzzer's rank processes: forked from a server that imported the libraries once, they
still see the caller's environment at each case, and the fuzzer adds its modules to the
server's preload list rather than replacing an application's."""

import multiprocessing.forkserver
import os

import torch.nn as nn

from autoshard import fuzz

WIDTH = "AUTOSHARD_TEST_FUZZ_WIDTH"


def env_sized():
    """A model as wide as the environment says: the ranks and the reference (this process)
    build the same one only if they see the same environment."""
    width = int(os.environ.get(WIDTH, "8"))
    return nn.Sequential(nn.Embedding(16, 4), nn.Linear(4, width), nn.ReLU(),
                         nn.Linear(width, 4))


def test_ranks_see_the_callers_environment_at_each_case(monkeypatch):
    monkeypatch.delenv("AUTOSHARD_FUZZ_START", raising=False)
    monkeypatch.delenv(WIDTH, raising=False)
    spec = fuzz.generate(3, world_sizes=(1,), factory=f"{__name__}:env_sized")
    assert fuzz.problems(spec) == []
    fuzz._start_method()
    multiprocessing.forkserver.ensure_running()  # the server's environment is this one now
    first = fuzz.run_case(spec)
    assert first.status == "pass", first.details
    # set after the server started: a rank forked from it sees it only if it is handed it;
    # else its model is 8 wide, the reference's 12, and the case cannot pass
    monkeypatch.setenv(WIDTH, "12")
    second = fuzz.run_case(spec)
    assert second.status == "pass", (second.status, second.details)


def test_fuzzer_adds_its_modules_to_the_preload_list(monkeypatch):
    before = fuzz.forkserver_preload()
    try:
        multiprocessing.forkserver.set_forkserver_preload(["json", "autoshard"])  # an app's
        monkeypatch.delenv("AUTOSHARD_FUZZ_START", raising=False)
        assert fuzz._start_method() == "forkserver"
        after = fuzz.forkserver_preload()
        assert after[:2] == ["json", "autoshard"]
        assert set(fuzz.FORKSERVER_MODULES) <= set(after)
        assert len(after) == len(set(after))  # each module once
        fuzz._start_method()
        assert fuzz.forkserver_preload() == after  # and again: nothing added twice
    finally:
        multiprocessing.forkserver.set_forkserver_preload(before)
