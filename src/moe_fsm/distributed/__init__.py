"""torch.distributed plumbing for moe-fsm: process groups, expert placement, variable-size collectives, launch.

The prepare/finalize objects in :mod:`moe_fsm.prepare_finalize` move tokens with
these helpers; the per-rank program calls :func:`init_from_env` once and
:func:`destroy` at the end; ``moe-fsm run --nproc N`` goes through :func:`launch`.
"""

from moe_fsm.distributed.collectives import (
    all_gather_ints,
    all_gather_v,
    all_to_all_v,
    exchange_counts,
    exchange_sizes,
    pack_row_bytes,
    reduce_scatter_v,
    unpack_row_bytes,
    wire_view,
)
from moe_fsm.distributed.expert_map import ExpertPlacement
from moe_fsm.distributed.group import (
    BACKEND_ENV,
    TIMEOUT_ENV,
    DistContext,
    current_rank,
    destroy,
    device_for,
    distributed,
    init_from_env,
    is_launched,
    resolve_backend,
)
from moe_fsm.distributed.launch import launch, launch_env, rank_trace_path, torchrun_command
from moe_fsm.distributed.sharding import shard_experts, shard_intermediate

__all__ = [
    "BACKEND_ENV",
    "TIMEOUT_ENV",
    "DistContext",
    "ExpertPlacement",
    "all_gather_ints",
    "all_gather_v",
    "all_to_all_v",
    "current_rank",
    "destroy",
    "device_for",
    "distributed",
    "exchange_counts",
    "exchange_sizes",
    "init_from_env",
    "is_launched",
    "launch",
    "launch_env",
    "pack_row_bytes",
    "rank_trace_path",
    "reduce_scatter_v",
    "resolve_backend",
    "shard_experts",
    "shard_intermediate",
    "torchrun_command",
    "unpack_row_bytes",
    "wire_view",
]
