"""Build the prepare/finalize a decision chose, on the live process group.

The choice itself is the decision core's (``moe_fsm.backends.pf_choice``, pure and
torch-free, re-exported here); this module is the runtime half:
:func:`build_prepare_finalize` instantiates it, or refuses with the reason the
choice recorded when moe-fsm cannot build it.
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from moe_fsm.distributed.expert_map import ExpertPlacement
from moe_fsm.errors import BackendUnavailableError, InputError
from moe_fsm.inputs.formats import ActivationFormat
from moe_fsm.inputs.parallel import ParallelConfig
from moe_fsm.inputs.quant import QuantScheme
from moe_fsm.backends.pf_choice import (  # noqa: F401  (the decision's half, re-exported for the runtime)
    BUILT_HERE, PrepareFinalizeChoice, PrepareFinalizeKind, choose_prepare_finalize,
)
from moe_fsm.modular.interfaces import PrepareFinalize
from moe_fsm.prepare_finalize.all2all import AllToAllPrepareFinalize
from moe_fsm.prepare_finalize.allgather import AllGatherReduceScatterPrepareFinalize
from moe_fsm.prepare_finalize.ep_reduce import ExpertParallelReducePrepareFinalize
from moe_fsm.prepare_finalize.fixed_all2all import DEFAULT_MAX_TOKENS_PER_RANK, FixedCapacityAllToAllPrepareFinalize
from moe_fsm.prepare_finalize.transport import local_prepare_finalize, quantize_before_communication


def build_prepare_finalize(
    choice: PrepareFinalizeChoice,
    parallel: ParallelConfig,
    num_experts: int,
    *,
    group: Optional[dist.ProcessGroup] = None,
    quant: Optional[QuantScheme] = None,
    max_num_tokens: Optional[int] = None,
    max_tokens_per_rank: Optional[int] = None,
) -> PrepareFinalize:
    """Instantiate ``choice`` on this process's group (``group``, default: the world).

    ``quant`` is the layer's scheme: it decides whether activations are quantized
    before they travel (not for dynamic per-tensor FP8). ``max_num_tokens`` is the
    batched format's per-expert capacity (None: sized per call), except for the
    fixed-capacity all-to-all, where it is vLLM's ``max_num_tokens``: the most tokens
    per rank (None: 256, vLLM's default for batched DP). ``max_tokens_per_rank``, the
    most tokens any rank passes in one call (the same on every rank), makes both
    all-to-all kinds send fixed blocks of that many rows: the fixed-capacity one's
    capacity, and the Standard-format one's mode with no host read, which a CUDA
    graph can capture; the other kinds do not need it. The distributed
    kinds need an initialized process group of ``choice.group_size`` ranks; the
    vLLM-only kinds raise BackendUnavailableError saying what they would need.
    """
    if not choice.buildable:
        hint = (" Use all2all=torch_all2all or allgather_reducescatter to run here" if choice.kind not in BUILT_HERE
                else " Run it with tp_size=1 (one rank per data-parallel replica)")
        raise BackendUnavailableError(
            f"{choice.name} (kind {choice.kind.value}) cannot be built by moe-fsm: {choice.not_buildable_because}.{hint}"
        )
    if choice.kind is PrepareFinalizeKind.LOCAL:
        return local_prepare_finalize(choice.activation_format, max_num_tokens)

    if not dist.is_initialized():
        raise InputError(
            f"{choice.name} communicates over torch.distributed, but this process has no process group; "
            f"start it with 'moe-fsm run --nproc {choice.group_size} ...' (which calls init_from_env)"
        )
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if world != choice.group_size:
        raise InputError(
            f"{choice.name} needs a process group of {choice.group_size} ranks for tp_size={parallel.tp_size}, "
            f"dp_size={parallel.dp_size}, ep_size={parallel.ep_size}, but the group has {world}"
        )
    if choice.kind is PrepareFinalizeKind.ALLGATHER_REDUCESCATTER:
        return AllGatherReduceScatterPrepareFinalize(
            activation_format=choice.activation_format,
            group=group,
            quantize_first=quantize_before_communication(quant),
            max_num_tokens=max_num_tokens,
        )
    placement = ExpertPlacement(num_experts, world, rank)
    if choice.kind is PrepareFinalizeKind.TORCH_ALL2ALL and choice.activation_format is ActivationFormat.BATCHED:
        return FixedCapacityAllToAllPrepareFinalize(
            placement,
            max_tokens_per_rank=max_tokens_per_rank or max_num_tokens or DEFAULT_MAX_TOKENS_PER_RANK,
            group=group,
            quantize_first=quantize_before_communication(quant),
        )
    if choice.kind is PrepareFinalizeKind.TORCH_ALL2ALL:
        return AllToAllPrepareFinalize(
            placement,
            activation_format=choice.activation_format,
            group=group,
            quantize_first=quantize_before_communication(quant),
            max_num_tokens=max_num_tokens,
            max_tokens_per_rank=max_tokens_per_rank,
        )
    return ExpertParallelReducePrepareFinalize(
        placement, activation_format=choice.activation_format, group=group, max_num_tokens=max_num_tokens
    )
