"""bench/sweep_default_rules.py without a GPU: every rule it times gives a config the kernels accept on every shape
of its grid, and ``score`` reads the fitted default's figures off a saved sweep."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from moe_fsm.kernels.triton_moe.config import default_config, validate_config

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "sweep_default_rules.py"


@pytest.fixture(scope="module")
def sweep():
    spec = importlib.util.spec_from_file_location("sweep_default_rules", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_rule_gives_a_valid_config_on_every_shape_of_the_grid(sweep):
    names = [[s[0] for s in part] for part in (sweep.FIT, sweep.HELD_OUT, sweep.CHECK)]
    assert sum(map(len, names)) == len(set().union(*names)), "a shape in two parts of the grid"
    for _, e, n, k, top_k, fp8 in sweep.FIT + sweep.HELD_OUT + sweep.CHECK:
        for tokens in sweep.TOKENS:
            for rule in {**sweep.RULES, **sweep.CANDIDATES}.values():
                validate_config(rule(e, n, k, top_k, tokens, fp8), block_fp8=fp8 == "block")


def point(sweep, entry, part, tokens, us):
    _, e, n, k, top_k, fp8 = entry
    configs = {name: rule(e, n, k, top_k, tokens, fp8).to_json() for name, rule in sweep.RULES.items() if name != "default"}
    return {"shape": entry[0], "part": part, "E": e, "N": n, "K": k, "top_k": top_k, "quant": fp8 or "bf16",
            "tokens": tokens, "configs": configs, "us": {"vllm": 100.0, **{name: us[name] for name in configs}}}


def test_score_takes_the_time_of_the_rule_that_chose_the_defaults_config(sweep, tmp_path):
    glm = next(s for s in sweep.HELD_OUT if s[0] == "glm-4.5-like-block")
    mixtral = next(s for s in sweep.FIT if s[0] == "mixtral-8x7b")
    # GLM-4.5-like at 8192 tokens: 410 rows per expert, the 128-row Gluon blocks, which "tma" and "rows" also pick
    assert default_config(160, 1536, 5120, 8, 8192, block_fp8=True, fp8=True).block_m == 128
    times = {"vllm_tiles": 125.0, "tma": 80.0, "rows": 80.0, "rows_flat": 80.0}
    report = {"points": [point(sweep, glm, "held_out", 8192, times),
                         point(sweep, mixtral, "fit", 512, {**times, "rows": 50.0, "rows_flat": 200.0})]}
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(report))
    summary = sweep.score(path)
    assert summary["held_out"] == {"points": 1, "geomean": 1.25, "min": 1.25, "below_1": []}
    # Mixtral at 512 tokens: 128 rows per expert, the 64-row TMA tile, which only "rows" picks
    assert summary["fit"] == {"points": 1, "geomean": 2.0, "min": 2.0, "below_1": []}
    assert summary["not_timed"] == []


def test_the_vllm_benchmark_runs_the_sweeps_parts_and_a_share_of_them(sweep):
    """bench_experts_vs_vllm.py run --sweep-shapes held_out check --only ...: the parts' shapes, then the named ones
    (one process per GPU takes its share); a name not among them is refused by name."""
    import argparse

    spec = importlib.util.spec_from_file_location("bench_experts_vs_vllm", SCRIPT.parent / "bench_experts_vs_vllm.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = argparse.Namespace(series=None, shape=None, sweep_shapes=["held_out", "check"], only=None)
    assert list(bench.series_shapes(args)) == [s[0] for s in sweep.HELD_OUT + sweep.CHECK]
    args.only = ["qwen3-next-tp2", "kimi-k2-like-block"]
    shapes = bench.series_shapes(args)
    assert list(shapes) == ["kimi-k2-like-block", "qwen3-next-tp2"]
    assert (shapes["qwen3-next-tp2"].num_experts, shapes["qwen3-next-tp2"].intermediate) == (512, 256)
    args.only = ["qwen3-next-tp2", "no-such-layer"]
    with pytest.raises(SystemExit, match="no-such-layer: not among the chosen shapes"):
        bench.series_shapes(args)
