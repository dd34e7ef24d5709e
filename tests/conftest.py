"""Fixtures every test folder may use."""

from __future__ import annotations

import os

import pytest

from moe_fsm.decision import probed_platform
from moe_fsm.inputs.platform import PLATFORM_OVERRIDE_VAR

SPREAD_GPUS_VAR = "MOE_FSM_TEST_GPUS"


def pytest_configure(config):
    """Spread pytest-xdist workers over the GPUs: worker gwN sees only GPU N mod $MOE_FSM_TEST_GPUS
    (of those CUDA_VISIBLE_DEVICES lists, where it is set).

    The GPU suite on a machine of several GPUs (``bench/gpu.sh suite`` sets the count) then runs its workers side
    by side instead of all on GPU 0. It runs before any test module imports torch, so CUDA_VISIBLE_DEVICES still
    decides what the worker's CUDA context sees.
    """
    count, worker = os.environ.get(SPREAD_GPUS_VAR, ""), os.environ.get("PYTEST_XDIST_WORKER", "")
    if not count:
        return
    if not count.isdigit() or int(count) < 1:
        raise pytest.UsageError(f"{SPREAD_GPUS_VAR} is {count!r}; accepted: the number of GPUs, a whole number >= 1")
    if worker.startswith("gw") and worker[2:].isdigit():
        visible = [gpu for gpu in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if gpu.strip()]
        gpus = visible or [str(index) for index in range(int(count))]
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus[int(worker[2:]) % len(gpus)]


@pytest.fixture
def as_platform(monkeypatch):
    """Run the test as another machine: ``as_platform("cpu-x86")`` makes the probe report that preset.

    The probe is read once per process (``probed_platform`` is cached), so the cache is emptied on the way in
    and out; the override itself is ``MOE_FSM_PLATFORM``, which child processes inherit.
    """

    def pin(name: str) -> None:
        monkeypatch.setenv(PLATFORM_OVERRIDE_VAR, name)
        probed_platform.cache_clear()

    yield pin
    probed_platform.cache_clear()
