"""Single-process checks of the distributed building blocks: placement, sharding, packing, selection, launch."""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch

from moe_fsm.distributed import (
    ExpertPlacement,
    init_from_env,
    launch,
    launch_env,
    pack_row_bytes,
    rank_trace_path,
    resolve_backend,
    shard_experts,
    shard_intermediate,
    torchrun_command,
    unpack_row_bytes,
)
from moe_fsm.distributed.group import resolve_timeout
from moe_fsm.errors import BackendUnavailableError, EnvVarError, InputError, KernelInputError
from moe_fsm.inputs.parallel import ParallelConfig
from moe_fsm.inputs.quant import QuantScheme
from moe_fsm.kernels.reference import moe_reference
from moe_fsm.modular.interfaces import ActivationFormat, ExpertScales
from moe_fsm.prepare_finalize.choice import PrepareFinalizeKind, build_prepare_finalize, choose_prepare_finalize
from moe_fsm.prepare_finalize.local import LocalBatchedPrepareFinalize, LocalPrepareFinalize
from moe_fsm.prepare_finalize.transport import Quantized, quantize_before_communication
from moe_fsm.quantize.weights import quantize_weights

STD, BAT = ActivationFormat.STANDARD, ActivationFormat.BATCHED
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")


# -- expert placement --------------------------------------------------------------


def test_placement_splits_contiguously_with_remainder_first() -> None:
    p = ExpertPlacement(10, 4, 2)
    assert p.counts == (3, 3, 2, 2)
    assert (p.local_start, p.local_end, p.num_local_experts) == (6, 8, 2)
    assert p.owner_table().tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3]
    assert p.expert_map().tolist() == [-1] * 6 + [0, 1] + [-1, -1]
    assert p.expert_map().dtype == torch.int32
    assert p.local_slice(torch.arange(10)).tolist() == [6, 7]


def test_placement_rejects_impossible_splits() -> None:
    with pytest.raises(InputError, match="at least one expert per rank"):
        ExpertPlacement(3, 4, 0)
    with pytest.raises(InputError, match="below world_size"):
        ExpertPlacement(8, 2, 2)
    with pytest.raises(KernelInputError, match="num_experts=8"):
        ExpertPlacement(8, 2, 0).local_slice(torch.zeros(7, 3))


# -- weight sharding ---------------------------------------------------------------


def _dense_experts(e: int = 4, k: int = 32, n: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(e, 2 * n, k, generator=g, dtype=torch.float64), torch.randn(e, k, n, generator=g, dtype=torch.float64)


def test_intermediate_shards_sum_to_the_full_layer() -> None:
    """Each rank's N slice gives a partial output; the partials add up to the unsharded layer (why finalize reduce-scatters)."""
    w1, w2 = _dense_experts()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 32, generator=g, dtype=torch.float64)
    ids = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2], [0, 3]])
    w = torch.rand(5, 2, generator=g)
    full = moe_reference(x, w1, w2, w, ids)
    partial = sum(
        moe_reference(x, *shard_intermediate(w1, w2, ExpertScales(), intermediate_size=16, rank=r, world_size=4)[:2], w, ids)
        for r in range(4)
    )
    torch.testing.assert_close(partial, full)


@pytest.mark.parametrize(
    "scheme,world,w1_scale,w2_scale",
    [
        (QuantScheme.fp8("channel", "token"), 4, (4, 128), (4, 32)),
        (QuantScheme.fp8("tensor", "token"), 4, (4,), (4,)),
        (QuantScheme.fp8("block", "group"), 2, (4, 2, 1), (4, 1, 1)),
        (QuantScheme.nvfp4(), 4, (4, 128, 2), (4, 32, 4)),
    ],
)
def test_intermediate_sharding_cuts_scales_with_their_weights(scheme, world, w1_scale, w2_scale) -> None:
    n = 256
    part = n // world
    w1, w2 = _dense_experts(n=n)
    w1q, w2q, scales = quantize_weights(w1.float(), w2.float(), scheme)
    s1, s2, ss = shard_intermediate(w1q, w2q, scales, intermediate_size=n, rank=1, world_size=world)
    assert tuple(ss.w1_scale.shape) == w1_scale and tuple(ss.w2_scale.shape) == w2_scale
    packing = 2 if scheme.family.value == "nvfp4" else 1
    assert s1.shape[1] == 2 * part and s2.shape[2] * packing == part
    # rank 1 keeps gate rows part..2*part of the full w1 and up rows N+part..N+2*part
    assert torch.equal(s1[:, :part].view(torch.uint8), w1q[:, part : 2 * part].view(torch.uint8))
    assert torch.equal(s1[:, part:].view(torch.uint8), w1q[:, n + part : n + 2 * part].view(torch.uint8))
    assert torch.equal(s2.view(torch.uint8), w2q[:, :, part // packing : 2 * part // packing].view(torch.uint8))


def test_intermediate_sharding_rejects_misaligned_slices() -> None:
    w1, w2 = _dense_experts(n=16)
    with pytest.raises(InputError, match="divisible"):
        shard_intermediate(w1, w2, ExpertScales(), intermediate_size=16, rank=0, world_size=3)
    w1q, w2q, scales = quantize_weights(*_dense_experts(n=256), QuantScheme.fp8("block", "group"))
    with pytest.raises(InputError, match="blocks of 128"):
        shard_intermediate(w1q, w2q, scales, intermediate_size=256, rank=0, world_size=4)


def test_expert_sharding_slices_per_expert_scales_only() -> None:
    w1q, w2q, scales = quantize_weights(*(w.float() for w in _dense_experts(e=6, n=16)), QuantScheme.nvfp4())
    scales = ExpertScales(**{**vars(scales), "a1_global_scale": torch.ones(1)})
    p = ExpertPlacement(6, 4, 3)  # counts 2, 2, 1, 1
    s1, s2, ss = shard_experts(w1q, w2q, scales, p)
    assert s1.shape[0] == s2.shape[0] == ss.w1_scale.shape[0] == ss.w2_global_scale.shape[0] == 1
    assert torch.equal(s1, w1q[5:6])
    assert ss.a1_global_scale.shape == (1,)


# -- byte packing ------------------------------------------------------------------


@pytest.mark.parametrize("rows", [0, 3])
def test_row_bytes_round_trip_any_dtype(rows: int) -> None:
    tensors = [
        torch.randn(rows, 8).to(torch.float8_e4m3fn),
        torch.rand(rows, 2, 3),
        torch.randint(0, 9, (rows, 2), dtype=torch.int32),
        torch.randint(0, 255, (rows, 5), dtype=torch.uint8),
        torch.randn(rows, 4).to(torch.bfloat16),
    ]
    packed, layout = pack_row_bytes(tensors)
    # fields at 0, 8, 32, 40 and 46 (bf16 aligned to 2 bytes), the row padded from 54 to 64 bytes
    assert [f.start for f in layout.fields] == [0, 8, 32, 40, 46]
    assert packed.shape == (rows, 64) and packed.dtype == torch.uint8
    for a, b in zip(tensors, unpack_row_bytes(packed, layout)):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert rows == 0 or b.data_ptr() - packed.data_ptr() < layout.row_bytes  # a view into the packed rows
        assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a, b.view(torch.uint8) if b.element_size() == 1 else b)


def test_row_bytes_need_aligned_rows() -> None:
    with pytest.raises(KernelInputError, match="same number of rows"):
        pack_row_bytes([torch.zeros(2, 3), torch.zeros(3, 3)])


# -- selection ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "parallel,fmt,name,kind",
    [
        (ParallelConfig(), STD, "LocalPrepareFinalize", PrepareFinalizeKind.LOCAL),
        (ParallelConfig(), BAT, "LocalBatchedPrepareFinalize", PrepareFinalizeKind.LOCAL),
        (ParallelConfig(dp_size=2), STD, "AllGatherReduceScatterPrepareFinalize", PrepareFinalizeKind.ALLGATHER_REDUCESCATTER),
        (ParallelConfig(dp_size=2), BAT, "AllGatherReduceScatterPrepareFinalize", PrepareFinalizeKind.ALLGATHER_REDUCESCATTER),
        (ParallelConfig(dp_size=2, ep_size=2), STD, "AllGatherReduceScatterPrepareFinalize", PrepareFinalizeKind.ALLGATHER_REDUCESCATTER),
        (ParallelConfig(dp_size=4, ep_size=4, all2all="torch_all2all"), STD, "AllToAllPrepareFinalize", PrepareFinalizeKind.TORCH_ALL2ALL),
        (ParallelConfig(dp_size=4, ep_size=4, all2all="torch_all2all"), BAT, "FixedCapacityAllToAllPrepareFinalize", PrepareFinalizeKind.TORCH_ALL2ALL),
        (ParallelConfig(ep_size=2), STD, "ExpertParallelReducePrepareFinalize", PrepareFinalizeKind.EP_ALL_REDUCE),
        (ParallelConfig(tp_size=2, ep_size=2), BAT, "ExpertParallelReducePrepareFinalize", PrepareFinalizeKind.EP_ALL_REDUCE),
        (ParallelConfig(dp_size=2, ep_size=2, all2all="deepep_high_throughput"), STD, "DeepEPHTPrepareAndFinalize", PrepareFinalizeKind.DEEPEP_HIGH_THROUGHPUT),
        (ParallelConfig(dp_size=2, ep_size=2, all2all="deepep_low_latency", batched_activation_format=True), BAT, "DeepEPLLPrepareAndFinalize", PrepareFinalizeKind.DEEPEP_LOW_LATENCY),
        (ParallelConfig(dp_size=2, ep_size=2, all2all="flashinfer_all2allv"), STD, "FlashInferAllToAllMoEPrepareAndFinalize", PrepareFinalizeKind.FLASHINFER_ALL2ALLV),
    ],
)
def test_choice_follows_vllm_rules(parallel, fmt, name, kind) -> None:
    choice = choose_prepare_finalize(parallel, fmt)
    assert (choice.name, choice.kind, choice.activation_format) == (name, kind, fmt)
    assert choice.reason and choice.to_json()["name"] == name
    assert choice.uses_expert_map == parallel.use_ep


def test_choice_reason_names_the_all_to_all_kind() -> None:
    choice = choose_prepare_finalize(ParallelConfig(dp_size=2, ep_size=2, all2all="torch_all2all"), "standard")
    assert "dp_size=2 with expert parallelism" in choice.reason and "torch_all2all" in choice.reason


@pytest.mark.parametrize(
    "parallel,fmt,match",
    [
        (ParallelConfig(batched_activation_format=True), STD, "batched_activation_format=True.*standard"),
        (ParallelConfig(dp_size=2, ep_size=2, all2all="deepep_high_throughput"), BAT, "deepep_high_throughput.*standard.*batched"),
        (ParallelConfig(dp_size=2, ep_size=2, all2all="flashinfer_all2allv"), BAT, "flashinfer_all2allv.*batched"),
        (ParallelConfig(dp_size=2, ep_size=4), STD, "ep_size must equal dp_size \\* tp_size"),
        (ParallelConfig(tp_size=4, ep_size=2), STD, "ep_size = tp_size"),
        (ParallelConfig(), "rows", "not one of"),
    ],
)
def test_impossible_combinations_name_both_sides(parallel, fmt, match) -> None:
    with pytest.raises(InputError, match=match):
        choose_prepare_finalize(parallel, fmt)


def test_build_local_and_refuse_vllm_kinds() -> None:
    local = build_prepare_finalize(choose_prepare_finalize(ParallelConfig(), STD), ParallelConfig(), 8)
    assert isinstance(local, LocalPrepareFinalize)
    batched = build_prepare_finalize(choose_prepare_finalize(ParallelConfig(), BAT), ParallelConfig(), 8, max_num_tokens=16)
    assert isinstance(batched, LocalBatchedPrepareFinalize) and batched.max_num_tokens == 16
    for kind in ("deepep_high_throughput", "flashinfer_all2allv"):
        parallel = ParallelConfig(dp_size=2, ep_size=2, all2all=kind)
        with pytest.raises(BackendUnavailableError, match=kind):
            build_prepare_finalize(choose_prepare_finalize(parallel, STD), parallel, 8)


@pytest.mark.parametrize("parallel", [ParallelConfig(tp_size=2, dp_size=2), ParallelConfig(tp_size=2, dp_size=2, ep_size=4),
                                      ParallelConfig(tp_size=2, dp_size=2, ep_size=4, all2all="torch_all2all")])
def test_tp_inside_a_dp_replica_is_chosen_as_vllm_does_but_not_built_here(parallel) -> None:
    choice = choose_prepare_finalize(parallel, STD)
    assert not choice.buildable and "tp_size=1" in choice.not_buildable_because
    with pytest.raises(BackendUnavailableError, match="cannot be built by moe-fsm.*tp_size=1"):
        build_prepare_finalize(choice, parallel, 8)


def test_build_distributed_needs_a_process_group() -> None:
    parallel = ParallelConfig(dp_size=2, ep_size=2, all2all="torch_all2all")
    with pytest.raises(InputError, match="no process group"):
        build_prepare_finalize(choose_prepare_finalize(parallel, STD), parallel, 8)


def test_quantize_before_communication_except_dynamic_per_tensor() -> None:
    assert quantize_before_communication(None)
    assert quantize_before_communication(QuantScheme.unquantized())
    assert quantize_before_communication(QuantScheme.fp8("block", "group"))
    assert quantize_before_communication(QuantScheme.fp8("tensor", "tensor", static_activation=True))
    assert quantize_before_communication(QuantScheme.nvfp4())
    assert not quantize_before_communication(QuantScheme.fp8("tensor", "tensor"))


def test_prequantized_rows_refuse_other_tensors() -> None:
    rows = torch.zeros(2, 4)
    adapter = Quantized(rows, None)
    assert adapter(rows)[0] is rows
    with pytest.raises(KernelInputError):
        adapter(rows.clone())


# -- process group and launch -------------------------------------------------------


def test_init_from_env_names_missing_variables(monkeypatch) -> None:
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(InputError, match="RANK.*moe-fsm run --nproc"):
        init_from_env()


def test_backend_and_timeout_from_env(monkeypatch) -> None:
    monkeypatch.setenv("MOE_FSM_DIST_BACKEND", "mpi")
    with pytest.raises(EnvVarError, match="gloo, nccl"):
        resolve_backend()
    monkeypatch.setenv("MOE_FSM_DIST_BACKEND", "GLOO")
    assert resolve_backend() == "gloo"
    monkeypatch.delenv("MOE_FSM_DIST_BACKEND")
    assert resolve_backend() == ("nccl" if torch.cuda.is_available() else "gloo")
    if not torch.cuda.is_available():
        with pytest.raises(BackendUnavailableError, match="CUDA"):
            resolve_backend("nccl")
    monkeypatch.setenv("MOE_FSM_DIST_TIMEOUT", "-3")
    with pytest.raises(EnvVarError, match="positive"):
        resolve_timeout()
    monkeypatch.setenv("MOE_FSM_DIST_TIMEOUT", "12.5")
    assert resolve_timeout() == 12.5


@pytest.mark.parametrize("raw", ["nan", "inf", "-inf", "1e308", "604801", "0", "-3", "soon"])
def test_dist_timeout_is_a_positive_finite_number_of_seconds_up_to_a_week(raw, monkeypatch, capsys, tmp_path) -> None:
    """Issue 39, item 8: nan and 1e308 passed the old check (nan <= 0 is false) and broke timedelta in every rank."""
    monkeypatch.setenv("MOE_FSM_DIST_TIMEOUT", raw)
    accepted = "accepted values: a positive finite number of seconds, at most 604800 (7 days)"
    with pytest.raises(EnvVarError, match=re.escape(f"MOE_FSM_DIST_TIMEOUT={raw!r} is not valid; {accepted}")):
        resolve_timeout()
    launched = []
    monkeypatch.setattr("moe_fsm.engine.distributed_run.launch", lambda *a, **k: launched.append(a) or 0)
    from moe_fsm.cli.main import main

    assert main(["run", "--nproc", "2", "--trace-dir", str(tmp_path)]) == 2  # refused by the launcher, before any rank
    err = capsys.readouterr().err
    assert err == f"moe-fsm run: error: MOE_FSM_DIST_TIMEOUT={raw!r} is not valid; {accepted}\n" and not launched


@pytest.mark.parametrize("seconds", [float("nan"), float("inf"), 1e308, 0, True, "60"])
def test_a_timeout_given_in_code_is_held_to_the_same_bounds(seconds) -> None:
    with pytest.raises(InputError, match="timeout_s must be a positive finite number of seconds, at most 604800"):
        resolve_timeout(seconds)
    with pytest.raises(InputError, match="timeout_s must be a positive finite number of seconds, at most 604800"):
        launch(2, ["true"], timeout_s=seconds)


def test_the_largest_dist_timeout_is_accepted(monkeypatch) -> None:
    monkeypatch.setenv("MOE_FSM_DIST_TIMEOUT", "604800")
    assert resolve_timeout() == 604800.0
    assert resolve_timeout(0.5) == 0.5


def test_torchrun_command_line_keeps_rank_arguments_out_of_its_parser() -> None:
    command = torchrun_command(2)
    assert command[:4] == [sys.executable, "-m", "moe_fsm.launch_trampoline", "--agent"]
    assert "--standalone" in command and command[command.index("--nproc-per-node") + 1] == "2"
    assert command[-2:] == ["-m", "moe_fsm.launch_trampoline"]
    env = launch_env(["moe-fsm", "run", "--nproc", "2"], {"X": "1"})
    assert json.loads(env["MOE_FSM_LAUNCH_ARGV"]) == ["moe-fsm", "run", "--nproc", "2"] and env["X"] == "1"
    with pytest.raises(InputError):
        torchrun_command(0)
    with pytest.raises(InputError):
        launch_env([])


def test_launch_refuses_to_nest(monkeypatch) -> None:
    for name, value in zip(LAUNCH_VARS, ("0", "2", "127.0.0.1", "29500", "0")):
        monkeypatch.setenv(name, value)
    with pytest.raises(InputError, match="already started"):
        launch(2, ["x.py"])


def test_rank_trace_path() -> None:
    assert str(rank_trace_path("traces/run.json", 3)) == "traces/run.rank3.json"
    assert str(rank_trace_path("trace", 0)) == "trace.rank0"
    with pytest.raises(InputError):
        rank_trace_path("t.json", -1)
