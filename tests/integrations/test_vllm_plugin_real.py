"""The vLLM plugin against vLLM's real source (skipped when the downloaded wheel's source is absent).

The parity tool's method: vLLM's oracle functions run for real with only the machine faked (an H100). Point
MOE_FSM_VLLM_SRC at the unpacked ``vllm`` package's parent (docs/vllm-parity.md); needs the parity venv's
packages. The maintainer command: ``python tools/vllm_plugin_check.py --cache DIR``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CANDIDATES = [Path(os.environ["MOE_FSM_VLLM_SRC"])] if os.environ.get("MOE_FSM_VLLM_SRC") else [
    Path("/work/cache/vllm/src"), Path.home() / ".cache" / "moe-fsm" / "vllm-0.33.0"]
SOURCE = next((p for p in CANDIDATES if (p / "vllm" / "model_executor" / "layers" / "fused_moe" / "oracle").is_dir()),
              None)

pytestmark = pytest.mark.skipif(
    SOURCE is None or importlib.util.find_spec("msgspec") is None or importlib.util.find_spec("fastapi") is None,
    reason="vLLM 0.33.0's unpacked source (MOE_FSM_VLLM_SRC) and its pure-python dependencies are needed")


def test_three_layers_through_vllms_own_oracles(tmp_path):
    sys.path.insert(0, str(ROOT / "tools"))
    import vllm_plugin_check

    results = vllm_plugin_check.run(SOURCE, tmp_path, "0.33.0", "sm90")
    assert [r["name"] for r in results] == list(vllm_plugin_check.LAYERS)
    assert vllm_plugin_check.check(results) == []
    for r in results:
        assert r["record"]["profile"]["name"] == "vllm-0.33"
        assert (tmp_path / r["record"]["trace"]).exists()
