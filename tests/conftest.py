"""Fixtures every test folder may use."""

from __future__ import annotations

import pytest

from moe_fsm.decision import probed_platform
from moe_fsm.inputs.platform import PLATFORM_OVERRIDE_VAR


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
