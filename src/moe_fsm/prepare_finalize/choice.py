"""Which prepare/finalize moves the tokens, from the parallel config and the experts' format.

This follows vLLM's ``maybe_make_prepare_finalize``: tokens travel between
ranks with all-to-all kernels only when data AND expert parallelism are both on
(``use_all2all_kernels``); data parallelism alone falls back to
all-gather + reduce-scatter; neither keeps tokens local. vLLM leaves expert
parallelism without data parallelism to the layer (every rank holds the same
tokens, computes its own experts, and ``reduce_results`` all-reduces the
output); moe-fsm makes that reduction a prepare/finalize of its own
(:class:`ExpertParallelReducePrepareFinalize`) so that the modular kernel's
output is the layer's output on every rank.

:func:`choose_prepare_finalize` is pure (the FSM's terminal state calls it and
records the reason in the trace); :func:`build_prepare_finalize` instantiates the
choice on the live process group.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Optional

import torch.distributed as dist

from moe_fsm.distributed.expert_map import ExpertPlacement
from moe_fsm.errors import BackendUnavailableError, InputError
from moe_fsm.inputs.parallel import AllToAllKind, ParallelConfig
from moe_fsm.inputs.quant import QuantScheme
from moe_fsm.modular.interfaces import ActivationFormat, PrepareFinalize
from moe_fsm.prepare_finalize.all2all import AllToAllPrepareFinalize
from moe_fsm.prepare_finalize.allgather import AllGatherReduceScatterPrepareFinalize
from moe_fsm.prepare_finalize.ep_reduce import ExpertParallelReducePrepareFinalize
from moe_fsm.prepare_finalize.fixed_all2all import DEFAULT_MAX_TOKENS_PER_RANK, FixedCapacityAllToAllPrepareFinalize
from moe_fsm.prepare_finalize.transport import local_prepare_finalize, quantize_before_communication


class PrepareFinalizeKind(str, Enum):
    """How tokens travel; the first four are built by moe-fsm, the rest are vLLM kernels we only model."""

    LOCAL = "local"
    ALLGATHER_REDUCESCATTER = "allgather_reducescatter"
    TORCH_ALL2ALL = "torch_all2all"
    EP_ALL_REDUCE = "ep_all_reduce"
    DEEPEP_HIGH_THROUGHPUT = "deepep_high_throughput"
    DEEPEP_LOW_LATENCY = "deepep_low_latency"
    FLASHINFER_ALL2ALLV = "flashinfer_all2allv"


BUILT_HERE = frozenset(
    {
        PrepareFinalizeKind.LOCAL,
        PrepareFinalizeKind.ALLGATHER_REDUCESCATTER,
        PrepareFinalizeKind.TORCH_ALL2ALL,
        PrepareFinalizeKind.EP_ALL_REDUCE,
    }
)

# vLLM's kernels: class name, the one activation format they dispatch in, and why moe-fsm cannot build them.
# (Keyed by AllToAllKind; PrepareFinalizeKind shares the values.)
_VLLM_ONLY = {
    AllToAllKind.DEEPEP_HIGH_THROUGHPUT: (
        "DeepEPHTPrepareAndFinalize",
        ActivationFormat.STANDARD,
        "DeepEP high-throughput dispatch needs the deep_ep library and the NVSHMEM/RDMA buffers "
        "that vLLM's all2all manager allocates",
    ),
    AllToAllKind.DEEPEP_LOW_LATENCY: (
        "DeepEPLLPrepareAndFinalize",
        ActivationFormat.BATCHED,
        "DeepEP low-latency dispatch needs the deep_ep library and the NVSHMEM buffers "
        "that vLLM's all2all manager allocates",
    ),
    AllToAllKind.FLASHINFER_ALL2ALLV: (
        "FlashInferAllToAllMoEPrepareAndFinalize",
        ActivationFormat.STANDARD,
        "FlashInfer all2allv (vLLM's alias of flashinfer_nvlink_two_sided) needs FlashInfer's MNNVL "
        "workspace that vLLM's all2all manager sets up, and dispatches NVFP4 only",
    ),
}

# torch_all2all: batched experts get the fixed-capacity dispatch (no host sync, CUDA-graph capturable),
# as vLLM pairs its batched-format experts with the low-latency all2all backends.
_ALL2ALL_NAMES = {
    ActivationFormat.STANDARD: "AllToAllPrepareFinalize",
    ActivationFormat.BATCHED: "FixedCapacityAllToAllPrepareFinalize",
}
_ALL2ALL_NOTES = {
    ActivationFormat.STANDARD: "",
    ActivationFormat.BATCHED: "; fixed capacity per rank, no host synchronisation (CUDA-graph capturable)",
}

_LOCAL_NAMES = {
    ActivationFormat.STANDARD: "LocalPrepareFinalize",
    ActivationFormat.BATCHED: "LocalBatchedPrepareFinalize",
}


@dataclass(frozen=True)
class PrepareFinalizeChoice:
    """The chosen prepare/finalize: class name, kind, format it hands the experts, and why.

    ``uses_expert_map``: the experts see local expert ids (-1 for slots other ranks
    compute). ``group_size``: how many ranks its process group must have.
    """

    name: str
    kind: PrepareFinalizeKind
    activation_format: ActivationFormat
    reason: str
    uses_expert_map: bool
    group_size: int

    @property
    def buildable(self) -> bool:
        """True when moe-fsm can instantiate it (the vLLM-only kinds are modelled, not built)."""
        return self.kind in BUILT_HERE

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "kind": self.kind.value,
            "activation_format": self.activation_format.value,
            "reason": self.reason,
            "uses_expert_map": self.uses_expert_map,
            "group_size": self.group_size,
            "buildable": self.buildable,
        }


def choose_prepare_finalize(parallel: ParallelConfig, experts_format: ActivationFormat) -> PrepareFinalizeChoice:
    """Pick how tokens reach experts that take ``experts_format``; InputError for impossible pairs."""
    fmt = _format(experts_format)
    sizes = f"tp_size={parallel.tp_size}, dp_size={parallel.dp_size}, ep_size={parallel.ep_size}"
    if parallel.batched_activation_format and fmt is ActivationFormat.STANDARD:
        raise InputError(
            "the parallel config dispatches in the batched activation format (batched_activation_format=True) "
            "but the experts take the standard format; pick batched experts or a standard dispatch"
        )

    if not parallel.use_dp and not parallel.use_ep:
        return PrepareFinalizeChoice(
            _LOCAL_NAMES[fmt],
            PrepareFinalizeKind.LOCAL,
            fmt,
            f"no data or expert parallelism ({sizes}): tokens stay on this rank, {fmt.value} format",
            uses_expert_map=False,
            group_size=1,
        )

    if parallel.use_ep and not parallel.use_dp:
        if parallel.tp_size not in (1, parallel.ep_size):
            raise InputError(
                f"expert parallelism without data parallelism spreads the experts over the tensor-parallel ranks "
                f"(vLLM: ep_size = tp_size), but {sizes}"
            )
        ignored = (
            f"; all2all={parallel.all2all.value} is unused (vLLM moves tokens between ranks only with dp_size > 1)"
            if parallel.all2all is not AllToAllKind.ALLGATHER_REDUCESCATTER
            else ""
        )
        return PrepareFinalizeChoice(
            "ExpertParallelReducePrepareFinalize",
            PrepareFinalizeKind.EP_ALL_REDUCE,
            fmt,
            f"ep_size={parallel.ep_size} without data parallelism ({sizes}): every rank holds the same tokens, "
            f"computes only its own experts ({fmt.value} format, expert map) and the partial outputs are "
            f"summed by an all-reduce{ignored}",
            uses_expert_map=True,
            group_size=parallel.ep_size,
        )

    if parallel.use_dp and not parallel.use_ep:
        _require_one_rank_per_replica(parallel, "all-gather/reduce-scatter", sizes)
        return PrepareFinalizeChoice(
            "AllGatherReduceScatterPrepareFinalize",
            PrepareFinalizeKind.ALLGATHER_REDUCESCATTER,
            fmt,
            f"dp_size={parallel.dp_size} without expert parallelism ({sizes}): every rank gathers all ranks' "
            f"tokens, computes its slice of every expert's intermediate dimension ({fmt.value} format) and "
            f"reduce-scatters the partial sums back (vLLM's naive DP fallback)",
            uses_expert_map=False,
            group_size=parallel.dp_size,
        )

    # Data and expert parallelism: the all-to-all kind decides.
    expected_ep = parallel.dp_size * parallel.tp_size
    if parallel.ep_size != expected_ep:
        raise InputError(
            f"with data and expert parallelism vLLM spreads the experts over every rank, so ep_size must equal "
            f"dp_size * tp_size = {expected_ep}; got {sizes}"
        )
    kind = parallel.all2all
    if kind in _VLLM_ONLY:
        name, needed, why = _VLLM_ONLY[kind]
        if fmt is not needed:
            raise InputError(
                f"all2all={kind.value} ({name}) dispatches in the {needed.value} activation format, "
                f"but the experts take the {fmt.value} format"
            )
        return PrepareFinalizeChoice(
            name,
            PrepareFinalizeKind(kind.value),
            fmt,
            f"dp_size={parallel.dp_size} with expert parallelism ({sizes}): tokens travel by all-to-all "
            f"({kind.value}, vLLM's {name}, {fmt.value} format); moe-fsm models this choice but cannot build it: {why}",
            uses_expert_map=True,
            group_size=parallel.ep_size,
        )
    if kind is AllToAllKind.TORCH_ALL2ALL:
        _require_one_rank_per_replica(parallel, "all-to-all", sizes)
        return PrepareFinalizeChoice(
            _ALL2ALL_NAMES[fmt],
            PrepareFinalizeKind.TORCH_ALL2ALL,
            fmt,
            f"dp_size={parallel.dp_size} with expert parallelism ({sizes}): tokens travel by all-to-all "
            f"(torch_all2all): each token goes once to every rank owning one of its experts, "
            f"{fmt.value} format on local experts, and comes back weighted"
            + _ALL2ALL_NOTES[fmt],
            uses_expert_map=True,
            group_size=parallel.ep_size,
        )
    _require_one_rank_per_replica(parallel, "all-gather/reduce-scatter", sizes)
    return PrepareFinalizeChoice(
        "AllGatherReduceScatterPrepareFinalize",
        PrepareFinalizeKind.ALLGATHER_REDUCESCATTER,
        fmt,
        f"dp_size={parallel.dp_size} with expert parallelism ({sizes}): tokens travel by all-gather and "
        f"reduce-scatter (allgather_reducescatter); each rank computes only its own experts' slots "
        f"({fmt.value} format, expert map)",
        uses_expert_map=True,
        group_size=parallel.dp_size,
    )


def _format(experts_format: ActivationFormat | str) -> ActivationFormat:
    if isinstance(experts_format, ActivationFormat):
        return experts_format
    try:
        return ActivationFormat(experts_format)
    except ValueError:
        raise InputError(
            f"experts activation format {experts_format!r} is not one of {[f.value for f in ActivationFormat]}"
        ) from None


def _require_one_rank_per_replica(parallel: ParallelConfig, how: str, sizes: str) -> None:
    """moe-fsm's torch P/Fs talk over one group in which each rank is a whole data-parallel replica.

    With tp_size > 1 vLLM also all-reduces over each replica's TP group and
    deduplicates the replica's identical tokens; that nesting is not built here.
    """
    if parallel.tp_size != 1:
        raise InputError(
            f"moe-fsm's {how} prepare/finalize runs one rank per data-parallel replica (tp_size=1); "
            f"tensor parallelism inside a replica is not supported with it: {sizes}"
        )


def build_prepare_finalize(
    choice: PrepareFinalizeChoice,
    parallel: ParallelConfig,
    num_experts: int,
    *,
    group: Optional[dist.ProcessGroup] = None,
    quant: Optional[QuantScheme] = None,
    max_num_tokens: Optional[int] = None,
) -> PrepareFinalize:
    """Instantiate ``choice`` on this process's group (``group``, default: the world).

    ``quant`` is the layer's scheme: it decides whether activations are quantized
    before they travel (not for dynamic per-tensor FP8). ``max_num_tokens`` is the
    batched format's per-expert capacity (None: sized per call), except for the
    fixed-capacity all-to-all, where it is vLLM's ``max_num_tokens``: the most tokens
    per rank (None: 256, vLLM's default for batched DP). The distributed
    kinds need an initialized process group of ``choice.group_size`` ranks; the
    vLLM-only kinds raise BackendUnavailableError saying what they would need.
    """
    if not choice.buildable:
        why = _VLLM_ONLY[AllToAllKind(choice.kind.value)][2]
        raise BackendUnavailableError(
            f"{choice.name} (all2all={choice.kind.value}) is one of vLLM's prepare/finalize kernels; "
            f"moe-fsm cannot build it: {why}. Use all2all=torch_all2all or allgather_reducescatter to run here"
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
            max_tokens_per_rank=max_num_tokens or DEFAULT_MAX_TOKENS_PER_RANK,
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
        )
    return ExpertParallelReducePrepareFinalize(
        placement, activation_format=choice.activation_format, group=group, max_num_tokens=max_num_tokens
    )
