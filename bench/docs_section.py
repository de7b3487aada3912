"""Write one benchmark's section of a markdown file (docs/benchmarks.md), leaving the others alone.

A section runs from its ``## <title>`` heading to the next ``## `` heading. With ``reading``, a
marker line after which the section is hand-written: that part survives a re-run (update it!)."""

from __future__ import annotations

import re
from pathlib import Path


def write_section(path: Path, title: str, body: str, reading: str | None = None) -> None:
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    section = f"## {title}\n\n" + body.rstrip() + "\n"
    pattern = re.compile(rf"^## {re.escape(title)}\n.*?(?=^## |\Z)", re.S | re.M)
    old = pattern.search(text)
    if old and reading and reading in old.group(0):
        section += "\n" + reading + old.group(0).split(reading, 1)[1].rstrip() + "\n"
    if old:
        text = pattern.sub(lambda _: section + "\n", text, count=1).rstrip() + "\n"
    else:
        text = text.rstrip() + "\n\n" + section
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
