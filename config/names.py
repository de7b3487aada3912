"""The one rule for names that become NATS subject tokens (namespace, pools, hosts, instances).

It lives here, at the bottom, because the topology loader refuses a bad name at load time and
``bus.subjects`` refuses one when it builds a subject: both must apply the same rule.
"""

from __future__ import annotations

import re

_TOKEN = re.compile(r"^[A-Za-z0-9_\-]+$")


def check_token(part: str) -> str:
    """A subject token: no dots, spaces or wildcards (they would change the subject's meaning)."""
    if not _TOKEN.match(part):
        raise ValueError(f"invalid subject token {part!r}: use letters, digits, '_' and '-'")
    return part
