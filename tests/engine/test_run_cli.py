"""`moe-fsm run`, the main job, through the CLI."""

import json
import os
import stat
import time

import pytest
import torch

from moe_fsm.cli.main import main
from moe_fsm.engine.manifest import MANIFEST_NAME
from moe_fsm.engine.presets import preset
from moe_fsm.engine.run import KernelTimer, RunOptions, compare, run_model
from moe_fsm.inputs.env import EnvSnapshot
from moe_fsm.inputs.platform import preset as platform_preset
from moe_fsm.trace import schema as trace_schema


def test_run_prints_the_table_and_writes_one_trace_per_distinct_decision(tmp_path, capsys):
    code = main(["run", "--layers", "2", "--tokens", "8", "--env", "VLLM_USE_DEEP_GEMM=0", "--trace-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "2/2 layers within tolerance of the float64 reference" in out
    assert "VLLM_USE_DEEP_GEMM=0" in out
    traces = sorted(tmp_path.glob("*.json"))  # the two layers decide alike: one trace, and the manifest maps both
    assert [json.loads(p.read_text())["layer_name"] for p in traces] == ["model.layers.0.mlp.experts"]
    assert json.loads((tmp_path / "run.manifest").read_text())["command"] == [  # what main() was given, not pytest's argv
        "moe-fsm", "run", "--layers", "2", "--tokens", "8", "--env", "VLLM_USE_DEEP_GEMM=0", "--trace-dir", str(tmp_path)]
    assert main(["explain", str(tmp_path / "run.manifest"), "--layer", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Decision for a unquantized MoE layer (model.layers.1.mlp.experts)")
    assert "shared by 2 layer(s): 0-1" in out
    assert main(["replay", str(tmp_path / "run.manifest"), "--layer", "model.layers.1.mlp.experts"]) == 0
    assert "byte-identical" in capsys.readouterr().out


def test_run_rejects_bad_flags_with_a_message(capsys):
    assert main(["run", "--tokens", "-1"]) == 2
    assert "--tokens must be from 1 to 131072, got -1" in capsys.readouterr().err
    assert main(["run", "--env", "VLLM_USE_FLASHINFER_MOE_FP8=maybe", "--layers", "1"]) == 2
    assert "VLLM_USE_FLASHINFER_MOE_FP8='maybe' is not valid; accepted values: 0 or 1" in capsys.readouterr().err
    assert main(["run", "--device", "tpu"]) == 2
    assert "--device 'tpu' is not one of" in capsys.readouterr().err


def test_run_names_the_failing_layer(tmp_path, capsys):
    code = main(["run", "--preset", "mixed-nvfp4-fp8", "--layers", "4", "--backend", "emulation", "--trace-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 3
    assert "layer 3 (model.layers.3.mlp.experts): moe_backend='emulation' is not supported for FP8 MoE" in err
    failed = json.loads((tmp_path / "layer003-model.layers.3.mlp.experts.json").read_text())
    assert failed["outcome"]["status"] == "failed"


@pytest.mark.distributed
def test_run_across_two_processes(tmp_path, capfd):
    code = main(["run", "--nproc", "2", "--layers", "2", "--tokens", "4", "--trace-dir", str(tmp_path)])
    out = capfd.readouterr().out
    assert code == 0, out
    assert "AllToAllPrepareFinalize" in out and "2/2 layers within tolerance" in out
    stage_table = out.split("stage times per layer", 1)[1].splitlines()
    assert stage_table[1].split() == ["layer", "dispatch", "experts", "combine", "call"]
    for row in stage_table[2:4]:  # one row per layer, three positive times (ms), eager calls (gloo: no CUDA graph)
        name, *times, call = row.split()
        assert name.startswith("model.layers.") and len(times) == 3 and all(float(t) > 0 for t in times), row
        assert call == "eager", row
    assert sorted(p.name for p in tmp_path.glob("*.json")) == [  # the two layers decide alike: one trace per rank
        "layer000-model.layers.0.mlp.experts.rank0.json", "layer000-model.layers.0.mlp.experts.rank1.json",
    ]
    manifest = json.loads((tmp_path / "run.manifest").read_text())
    assert [layer["trace_files"] for layer in manifest["layers"]] == [
        ["layer000-model.layers.0.mlp.experts.rank0.json", "layer000-model.layers.0.mlp.experts.rank1.json"]] * 2
    # the user's command, not rank 0's per-rank command line
    assert manifest["command"] == ["moe-fsm", "run", "--nproc", "2", "--layers", "2", "--tokens", "4", "--trace-dir", str(tmp_path)]
    assert main(["explain", str(tmp_path / "run.manifest"), "--layer", "1", "--rank", "1"]) == 0
    assert "rank1.json, shared by 2 layer(s)" in capfd.readouterr().out


@pytest.mark.distributed
def test_run_across_two_processes_in_fixed_blocks(tmp_path, capfd):
    """--max-tokens-per-rank: the all-to-all sends fixed blocks (no host read); the layer still checks out against
    float64 and each rank's trace records the blocks."""
    code = main(["run", "--nproc", "2", "--layers", "1", "--tokens", "4", "--max-tokens-per-rank", "6",
                 "--trace-dir", str(tmp_path)])
    out = capfd.readouterr().out
    assert code == 0, out
    assert "all-to-all in fixed blocks of 6 rows a rank" in out and "1/1 layers within tolerance" in out
    for rank in (0, 1):
        trace = json.loads((tmp_path / f"layer000-model.layers.0.mlp.experts.rank{rank}.json").read_text())
        assert trace["build"]["max_tokens_per_rank"] == 6
        assert trace_schema.errors(trace) == []
    # CUDA graphs need CUDA: on the CPU the layer runs eagerly, and the manifest says so
    assert [layer["call"] for layer in json.loads((tmp_path / "run.manifest").read_text())["layers"]] == ["eager"]


# -- issue 12, item 10: `run --nproc` checks its flags before launching anything --------------------


@pytest.mark.parametrize("argv,message", [
    (["--nproc", "2", "--all2all", "bogus"], "--all2all 'bogus' is not one of ['torch_all2all', 'allgather_reducescatter']"),
    (["--nproc", "2", "--all2all", "deepep_low_latency"], "--all2all 'deepep_low_latency' is not one of"),
    (["--nproc", "9", "--preset", "mixtral-8x7b"], "--nproc 9 spreads the experts over 9 ranks, but mixtral-8x7b has layers of 8 experts"),
    (["--nproc", "2", "--device", "tpu"], "--device 'tpu' is not one of: cpu, cuda, cuda:N"),
    (["--nproc", "2", "--device", "cuda"], "--device cuda was asked for, but torch sees no CUDA device here"),
    (["--tokens", "1000000000"], "--tokens must be from 1 to 131072, got 1000000000"),
    (["--seed", str(10**23)], "--seed must be from 0 to 2**63-1"),
    (["--seed", "-1"], "--seed must be from 0 to 2**63-1"),
    (["--layers", "1000000"], "--layers must be from 1 to 48 (the MoE layers of qwen3-30b-a3b), got 1000000"),
    (["--repeats", "0"], "--repeats must be from 1 to 1000"),
    (["--max-tokens-per-rank", "64"], "--max-tokens-per-rank sizes the all-to-all's blocks: it needs --nproc 2 or more"),
    (["--nproc", "2", "--all2all", "allgather_reducescatter", "--max-tokens-per-rank", "64"],
     "and --all2all torch_all2all, got --nproc 2 --all2all allgather_reducescatter"),
    (["--nproc", "2", "--tokens", "8", "--max-tokens-per-rank", "8"],
     "--max-tokens-per-rank must be from 9 (the most tokens a rank holds: --tokens 8 + 1) to 131072, got 8"),
])
def test_run_refuses_bad_flags_before_launching(argv, message, capsys, monkeypatch, tmp_path):
    if "cuda" in argv and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    launched = []
    monkeypatch.setattr("moe_fsm.engine.distributed_run.launch", lambda *a, **k: launched.append(a) or 0)
    started = time.perf_counter()
    assert main(["run", *argv, "--trace-dir", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err
    assert not launched and time.perf_counter() - started < 10
    assert not list(tmp_path.iterdir())


def test_run_seed_1e23_is_a_usage_error(capsys):
    assert main(["run", "--seed", "1e23"]) == 2
    assert "invalid int value: '1e23'" in capsys.readouterr().err


# -- item 17: a fast default run, progress lines when not on a terminal, median timing ------------------

CPU = platform_preset("cpu")


def test_default_run_checks_a_sample_of_rows_and_full_check_checks_all(tmp_path):
    _, sampled = run_model(preset("qwen3-30b-a3b"), tokens=40, num_layers=2, env=EnvSnapshot(), platform=CPU,
                           trace_dir=tmp_path, options=RunOptions(repeats=1))
    _, full = run_model(preset("qwen3-30b-a3b"), tokens=40, num_layers=2, env=EnvSnapshot(), platform=CPU,
                        trace_dir=tmp_path, options=RunOptions(check_rows=None, repeats=1))
    assert [r.checked_rows for r in sampled] == [16, 16] and [r.checked_rows for r in full] == [40, 40]
    assert all(r.ok for r in sampled + full)


def test_layers_of_one_configuration_share_one_weight_draw(tmp_path, monkeypatch):
    import moe_fsm.engine.run as run

    draws = []
    real = run.make_weights
    monkeypatch.setattr(run, "make_weights", lambda layer, *a: draws.append(layer) or real(layer, *a))
    run_model(preset("mixed-nvfp4-fp8"), tokens=4, num_layers=8, env=EnvSnapshot(), platform=CPU,
              trace_dir=tmp_path, options=RunOptions(repeats=1))
    assert len(draws) == 2  # one NVFP4 and one FP8 configuration among 8 layers


def test_kernel_time_is_the_median_of_repeats_after_one_warm_up(monkeypatch):
    calls = []
    clock = iter([0.0, 0.005, 1.0, 1.001, 2.0, 2.5])  # three timed calls: 5 ms, 1 ms, 500 ms
    monkeypatch.setattr("moe_fsm.engine.run.time.perf_counter", lambda: next(clock))
    timer = KernelTimer(repeats=3)
    out, ms = timer(lambda: calls.append(1) or len(calls), key="k", on_cuda=False)
    assert len(calls) == 4 and out == 2  # the warm-up call, then three timed ones; the first timed output
    assert ms == pytest.approx(5.0)


def test_kernel_timer_times_the_replays_a_capture_returns_and_says_so():
    """With ``capture`` (run --nproc on GPUs, for layers every rank captures in step), the warm-up call is eager and
    the timed calls are the replay's; a capture that returns None (it failed on some rank) leaves them eager."""
    eager, replays = [], []

    def capture(call):
        assert eager == [1]  # after the warm-up call
        return lambda: replays.append(1) or "replayed"

    timer = KernelTimer(repeats=3)
    out, _ = timer(lambda: eager.append(1) or "eager", key="k", on_cuda=False, capture=capture)
    assert (out, len(eager), len(replays), timer.replayed) == ("replayed", 1, 3, True)
    out, _ = timer(lambda: eager.append(1) or "eager", key="k", on_cuda=False, capture=lambda call: None)
    assert (out, len(eager), len(replays), timer.replayed) == ("eager", 4, 3, False)


def test_run_prints_progress_lines_when_stderr_is_not_a_terminal(tmp_path, capsys):
    assert main(["run", "--layers", "3", "--tokens", "4", "--repeats", "1", "--trace-dir", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.startswith("[")]
    assert [line.split("]")[0] for line in lines] == ["[1/3", "[2/3", "[3/3"]
    assert "model.layers.2.mlp.experts: CPU (TorchExperts)" in lines[-1]
    assert "float64 check: 16 sampled rows per layer (--full-check: every row); time: median of 1 call(s)" in out


# -- item 6: non-finite outputs are reported ---------------------------------------------------------


def test_compare_counts_non_finite_rows_where_the_reference_is_finite():
    ref = torch.ones(4, 3, dtype=torch.float64)
    ref[1, 0] = float("nan")  # a NaN input token: its reference row is NaN as well
    out = ref.clone()
    out[1] = float("nan")
    assert compare(out, ref) == (0.0, 0)
    out[2, 2] = float("inf")
    err, bad = compare(out, ref)
    assert bad == 1 and err == 0.0


def test_a_nan_token_that_poisons_the_batch_fails_the_layer_and_says_so(tmp_path):
    """FP8 per-tensor dynamic: one NaN token gives a NaN scale, so every row turns NaN."""
    from moe_fsm.engine.engine import Engine, route
    from moe_fsm.engine.presets import LayerSpec
    from moe_fsm.engine.report import render_results
    from moe_fsm.engine.run import make_weights, run_layer
    from moe_fsm.inputs.layer import MoELayer
    from moe_fsm.inputs.parallel import ParallelConfig
    from moe_fsm.inputs.quant import QuantScheme
    from moe_fsm.inputs.request import BackendRequest

    layer = MoELayer(quant=QuantScheme.fp8("tensor", "tensor"), num_experts=4, top_k=2, hidden_size=128,
                     intermediate_size=128, dtype="float32")
    engine = Engine([LayerSpec("l0", layer)], parallel=ParallelConfig(), request=BackendRequest(), env=EnvSnapshot(),
                    platform=CPU, trace_dir=tmp_path)
    state = engine.load()[0]
    x = torch.randn(8, 128, generator=torch.Generator().manual_seed(1))
    weights = make_weights(layer, torch.Generator().manual_seed(2), torch.device("cpu"), x)
    topk_weights, topk_ids = route(x, weights.router, 2)
    x[3, 5] = float("nan")
    _, result = run_layer(0, state, x, weights, topk_weights, topk_ids, options=RunOptions(check_rows=None, repeats=1))
    assert result.nonfinite_rows == 7 and not result.ok  # every row but the NaN token's own
    report = render_results([result], engine, tmp_path)
    assert "FAIL (7 of 8 checked rows non-finite)" in report
    assert "NON-FINITE OUTPUTS in 1 layer(s)" in report


# -- item 11: manifest, file modes, stale temporary files ------------------------------------------------


def test_run_writes_a_manifest_naming_its_files_and_earlier_ones(tmp_path, capsys):
    old = tmp_path / "layer009-from-an-earlier-run.json"
    old.write_text("{}")
    os.utime(old, (time.time() - 60, time.time() - 60))
    assert main(["run", "--layers", "2", "--tokens", "4", "--repeats", "1", "--trace-dir", str(tmp_path)]) == 0
    manifest = json.loads((tmp_path / MANIFEST_NAME).read_text())
    assert manifest["schema"] == "moe-fsm/run-manifest" and manifest["ok"] is True
    assert [layer["trace_files"] for layer in manifest["layers"]] == [["layer000-model.layers.0.mlp.experts.json"]] * 2
    assert manifest["traces"] == {"layer000-model.layers.0.mlp.experts.json": ["model.layers.0.mlp.experts",
                                                                               "model.layers.1.mlp.experts"]}
    assert manifest["layers"][0]["backend"] == "CPU" and manifest["layers"][0]["checked_rows"] == 4
    assert manifest["earlier_files"] == [old.name]


def test_trace_files_get_the_umask_mode_not_0600(tmp_path):
    from moe_fsm.trace.document import write_atomic

    old = os.umask(0o022)
    try:
        mode = stat.S_IMODE(write_atomic(tmp_path / "t.json", "{}").stat().st_mode)
    finally:
        os.umask(old)
    assert mode == 0o644


def test_run_removes_temporary_files_of_killed_writers(tmp_path, capsys):
    from moe_fsm.trace.document import remove_stale_temp_files

    dead = tmp_path / ".moe-fsm-tmp.999999999.layer000-x.json.ab12cd"  # no such pid
    live = tmp_path / f".moe-fsm-tmp.{os.getppid()}.layer000-x.json.ef34gh"
    old_live = tmp_path / f".moe-fsm-tmp.{os.getppid()}.layer001-x.json.ij56kl"
    for path in (dead, live, old_live):
        path.write_text("{")
    os.utime(old_live, (time.time() - 7200, time.time() - 7200))
    assert sorted(p.name for p in remove_stale_temp_files(tmp_path)) == sorted([dead.name, old_live.name])
    assert live.exists()
    dead.write_text("{")
    assert main(["run", "--layers", "1", "--tokens", "2", "--repeats", "1", "--trace-dir", str(tmp_path)]) == 0
    assert not dead.exists()
