"""moe-fsm's vLLM plugin, without vLLM: its registration, its no-op when MOE_FSM_VLLM_TRACE_DIR is unset, that it
never raises into vLLM, and the comparison it writes. Against vLLM's real source: test_vllm_plugin_real.py."""

from __future__ import annotations

import logging
import sys
import tomllib
from pathlib import Path

import pytest

from moe_fsm.integrations import vllm as plugin

ROOT = Path(__file__).resolve().parents[2]


def test_registered_under_vllm_general_plugins():
    entry = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["vllm.general_plugins"]
    assert entry == {"moe_fsm_trace": "moe_fsm.integrations.vllm:register"}
    module, _, name = entry["moe_fsm_trace"].partition(":")
    assert getattr(__import__(module, fromlist=[name]), name) is plugin.register


def test_noop_when_the_variable_is_unset(monkeypatch):
    monkeypatch.delenv(plugin.ENV_VAR, raising=False)
    before = set(sys.modules)
    plugin.register()
    assert plugin._installed is None
    assert not any(m == "vllm" or m.startswith("vllm.") for m in set(sys.modules) - before)


def test_noop_when_the_variable_is_blank(monkeypatch):
    monkeypatch.setenv(plugin.ENV_VAR, "  ")
    plugin.register()
    assert plugin._installed is None


def test_never_raises_into_vllm(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv(plugin.ENV_VAR, str(tmp_path / "traces"))

    def broken(_):
        raise RuntimeError("boom")

    monkeypatch.setattr(plugin, "install", broken)
    with caplog.at_level(logging.ERROR, logger="moe_fsm.vllm"):
        plugin.register()
    assert "could not install" in caplog.text


def test_the_wrapper_passes_the_return_value_and_the_exception_through(monkeypatch, tmp_path):
    monkeypatch.setattr(plugin, "_installed", plugin.Installed(tmp_path, "0.33.0", [], iter(range(100))))
    marker = object()
    calls = []
    monkeypatch.setattr(plugin, "record", lambda *a: calls.append(a) or (_ for _ in ()).throw(RuntimeError("x")))

    def oracle(moe_config):
        return marker

    wrapped = plugin._wrap("unquantized", oracle, "here")
    assert wrapped("cfg") is marker  # the plugin's own failure is logged, vLLM's value passes
    assert calls and calls[0][2] == {"moe_config": "cfg"}

    class Refusal(ValueError):
        pass

    def refusing(moe_config):
        raise Refusal("no")

    with pytest.raises(Refusal):
        plugin._wrap("unquantized", refusing, "here")("cfg")
    assert wrapped.__wrapped__ is oracle and wrapped.__moe_fsm_wrapped__


def test_compare_names_the_step_where_the_paths_part():
    trace = {"path": ["start", "auto_scan", "selected"], "events": [
        {"event": "transition", "dest": "auto_scan"},
        {"event": "candidate", "backend": "FLASHINFER_CUTLASS", "kernel": None, "reason": "needs compute capability 10.x"},
        {"event": "candidate", "backend": "TRITON", "kernel": "TritonExperts", "reason": None},
    ]}
    theirs = {"outcome": "selected", "backend": "FLASHINFER_CUTLASS", "kernel": "FlashInferExperts"}
    ours = {"outcome": "selected", "backend": "TRITON", "kernel": "TritonExperts"}
    verdict = plugin.compare(theirs, ours, trace)
    assert verdict["status"] == "disagree" and verdict["first_differing_step"] == "auto_scan"
    assert "needs compute capability 10.x" in verdict["summary"]
    assert plugin.compare(ours, dict(ours, via="auto_scan"), trace) == {"status": "agree"}


def test_vllm_answer_reads_the_returned_pair():
    class Backend:
        name = "TRITON"

    class TritonExperts:
        pass

    assert plugin.vllm_answer((Backend(), TritonExperts), None) == {
        "outcome": "selected", "backend": "TRITON", "kernel": "TritonExperts"}
    assert plugin.vllm_answer(None, NotImplementedError("none"))["error"] == "NotImplementedError"
