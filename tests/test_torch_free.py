"""The decision core works where torch cannot be imported: deciding, explaining, replaying, planning a
checkpoint, the golden check, the diagrams and diff need no tensor. torch and Triton are imported only to
build or run a kernel (the runtime wing: ``moe_fsm.runtime.build`` and what it reaches)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import sys
sys.modules["torch"] = None     # any 'import torch' now raises ImportError
sys.modules["triton"] = None
import moe_fsm
from moe_fsm import MoELayer, ParallelConfig, QuantScheme, build, preset, select, replay
from moe_fsm.plan.plan import plan_model
from moe_fsm.trace.document import canonical
from moe_fsm.cli.main import main

d = select(MoELayer(quant=QuantScheme.fp8()), env={}, platform=preset("sm90"), policy="seeds")
assert d.backend == "FLASHINFER_CUTLASS", d.backend
assert replay(d.trace) == canonical(d.trace)
d = select(MoELayer(), ParallelConfig(dp_size=2, tp_size=2), env={}, platform=preset("sm90"), policy="seeds")
assert d.backend == "TRITON" and not d.plan.runnable
trace = sys.argv[1] + "/t.json"
assert main(["select", "--platform", "cpu", "--quant", "nvfp4", "--no-env", "--policy", "seeds", "--trace-out", trace]) == 0
assert main(["explain", trace]) == 0
assert main(["replay", trace]) == 0
assert main(["diagram", "--check", "docs/state-diagram.md"]) == 0
assert main(["golden", "--check", "--profile", "seeds", "unq-sm90-auto", "fp8-block-cpu-fallback"]) == 0
plan = plan_model("tests/data/configs/qwen3-30b-a3b", platform=preset("sm90"), env={}, policy="seeds",
                  trace_dir=sys.argv[1] + "/plan")
assert plan.ok and {row.decision.backend for row in plan.layers} == {"TRITON"}, plan.groups()
assert main(["plan", "tests/data/configs/deepseek-v3", "--platform", "sm90", "--no-env", "--policy", "seeds",
             "--trace-dir", sys.argv[1] + "/plan-cli"]) == 0
assert "torch" not in [m for m in sys.modules if sys.modules[m] is not None and m.split(".")[0] == "torch"]
try:
    build(d)
except ImportError:
    print("build needs torch: ImportError, as expected")
print("TORCH-FREE OK")
"""


def test_the_core_imports_and_decides_with_torch_unimportable(tmp_path):
    """import moe_fsm, select, explain, replay, plan (library and command), diagram, golden; build alone needs torch."""
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "TORCH-FREE OK" in result.stdout
