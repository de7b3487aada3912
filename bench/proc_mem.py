"""Memory of a process, read from /proc: RSS and PSS.

RSS counts every page a process maps, shared ones in full (the Python interpreter and libraries
that N worker processes share once in physical memory are counted N times); PSS charges each
shared page to its sharers in equal parts, so the PSS of all of a machine's processes adds up to
the memory they really use. Both are reported: RSS is what a per-process limit sees, PSS what N
processes cost together."""

from __future__ import annotations


def rss_pss(pid: int) -> tuple[int, int] | None:
    """(RSS, PSS) in bytes from ``/proc/<pid>/smaps_rollup``; None if the process is gone."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("Rss", "Pss"):
                    out[key] = int(rest.split()[0]) * 1024  # kB
    except (OSError, ValueError):
        return None
    if "Rss" not in out or "Pss" not in out:
        return None
    return out["Rss"], out["Pss"]
