"""No unused code: vulture over our packages, the benches and the tests.

Code counts as used when the packages, an entry point (bench/, ``python -m`` mains) or a test use
it. What only a framework or a foreign wire format uses (aiohttp overrides, vLLM's stat-logger
interface, fields of vLLM's event Structs) is named, with the reason, in dead_code_whitelist.py.
"""

from __future__ import annotations

from pathlib import Path

import vulture

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ["config", "bus", "supervisors", "actors", "deploy", "bench", "tests"]
WHITELIST = Path(__file__).with_name("dead_code_whitelist.py")
MIN_CONFIDENCE = 60  # vulture's lowest level that still names unused functions, methods and attributes


def test_no_unused_code() -> None:
    v = vulture.Vulture()
    v.scavenge([str(ROOT / p) for p in SCANNED])  # tests/ holds the whitelist
    unused = [item for item in v.get_unused_code(min_confidence=MIN_CONFIDENCE)
              if Path(item.filename) != WHITELIST]
    lines = [f"{Path(i.filename).relative_to(ROOT)}:{i.first_lineno}: {i.message}" for i in unused]
    assert not lines, "unused code (remove it, or whitelist it with the reason):\n" + "\n".join(lines)
