"""``python -m actors.supervisor TOPOLOGY``: the command users, units and docs name.

The CLI lives at the top of the layering, in ``deploy.cli``; this module is only its documented
entry point, and the one import of ``deploy`` from inside ``actors`` (tests/test_layering.py allows
exactly this module).
"""

import gc
import sys

from deploy.cli import main

if __name__ == "__main__":
    code = main()
    # The interpreter's last collection walks every object torch, vLLM and transformers made (about
    # 5 s on a 2-core box, each time a deployment stops) to free memory the OS takes back anyway;
    # frozen, those objects are skipped. atexit handlers still run.
    gc.freeze()
    sys.exit(code)
