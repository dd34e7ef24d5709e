"""``python -m moe_fsm ...`` is the ``moe-fsm`` command (how launched ranks re-run it)."""

import sys

from moe_fsm.cli.main import main

sys.exit(main())
