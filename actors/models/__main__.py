"""``python -m actors.models``: build (or reuse) the tiny local model; same flags as actors.models.tiny."""

import sys

from actors.models.tiny import main

sys.exit(main())
