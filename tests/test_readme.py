"""Every ```python and shell block of README.md and docs/*.md runs, so a snippet cannot break
unnoticed.

A block's kind is an HTML comment (invisible where the markdown is rendered) on the line just
before its fence:

- no comment: the block is a program of its own, run in one process;
- ``<!-- run: 2 ranks -->``: a program run on that many gloo ranks under torchrun, as the
  README's own scripts are launched;
- ``<!-- run: continue -->``: the block goes on from the block before it in the same file:
  both are one program, of the first block's kind, run once;
- ``<!-- run: skip (why) -->``: not run; the reason is required, and is the skip's reason.

Shell blocks (```bash, ```sh, ```console) run too, each as a bash script of its own with
``set -euo pipefail`` (a ```console block runs its ``$ `` lines; the rest is their output);
``python`` is this interpreter and ``torchrun`` launches it. They take no marker, or a skip
(a command that installs packages, needs a GPU, or runs for minutes says so there).

The prose around a snippet leaves some names to the reader: the model, its data, a loss. Each
program starts with them defined (``GIVEN`` below: a tiny GPT and its batches), in a fresh
temporary directory as working directory. Nothing else is imported for it: a snippet that
forgets an import fails. A program's line numbers are the markdown file's, so a traceback
points at the line of the snippet. A program that runs past ``LIMIT`` seconds is killed and
fails; on several ranks every collective also gives up after 60 seconds.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = ["README.md"] + sorted(
    os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))
LIMIT = 120  # seconds, per program

# The names a program starts with (every name in __all__), and nothing else. On several ranks
# the process group is autoshard's own (a torchrun environment, Config.timeout of 60 s),
# created here because some snippets use it before calling autoshard().
GIVEN = '''
import os as _os

import torch as _torch

from autoshard import Config as _Config, autoshard as _autoshard
from autoshard.core.models import GPT as _GPT, gpt_loss as loss_fn

__all__ = ["build_model", "loss_fn", "x", "y", "x_small", "loader", "model", "unsharded",
           "sharded", "opt"]


def build_model():
    return _GPT(vocab=96, dim=32, heads=4, layers=2, seq=16)


_torch.manual_seed(0)
_data = _torch.randint(0, 96, (3, 2, 17))
loader = [(b[:, :-1], b[:, 1:]) for b in _data]
x, y = loader[0]
x_small = x[:1]
model = build_model()                  # not sharded
unsharded = build_model()              # an unsharded copy, also saved as unsharded.pt
sharded = _autoshard(build_model(), config=_Config(timeout=60))   # not compiled yet
opt = _torch.optim.AdamW(sharded.parameters(), lr=1e-3)
if _os.environ.get("RANK", "0") == "0":
    _torch.save(unsharded.state_dict(), "unsharded.pt")
if _torch.distributed.is_initialized():
    _torch.distributed.barrier()
'''


@dataclasses.dataclass
class Block:
    file: str
    first: int  # 1-based line numbers of the block's code (inside the fences)
    last: int
    kind: str  # "1 rank", "N ranks", "continue" or "skip"
    reason: str = ""
    lang: str = "python"  # or "bash", "console"


@dataclasses.dataclass
class Program:
    blocks: list
    ranks: int = 1
    skip: str = ""

    @property
    def lang(self) -> str:
        return self.blocks[0].lang

    @property
    def name(self) -> str:
        return f"{self.blocks[0].file}:" + "+".join(str(b.first - 1) for b in self.blocks)


_MARKER = re.compile(r"^\s*<!--\s*run:\s*(.*?)\s*-->\s*$")
_FENCE = re.compile(r"^\s*```(\w*)")
_SHELL = {"bash": "bash", "sh": "bash", "shell": "bash", "console": "console"}


def parse(text: str, file: str) -> list:
    """The ```python blocks of one markdown text, each with its kind."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            marker = _MARKER.search(lines[i])
            if marker and not _FENCE.match(lines[i + 1] if i + 1 < len(lines) else ""):
                raise ValueError(f"{file}:{i + 1}: a run marker must stand on the line just "
                                 "before a ```python fence")
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            raise ValueError(f"{file}:{i + 1}: a fence that is never closed")
        lang = "python" if m.group(1) in ("python", "py") else _SHELL.get(m.group(1))
        if lang:
            marker = _MARKER.search(lines[i - 1]) if i else None
            block = _block(marker.group(1) if marker else "", file, i + 2, end, blocks)
            block.lang = lang
            if lang != "python" and block.kind not in ("1 rank", "skip"):
                raise ValueError(f"{file}:{i + 1}: a shell block takes no marker or "
                                 "'run: skip (why)'")
            if block.kind == "continue" and blocks[-1].lang != "python":
                raise ValueError(f"{file}:{i + 1}: 'run: continue' after a shell block")
            blocks.append(block)
        i = end + 1
    return blocks


def _block(spec: str, file: str, first: int, last: int, before: list) -> Block:
    where = f"{file}:{first - 1}"
    if not spec:
        return Block(file, first, last, "1 rank")
    if re.fullmatch(r"\d+ ranks?", spec):
        return Block(file, first, last, spec.split()[0] + " ranks")
    if spec == "continue":
        if not before:
            raise ValueError(f"{where}: 'run: continue' with no earlier block to continue")
        return Block(file, first, last, "continue")
    skip = re.fullmatch(r"skip\s*\((.*\S.*)\)", spec)
    if skip:
        return Block(file, first, last, "skip", skip.group(1).strip())
    raise ValueError(f"{where}: unknown run marker {spec!r} (expected 'N ranks', 'continue' or "
                     "'skip (why)'; no marker runs the block in one process)")


def programs(blocks: list) -> list:
    """Blocks joined into the programs that run: each block with the ones continuing it."""
    out = []
    for b in blocks:
        if b.kind == "continue":
            out[-1].blocks.append(b)
        elif b.kind == "skip":
            out.append(Program([b], skip=b.reason))
        else:
            out.append(Program([b], ranks=int(b.kind.split()[0])))
    return out


def _all_programs() -> list:
    out = []
    for f in FILES:
        with open(os.path.join(ROOT, f)) as fh:
            out += programs(parse(fh.read(), f))
    return out


PROGRAMS = _all_programs()


def source(program: Program) -> str:
    """The program's text: its blocks' lines at their places in the markdown file, the other
    lines blank, and the given names imported on line 1 (a heading, never code)."""
    with open(os.path.join(ROOT, program.blocks[0].file)) as fh:
        lines = fh.read().splitlines()
    out = [""] * len(lines)
    for b in program.blocks:
        out[b.first - 1:b.last] = lines[b.first - 1:b.last]
    out[0] = "from _given import *  # noqa: F401,F403"
    return "\n".join(out) + "\n"


def shell_source(program: Program) -> str:
    """A shell block as a bash script: its lines (a console block's ``$`` lines), stopping at
    the first command that fails."""
    b = program.blocks[0]
    with open(os.path.join(ROOT, b.file)) as fh:
        lines = fh.read().splitlines()[b.first - 1:b.last]
    if b.lang == "console":
        lines = [line[2:] for line in lines if line.startswith("$ ")]
    return "set -euo pipefail\n" + "\n".join(lines) + "\n"


def _shell_bin(tmp: str) -> str:
    """A folder for PATH where ``python`` is this interpreter and ``torchrun`` launches it."""
    folder = os.path.join(tmp, "_bin")
    os.makedirs(folder)
    for name, body in [("python", f'exec "{sys.executable}" "$@"'),
                       ("torchrun", f'exec "{sys.executable}" -m torch.distributed.run "$@"')]:
        with open(os.path.join(folder, name), "w") as fh:
            fh.write(f"#!/bin/sh\n{body}\n")
        os.chmod(os.path.join(folder, name), 0o755)
    return folder


def run(program: Program, tmp: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", AUTOSHARD_PROGRESS="0",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    name = os.path.basename(program.blocks[0].file).replace(".", "_")
    if program.lang != "python":
        script = os.path.join(tmp, name + ".sh")
        with open(script, "w") as fh:
            fh.write(shell_source(program))
        env["PATH"] = os.pathsep.join([_shell_bin(tmp), env.get("PATH", "")])
        cmd = ["bash", script]
    else:
        with open(os.path.join(tmp, "_given.py"), "w") as fh:
            fh.write(GIVEN)
        script = os.path.join(tmp, name + ".py")
        with open(script, "w") as fh:
            fh.write(source(program))
        cmd = [sys.executable, script]
    if program.ranks > 1:
        cmd[1:1] = ["-m", "torch.distributed.run", "--standalone",
                    f"--nproc-per-node={program.ranks}"]
    log = os.path.join(tmp, "output.txt")  # a file, not a pipe: a rank left over cannot hold it
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=fh, stderr=subprocess.STDOUT)
    try:
        proc.wait(timeout=LIMIT)
    except subprocess.TimeoutExpired:
        for pid in _descendants(proc.pid) + [proc.pid]:  # torchrun starts each rank in a
            try:                                          # session of its own
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
    with open(log) as fh:
        out = fh.read()
    if proc.returncode == -signal.SIGKILL:
        pytest.fail(f"{program.name} ran past {LIMIT} s; line numbers are the markdown's\n{out}")
    # what the ranks wrote, without torchrun's own traceback of the failure that follows it
    out = re.split(r"\n[^\n]*torch/distributed/elastic/[^\n]*failed \(exitcode", out)[0]
    return subprocess.CompletedProcess(cmd, proc.returncode, out)


def _descendants(pid: int) -> list:
    """The processes ``pid`` started, and theirs (Linux: read from /proc)."""
    children = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


@pytest.mark.parametrize("program", PROGRAMS, ids=[p.name for p in PROGRAMS])
def test_block_runs(program):
    if program.skip:
        pytest.skip(program.skip)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        done = run(program, tmp)
        took = time.perf_counter() - t0
    assert done.returncode == 0, (
        f"{program.name} failed on {program.ranks} rank(s) (exit {done.returncode}); "
        f"line numbers are the markdown's\n{done.stdout}")
    n = len(program.blocks)
    print(f"{program.name}: {n} block{'s' * (n > 1)} on {program.ranks} rank(s), {took:.1f} s")


def test_blocks_are_found_and_counted():
    blocks = [b for p in PROGRAMS for b in p.blocks]
    for lang in ("python", "shell"):
        mine = [b for b in blocks if (b.lang == "python") == (lang == "python")]
        skipped = [b for b in mine if b.kind == "skip"]
        progs = [p for p in PROGRAMS if (p.lang == "python") == (lang == "python")]
        print(f"{len(mine)} {lang} blocks in {len(FILES)} files: {len(mine) - len(skipped)} run "
              f"as {sum(not p.skip for p in progs)} programs, {len(skipped)} skipped")
        for b in skipped:
            print(f"  skipped {b.file}:{b.first - 1}: {b.reason}")
    assert len(blocks) >= 6 and "README.md" in {b.file for b in blocks}
    assert {"python", "bash"} <= {b.lang for b in blocks if b.kind != "skip"}


def test_markers():
    text = "\n".join([
        "# t", "```python", "a = 1", "```", "<!-- run: continue -->", "```python", "b = a",
        "```", "text", "<!-- run: 2 ranks -->", "```python", "c = 3", "```", "```bash",
        "ls", "```", "<!-- run: skip (needs a GPU) -->", "```python", "d = 4", "```"])
    blocks = parse(text, "t.md")
    assert [(b.first, b.last, b.kind, b.lang) for b in blocks] == [
        (3, 3, "1 rank", "python"), (7, 7, "continue", "python"), (12, 12, "2 ranks", "python"),
        (15, 15, "1 rank", "bash"), (19, 19, "skip", "python")]
    progs = programs(blocks)
    assert [(len(p.blocks), p.ranks, p.skip, p.lang) for p in progs] == [
        (2, 1, "", "python"), (1, 2, "", "python"), (1, 1, "", "bash"),
        (1, 1, "needs a GPU", "python")]
    shell = parse("```bash\nls\n```\n<!-- run: skip (installs) -->\n```console\n$ pip\n```",
                  "t.md")
    assert [(b.lang, b.kind) for b in shell] == [("bash", "1 rank"), ("console", "skip")]
    console = Program([Block("README.md", 1, 1, "1 rank", lang="console")])
    assert "set -euo pipefail" in shell_source(console)
    inline = parse("the comment `<!-- run: 2 ranks -->` before a fence\n```python\nx\n```", "t.md")
    assert [b.kind for b in inline] == ["1 rank"]  # prose that names a marker is no marker
    for bad, why in [
            ("<!-- run: skip -->\n```python\nx\n```", "unknown run marker"),
            ("<!-- run: skip () -->\n```python\nx\n```", "unknown run marker"),
            ("<!-- run: continue -->\n```python\nx\n```", "no earlier block"),
            ("<!-- run: 2 ranks -->\n\n```python\nx\n```", "just before"),
            ("```python\nx\n", "never closed"),
            ("<!-- run: 2 ranks -->\n```bash\nls\n```", "shell block takes no marker"),
            ("```bash\nls\n```\n<!-- run: continue -->\n```python\nx\n```",
             "after a shell block")]:
        with pytest.raises(ValueError, match=why):
            parse(bad, "t.md")
