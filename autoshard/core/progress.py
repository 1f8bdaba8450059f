"""Progress of the phases that can take a while: capture, planning, inductor, export, check,
load.

A phase says nothing for its first ``AFTER_S`` seconds; past that it shows where it is, as a
bar redrawn in place when stderr is a terminal, otherwise as a log line every ``EVERY_S``
seconds and one when it ends. Under torch.distributed only rank 0 shows it. One setting turns
it off: the environment variable ``AUTOSHARD_PROGRESS=0`` (or ``progress.enable(False)``).

    with progress.phase("planning", total=len(candidates), unit="candidates") as p:
        for c in candidates:
            ...
            p.step(note=c.label)

A phase inside another shows in its place while it runs.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
import threading
import time
from typing import Optional

AFTER_S = 5.0  # a phase shorter than this shows nothing
EVERY_S = 5.0  # between log lines when stderr is not a terminal
REDRAW_S = 0.2  # between redraws of a terminal's bar
BAR = 24  # characters of the bar

_enabled: Optional[bool] = None  # None: read AUTOSHARD_PROGRESS
_stack: list = []
_lock = threading.Lock()


def enable(on: bool = True) -> None:
    """Show progress (``True``) or never (``False``), overriding ``AUTOSHARD_PROGRESS``."""
    global _enabled
    _enabled = bool(on)


def enabled() -> bool:
    if _enabled is not None:
        return _enabled
    return os.environ.get("AUTOSHARD_PROGRESS", "1").strip().lower() not in (
        "0", "off", "false", "no")


def _rank0() -> bool:
    try:
        import torch.distributed as dist
        return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    except (ImportError, RuntimeError):
        return True


class Phase:
    """One running phase; ``step()`` advances it."""

    def __init__(self, name: str, total: Optional[int], unit: str, stream):
        self.name, self.total, self.unit, self.stream = name, total, unit, stream
        self.done, self.note = 0, ""
        self.start = time.monotonic()
        self.shown = False  # whether anything was written
        self.tty = hasattr(stream, "isatty") and stream.isatty()
        self._last = 0.0  # when the last line or bar was written
        self._stop = threading.Event()
        self._thread = None  # the ticker, only where the phase can show

    def _start(self) -> None:
        """Starts the ticker that writes while the caller is busy between steps, unless
        nothing can show (progress off, or not rank 0): then a phase costs no thread."""
        if enabled() and _rank0():
            self._thread = threading.Thread(target=self._tick, daemon=True,
                                            name=f"autoshard-progress-{self.name}")
            self._thread.start()

    def step(self, n: int = 1, note: str = "") -> None:
        """``n`` more done; ``note``: what is being done now (shown beside the count)."""
        self.done += n
        if note:
            self.note = note
        self._show(final=False)

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def line(self) -> str:
        count = ""
        if self.total:
            frac = min(1.0, self.done / self.total)
            bar = ("#" * round(frac * BAR)).ljust(BAR, ".") if self.tty else ""
            count = f"[{bar}] " if bar else ""
            count += f"{self.done}/{self.total} {self.unit}".rstrip()
        elif self.done:
            count = f"{self.done} {self.unit}".rstrip()
        parts = [p for p in (count, f"{self.elapsed():.0f} s", self.note) if p]
        return f"[autoshard] {self.name}: " + ", ".join(parts)

    def _show(self, *, final: bool) -> None:
        now = time.monotonic()  # the cheap tests first: a short phase's steps stop here
        if not final and (now - self.start < AFTER_S
                          or now - self._last < (REDRAW_S if self.tty else EVERY_S)):
            return
        if final and not self.shown:
            return
        if not (enabled() and _rank0()) or (_stack and _stack[-1] is not self):
            return
        with _lock:
            text = self.line() + (" (done)" if final else "")
            if self.tty:
                self.stream.write("\r" + text[:_width()].ljust(_width()) + ("\n" if final else ""))
            else:
                self.stream.write(text + "\n")
            self.stream.flush()
        self.shown, self._last = True, now

    def _tick(self) -> None:
        while not self._stop.wait(REDRAW_S if self.tty else 1.0):
            self._show(final=False)

    def _close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._show(final=True)


def _width() -> int:
    try:
        return max(40, min(100, os.get_terminal_size(sys.stderr.fileno()).columns - 1))
    except (OSError, ValueError):
        return 99


@contextlib.contextmanager
def phase(name: str, total: Optional[int] = None, unit: str = "", stream=None):
    """A phase named ``name`` (e.g. "planning"), of ``total`` steps of ``unit`` if known."""
    p = Phase(name, total, unit, stream if stream is not None else sys.stderr)
    if _stack and _stack[-1].tty and _stack[-1].shown:  # a bar in place: end its line
        _stack[-1].stream.write("\n")
    _stack.append(p)
    p._start()
    try:
        yield p
    finally:
        p._close()
        _stack.remove(p)


# seconds spent per named step since the process started (``timed``): every pass the runner
# applies, by its name, and the planner's phases ("plan: ..."); nested steps count in each.
# One source of truth for AUTOSHARD_DEBUG's per-pass times and bench/plan_scale.py's table
TIMES: dict = collections.defaultdict(float)


@contextlib.contextmanager
def timed(name: str):
    """Adds the time the block takes to ``TIMES[name]``; costs a clock read either side, so
    it stays on always (no switch to thread through)."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        TIMES[name] += time.perf_counter() - t0
