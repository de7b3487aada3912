"""The benchmark scripts' markdown writers: a script that writes a whole file keeps the sections
other scripts wrote there."""

from __future__ import annotations

from pathlib import Path

from bench.docs_section import keep_other_sections, write_section


def test_a_whole_file_rewrite_keeps_the_sections_it_does_not_write(tmp_path: Path) -> None:
    out = tmp_path / "reliability.md"
    out.write_text("# Reliability\n\nintro\n\n## Results\n\nold\n\n## Details\n\nold details\n")
    write_section(out, "Repeated fault scenarios", "20 of 20")  # another script's section
    new = "# Reliability\n\nnew intro\n\n## Results\n\nnew\n\n## Details\n\nnew details\n"
    merged = keep_other_sections(out, new)
    assert merged == new + "\n## Repeated fault scenarios\n\n20 of 20\n"
    assert keep_other_sections(tmp_path / "absent.md", new) == new
