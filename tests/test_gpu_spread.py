"""The GPU suite's xdist workers take the visible GPUs in turn (tests/conftest.py's pytest_configure)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest


def _root_conftest():
    """tests/conftest.py loaded by path: the name ``conftest`` may be any folder's conftest in sys.modules."""
    spec = importlib.util.spec_from_file_location("moe_fsm_tests_root_conftest", Path(__file__).with_name("conftest.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_ROOT = _root_conftest()
SPREAD_GPUS_VAR, pytest_configure = _ROOT.SPREAD_GPUS_VAR, _ROOT.pytest_configure


@pytest.mark.parametrize(
    ("count", "visible", "worker", "expected"),
    [
        ("4", None, "gw0", "0"),
        ("4", None, "gw5", "1"),
        ("2", "2,3", "gw1", "3"),
        ("2", "2,3", "gw2", "2"),
    ],
)
def test_worker_sees_one_gpu_in_turn(monkeypatch, count, visible, worker, expected):
    monkeypatch.setenv(SPREAD_GPUS_VAR, count)
    monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    pytest_configure(None)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == expected


def test_without_the_count_or_a_worker_nothing_changes(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    monkeypatch.delenv(SPREAD_GPUS_VAR, raising=False)
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw3")
    pytest_configure(None)
    monkeypatch.setenv(SPREAD_GPUS_VAR, "4")
    monkeypatch.delenv("PYTEST_XDIST_WORKER")
    pytest_configure(None)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "7"


@pytest.mark.parametrize("count", ["0", "two", "-1"])
def test_a_bad_count_is_refused_by_name(monkeypatch, count):
    monkeypatch.setenv(SPREAD_GPUS_VAR, count)
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    with pytest.raises(pytest.UsageError, match=SPREAD_GPUS_VAR):
        pytest_configure(None)
