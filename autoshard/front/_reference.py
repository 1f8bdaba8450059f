"""The Config reference page, docs/config.md, written from ``Config``'s own documentation.

    python -m autoshard.front._reference            # rewrite docs/config.md of this checkout
    python -m autoshard.front._reference --check    # exit 1 if docs/config.md is not what it writes
    python -m autoshard.front._reference --out F    # write the page to F

Each field's name, type and default come from the dataclass; its meaning comes from the
``name: meaning`` section of the ``Config`` docstring (groups are titles underlined with
dashes; ``- `` starts a list item). A field with no section, or a section naming no field, is
an error, so the page cannot leave a field out. The options a field's value carries
(``Module``, ``Size``, ``Bucket``, ``Prefetch``, ``Offload``) follow, each with its signature
and its own docstring.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import re
import sys
import textwrap

from autoshard.core.config import Config
from autoshard.core.options import Bucket, Module, Offload, Prefetch, Size

WIDTH = 100
COMMAND = "python -m autoshard.front._reference"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGE = os.path.join(ROOT, "docs", "config.md")
# the values of a field that carry the options only that value turns on
OPTIONS = (Module, Size, Bucket, Prefetch, Offload)

_FIELD = re.compile(r"^(\w+): (.*)$")


@dataclasses.dataclass
class FieldDoc:
    name: str
    type: str
    default: str
    lines: list  # the meaning's lines, dedented to the section


def sections(doc: str) -> tuple:
    """``(intro, [(group, [FieldDoc, ...]), ...])`` from a Config-style docstring."""
    lines = inspect.cleandoc(doc).splitlines()
    fields = {f.name: f for f in dataclasses.fields(Config)}
    intro, groups, field = [], [], None
    for i, line in enumerate(lines):
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if re.fullmatch(r"-{3,}", line):
            continue
        if line and re.fullmatch(r"-{3,}", nxt) and len(nxt) == len(line):
            groups.append((line, []))
            field = None
        elif groups and _FIELD.match(line):
            name, text = _FIELD.match(line).groups()
            if name not in fields:
                raise ValueError(f"the Config docstring documents {name!r}, which is not a "
                                 "field of Config")
            field = FieldDoc(name, f"{fields[name].type}", _default(fields[name]), [text])
            groups[-1][1].append(field)
        elif field is not None and (line.startswith("    ") or not line):
            field.lines.append(line[4:])
        elif not groups:
            intro.append(line)
        elif line:
            raise ValueError(f"the Config docstring has a line outside any field: {line!r}")
    documented = [f.name for _, fs in groups for f in fs]
    missing = [n for n in fields if n not in documented]
    twice = sorted({n for n in documented if documented.count(n) > 1})
    if missing or twice:
        raise ValueError(f"every Config field needs one section in the Config docstring; "
                         f"missing: {missing}, documented twice: {twice}")
    return _paragraphs(intro)[0][1], groups


def _default(field) -> str:
    if field.default is not dataclasses.MISSING:
        return repr(field.default)
    return repr(field.default_factory())  # pragma: no cover - Config has no factories today


def _md(text: str) -> str:
    """RST literals to markdown ones."""
    return re.sub(r"``(.+?)``", r"`\1`", text)


def _paragraphs(lines: list) -> list:
    """Blocks of text: plain paragraphs, and list items (each ``- ...`` with what follows)."""
    out, cur = [], None
    for line in lines:
        if not line.strip():
            cur = None
        elif line.startswith("- "):
            cur = ["- ", line[2:].strip()]
            out.append(cur)
        elif cur is None or (cur[0] == "- " and not line.startswith("  ")):
            cur = ["", line.strip()]
            out.append(cur)
        else:
            cur[1] += " " + line.strip()
    return [(kind, _md(text)) for kind, text in out]


def _wrap(kind: str, text: str) -> str:
    return textwrap.fill(text, WIDTH, initial_indent=kind, subsequent_indent=" " * len(kind),
                         break_long_words=False, break_on_hyphens=False)


def render() -> str:
    """The text of docs/config.md."""
    intro, groups = sections(Config.__doc__)
    out = ["# Config reference", "",
           f"<!-- written by `{COMMAND}` from the docstring of autoshard.core.config.Config:",
           "     edit that docstring, then run the command -->", "",
           _wrap("", "`autoshard.Config(...)`: " + intro[:1].lower() + intro[1:]), "",
           "Pass it as `autoshard(model, config=Config(...))` or `autoshard.plan(..., "
           "config=Config(...))`.", ""]
    for title, fields in groups:
        out += [f"## {title}", "", "| field | type | default |", "|---|---|---|"]
        out += [f"| [`{f.name}`](#{f.name}) | `{f.type}` | `{f.default}` |" for f in fields]
        out.append("")
        for f in fields:
            out += [f"### `{f.name}`", "", f"`{f.name}: {f.type} = {f.default}`", ""]
            blocks = _paragraphs(f.lines)
            for i, (kind, text) in enumerate(blocks):
                out.append(_wrap(kind, text[:1].upper() + text[1:] if i == 0 else text))
                if kind == "" or i + 1 == len(blocks) or blocks[i + 1][0] == "":
                    out.append("")
    return "\n".join(out + _options()).rstrip("\n") + "\n"


def _options() -> list:
    """The section on ``OPTIONS``: each one's signature, then its docstring's paragraphs."""
    out = ["## Options inside a field", "",
           _wrap("", "`policy`, `bucket`, `prefetch` and `offload_policy` take these values "
                 "too (`from autoshard import Module, Size, Bucket, Prefetch, Offload`): each "
                 "carries the options that matter only when its field turns them on, checks "
                 "them when built, and cannot change after."), ""]
    for cls in OPTIONS:
        params = ", ".join(f"{p.name}: {p.annotation} = {p.default!r}"
                           for p in inspect.signature(cls).parameters.values())
        out += [f"### `{cls.__name__}`", "", f"`{cls.__name__}({params})`", ""]
        for para in inspect.cleandoc(cls.__doc__).split("\n\n"):
            out += [_wrap("", _md(" ".join(para.split()))), ""]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=PAGE, help="where to write the page (default: "
                    "docs/config.md of the checkout this package sits in)")
    ap.add_argument("--check", action="store_true",
                    help="write nothing; exit 1 if the page differs from what it would write")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        try:
            with open(args.out) as fh:
                same = fh.read() == text
        except FileNotFoundError:
            same = False
        if not same:
            print(f"{args.out} is not what the Config docstring gives; run {COMMAND}",
                  file=sys.stderr)
        return 0 if same else 1
    if not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        ap.error(f"no folder for {args.out}: pass --out PATH (docs/ exists only in a checkout)")
    with open(args.out, "w") as fh:
        fh.write(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
