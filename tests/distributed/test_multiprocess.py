"""Distributed prepare/finalize across real processes: every format against the float64 reference.

World sizes 2 and 4 over gloo (or NCCL, see conftest). Each test checks one
scenario's results from every rank; the ranks ran all scenarios in one session
(see ``dist_suite``). The scenarios cover all-gather/reduce-scatter with and
without EP, all-to-all and the EP all-reduce, standard and batched formats,
unquantized, FP8 (block/group, channel/token, static and dynamic per-tensor)
and NVFP4, a rank with zero tokens, all ranks with zero tokens, every token
routed to one rank's experts, skewed routing, and router weight on the input.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import dist_scenarios  # noqa: E402
from dist_harness import WORKER, dist_backend, skip_unless_world_fits  # noqa: E402

from moe_fsm.distributed import launch, rank_trace_path  # noqa: E402

pytestmark = pytest.mark.distributed

WORLDS = (2, 4)
CASES = [(w, s.name) for w in WORLDS for s in dist_scenarios.scenarios(w)]


@pytest.mark.parametrize("world,name", CASES, ids=[f"w{w}-{n}" for w, n in CASES])
def test_scenario_matches_reference(dist_suite, world: int, name: str) -> None:
    skip_unless_world_fits(world)
    results = dist_suite(world).get(name)
    assert results is not None, f"no rank reported scenario {name} (an earlier scenario failed; see its error)"
    assert sorted(r["rank"] for r in results) == list(range(world))
    for res in results:
        ok, why = dist_scenarios.result_ok(res)
        assert ok, f"rank {res['rank']}: {why}"


@pytest.mark.parametrize("world", WORLDS)
def test_collectives(dist_suite, world: int) -> None:
    skip_unless_world_fits(world)
    results = dist_suite(world)["collectives"]
    assert len(results) == world
    assert all(r["ok"] for r in results), results


@pytest.mark.parametrize("world", WORLDS)
def test_no_rank_failed(dist_suite, world: int) -> None:
    """A scenario that raised on any rank shows up here with its traceback."""
    skip_unless_world_fits(world)
    errors = [r for rs in dist_suite(world).values() for r in rs if "error" in r]
    assert not errors, errors[0]["error"]


def test_launch_runs_ranks_under_torchrun(tmp_path: Path) -> None:
    """launch() starts torch.distributed.run; each rank joins via init_from_env and writes its own file."""
    skip_unless_world_fits(2)
    name = next(s.name for s in dist_scenarios.scenarios(2) if s.mode == "a2a" and s.quant == "fp8_block_group")
    status = launch(
        2,
        [str(WORKER), str(tmp_path), name],
        env={"MOE_FSM_DIST_BACKEND": dist_backend(), "MOE_FSM_DIST_TIMEOUT": "30", "OMP_NUM_THREADS": "1"},
        timeout_s=120,
    )
    assert status == 0
    for rank in range(2):
        data = json.loads(rank_trace_path(tmp_path / "results.json", rank).read_text())
        assert data["rank"] == rank and data["world"] == 2
        for res in data["results"]:
            ok, why = dist_scenarios.result_ok(res)
            assert ok, f"rank {rank} {res['scenario']}: {why}"


def test_launch_passes_arguments_torchrun_would_claim(tmp_path: Path) -> None:
    """``--nproc`` and ``--node-rank`` are torchrun options (or abbreviations); the rank must still get them verbatim."""
    script = tmp_path / "echo_argv.py"
    script.write_text(
        "import json, os, sys\n"
        "from pathlib import Path\n"
        "Path(sys.argv[1]).write_text(json.dumps({'argv': sys.argv[2:], 'rank': os.environ['RANK'],"
        " 'world': os.environ['WORLD_SIZE'], 'leaked': 'MOE_FSM_LAUNCH_ARGV' in os.environ}))\n"
    )
    out = tmp_path / "argv.json"
    assert launch(1, [str(script), str(out), "--nproc", "2", "--node-rank", "x"], timeout_s=60) == 0
    seen = json.loads(out.read_text())
    assert seen == {"argv": ["--nproc", "2", "--node-rank", "x"], "rank": "0", "world": "1", "leaked": False}
