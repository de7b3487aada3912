"""``bus.process_exit.exit_process``: the exit code, the atexit handlers and the buffered output of a
normal exit, without the interpreter's teardown."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_exit_code_atexit_handlers_and_buffered_output_survive(tmp_path: Path) -> None:
    marker = tmp_path / "atexit-ran"
    code = textwrap.dedent(f"""
        import atexit, logging, sys
        from bus.process_exit import exit_process
        atexit.register(lambda: open({str(marker)!r}, "w").write("yes"))
        logging.basicConfig(stream=sys.stderr, format="%(message)s")
        logging.getLogger("t").warning("logged")
        sys.stdout.write("buffered, no newline")  # a pipe: block-buffered until flushed
        exit_process(3)
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 3, r.stderr
    assert r.stdout == "buffered, no newline"
    assert r.stderr == "logged\n"
    assert marker.read_text() == "yes"


def test_none_is_exit_code_zero() -> None:
    r = subprocess.run([sys.executable, "-c", "from bus.process_exit import exit_process; exit_process(None)"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stderr == ""
