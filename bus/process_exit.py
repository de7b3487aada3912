"""How our processes end once their work is done: the exit handlers run, the interpreter's teardown
does not.

A process that imported vLLM (the root, whose frontend validates requests with vLLM's models;
frontend processes; vLLM workers) spent 1.4-2.4 s after ``main`` returned in the interpreter's
teardown, freeing torch's, transformers' and vLLM's modules object by object, and triton's nanobind
bindings printed "leaked instances" reports on the way. An operator waits that long for every stop
and restart of a root; a supervisor for every worker restart. Nothing of ours needs the teardown:
``main`` returns after its children stopped and its connections closed. What does matter runs
here, as at a normal exit: the ``atexit`` handlers (logging's flush and close, multiprocessing's
join of its children, ``weakref.finalize`` callbacks such as temporary directories), then the
standard streams are flushed.

Not run, unlike a normal exit: the wait for non-daemon threads still running. Ours end with their
loop; one still running here is stuck (a blocking call that never returned), and a process that
exits rather than waits for it is what its supervisor wants.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
from typing import NoReturn


def exit_process(code: int | None) -> NoReturn:
    """End this process with ``code`` (None: 0), like ``sys.exit`` at the end of ``__main__``."""
    # CPython's own runner of the handlers (private but stable since 3.0): the handlers run once,
    # in registration order reversed, exactly as at interpreter exit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or broken pipe: nothing left to say there
            stream.flush()
    os._exit(code or 0)
