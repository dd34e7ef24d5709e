"""Per-rank entry point of :func:`moe_fsm.distributed.launch`: exec the command it was given.

It lives outside :mod:`moe_fsm.distributed` on purpose: running a module of that
package would import the package, and torch with it, in every rank just to
exec a program that imports torch again.

torch.distributed.run parses every argument on its command line, including the
ones meant for the per-rank program, and rejects those that look like an
abbreviation of its own options (``--nproc`` is "ambiguous"). So launch() hands
the per-rank command over in ``$MOE_FSM_LAUNCH_ARGV`` (a JSON list) and has
torchrun start this module, which replaces itself with that command: same
process, same environment (RANK, WORLD_SIZE, ...), arguments untouched.
"""

from __future__ import annotations

import json
import os
import sys

ARGV_ENV = "MOE_FSM_LAUNCH_ARGV"


def main() -> None:
    raw = os.environ.get(ARGV_ENV)
    if not raw:
        sys.exit(f"{__name__}: ${ARGV_ENV} is unset; this module is started by moe_fsm.distributed.launch()")
    argv = json.loads(raw)
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        sys.exit(f"{__name__}: ${ARGV_ENV} must be a non-empty JSON list of strings, got {raw!r}")
    if argv[0].endswith(".py"):
        argv = [sys.executable, *argv]
    env = dict(os.environ)
    del env[ARGV_ENV]
    os.execvpe(argv[0], argv, env)


if __name__ == "__main__":
    main()
