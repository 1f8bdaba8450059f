"""How the ranks of a write or a read learn how every rank's part ended: ``attempt`` runs
this rank's part, ``settle`` exchanges the outcomes and raises the same ``AutoshardError``
on every rank if any failed, naming each failed rank and its cause.

The exchange is the write's agreement (its group and timeout); a peer that does not answer
is named as such. Used by ``commit.py``'s writes and by the checks of ``commit_files.py``.
"""

from __future__ import annotations

import shutil
from typing import Optional

import torch.distributed as dist

from autoshard.core.errors import AutoshardError


def differ(what: str, seen: list) -> str:
    """The error when the ranks are all at a ``what`` but name different paths (or see
    different things there)."""
    lines = "\n".join(f"  rank {r}: {d}" for r, d in enumerate(seen))
    return (f"the ranks called the {what} with different paths, or see different things at "
            f"the path (nothing was written):\n{lines}\nEvery rank must pass the same path, "
            "on a file system every rank sees (a shared directory)")


def attempt(fn, rank: int = 0) -> dict:
    """{} when ``fn`` ran, else {rank: what stopped it}: this rank's error, or for DCP's
    CheckpointException (which gathers every rank's), each failed rank's."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        fn()
        return {}
    except CheckpointException as e:
        return {r: _cause(exc[0] if isinstance(exc, tuple) else exc)
                for r, exc in e.failures.items()}
    except Exception as e:  # noqa: BLE001 - reported on every rank, then raised there
        return {rank: _cause(e)}


def _cause(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:400] if text else ''}"


def settle(agreement, outcome: dict, doing: str, kept: str,
           folder: Optional[str] = None) -> None:
    """Every rank learns how every rank's part of ``doing`` ended (``outcome``, from
    ``attempt``); any failure is an AutoshardError on all, saying what is ``kept``."""
    failed: dict = {}
    for got in exchange(agreement, outcome, doing, kept):
        failed.update(got)
    if not failed:
        return
    if agreement.rank == 0 and folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
    ranks = sorted(failed)
    lines = "\n".join(f"  rank {r}: {failed[r]}" for r in ranks)
    raise AutoshardError(f"the {doing} failed on rank{'s' if len(ranks) > 1 else ''} "
                         f"{', '.join(map(str, ranks))}; nothing was committed, and {kept}:"
                         f"\n{lines}")


def exchange(agreement, mine, doing: str, kept: str) -> list:
    """Each rank's ``mine``, in rank order (the agreement's group and timeout)."""
    if agreement.world == 1 or agreement.fake:
        return [mine]
    got = [None] * agreement.world
    try:
        dist.all_gather_object(got, mine, group=agreement.group)
    except Exception as e:  # noqa: BLE001 - a lost or stuck peer, whatever the backend says
        peers = [r for r in range(agreement.world) if r != agreement.rank]
        raise AutoshardError(
            f"rank {agreement.rank}: the {doing} did not complete: no answer from "
            f"peer ranks {peers} within {agreement.timeout_s:g} s (a rank was killed, ran out "
            f"of space, or hangs); nothing was committed, and {kept}."
            f"{' This rank saw: ' + str(mine) if mine else ''}\n  "
            f"{str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__}"
        ) from None
    return got
