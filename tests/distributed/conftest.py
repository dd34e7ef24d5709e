"""The session fixture that runs the distributed suite once per world size (see dist_harness)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dist_harness import SuiteError, run_ranks  # noqa: E402


@pytest.fixture(scope="session")
def dist_suite(tmp_path_factory):
    """``dist_suite(world)``: every scenario's per-rank results for that world size, run once per session."""
    cache: dict[int, dict[str, list[dict]] | str] = {}

    def get(world: int) -> dict[str, list[dict]]:
        if world not in cache:
            try:
                files = run_ranks(world, tmp_path_factory.mktemp(f"world{world}"))
            except SuiteError as err:
                cache[world] = str(err)  # fail every test of this world with it, without re-running
            else:
                by_scenario: dict[str, list[dict]] = {}
                for f in files:
                    for res in f["results"]:
                        by_scenario.setdefault(res["scenario"], []).append(res)
                cache[world] = by_scenario
        found = cache[world]
        if isinstance(found, str):
            pytest.fail(found)
        return found

    return get


@pytest.fixture
def world_of_one():
    """A one-rank gloo group in this process, for code that needs a process group but no other ranks (a P/F on its
    own, the benchmark's timing wrappers)."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("this process already has a process group")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
