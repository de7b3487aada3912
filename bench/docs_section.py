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


def keep_other_sections(path: Path, text: str) -> str:
    """``text`` (a whole generated file) followed by the sections of the file now at ``path`` whose
    titles ``text`` does not have: another script's (or a hand-written) section survives a re-run
    of the script that writes the rest of the file."""
    if not path.exists():
        return text
    heading = re.compile(r"^## (.+)$", re.M)
    mine = set(heading.findall(text))
    old = path.read_text()
    kept = [m for m in re.finditer(r"^## ([^\n]+)\n.*?(?=^## |\Z)", old, re.S | re.M) if m.group(1) not in mine]
    return text.rstrip() + "\n" + "".join("\n" + m.group(0).rstrip() + "\n" for m in kept)
