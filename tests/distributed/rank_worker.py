"""One rank of the distributed test suite, started with torchrun's environment (by the tests or by launch()).

    python tests/distributed/rank_worker.py OUT_DIR [SCENARIO ...]

Joins the process group with ``init_from_env`` (gloo, or NCCL with
MOE_FSM_DIST_BACKEND=nccl), runs the collectives check and the named scenarios
(all of them when none is named), and writes its results to
``OUT_DIR/results.rank{r}.json``. A scenario that raises ends the run: the other
ranks may be waiting in a collective, and the process-group timeout then
fails them instead of letting them hang.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import dist_scenarios  # noqa: E402

from moe_fsm.distributed import destroy, init_from_env, rank_trace_path  # noqa: E402


def main(argv: list[str]) -> int:
    out_dir = Path(argv[0])
    wanted = argv[1:]
    ctx = init_from_env()
    results: list[dict] = []
    status = 0
    try:
        table = dist_scenarios.scenario_by_name(ctx.world_size)
        names = wanted or list(table)
        results.append(dist_scenarios.run_collectives(ctx.rank, ctx.world_size, ctx.device))
        for name in names:
            try:
                results.append(dist_scenarios.run_scenario(table[name], ctx.rank, ctx.world_size, ctx.device))
            except Exception:
                results.append({"scenario": name, "rank": ctx.rank, "error": traceback.format_exc(limit=8)})
                status = 1
                break
    finally:
        path = rank_trace_path(out_dir / "results.json", ctx.rank)
        path.write_text(json.dumps({"rank": ctx.rank, "world": ctx.world_size, "backend": ctx.backend,
                                    "pid": os.getpid(), "results": results}, indent=1))
        destroy()
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
