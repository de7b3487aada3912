"""``python -m actors.supervisor TOPOLOGY``: the command users, units and docs name.

The CLI lives at the top of the layering, in ``deploy.cli``; this module is only its documented
entry point, and the one import of ``deploy`` from inside ``actors`` (tests/test_layering.py allows
exactly this module).
"""

from bus.process_exit import exit_process
from deploy.cli import main

if __name__ == "__main__":
    exit_process(main())
