"""Which prepare/finalize moves the tokens, from the parallel config and the experts' format.

This follows vLLM's ``maybe_make_prepare_finalize``: tokens travel between
ranks with all-to-all kernels only when data AND expert parallelism are both on
(``use_all2all_kernels``); data parallelism alone falls back to
all-gather + reduce-scatter; neither keeps tokens local. vLLM leaves expert
parallelism without data parallelism to the layer (every rank holds the same
tokens, computes its own experts, and ``reduce_results`` all-reduces the
output); moe-fsm makes that reduction a prepare/finalize of its own
(``ExpertParallelReducePrepareFinalize``) so that the modular kernel's output is
the layer's output on every rank.

This is part of the decision (pure, no torch): the choice is vLLM's, whatever
moe-fsm's runtime can build. What the runtime cannot build here (vLLM's DeepEP
and FlashInfer all-to-all kernels; tensor parallelism nested in a data-parallel
replica) is recorded as ``not_buildable_because``, and
``moe_fsm.prepare_finalize.choice.build_prepare_finalize`` refuses it with that
reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from enum import Enum

from moe_fsm.errors import InputError
from moe_fsm.inputs.hashing import computed_once, hashed_once
from moe_fsm.inputs.formats import ActivationFormat
from moe_fsm.inputs.parallel import AllToAllKind, ParallelConfig


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


@hashed_once
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
    not_buildable_because: str | None = None  # what keeps moe-fsm's runtime from building it (None: nothing)

    @property
    def buildable(self) -> bool:
        """True when moe-fsm can instantiate it; the decision is vLLM's either way."""
        return self.not_buildable_because is None

    @computed_once
    def to_json(self) -> dict:
        """The trace's ``prepare_finalize`` (choices are remembered per parallel config)."""
        return {
            "name": self.name,
            "kind": self.kind.value,
            "activation_format": self.activation_format.value,
            "reason": self.reason,
            "uses_expert_map": self.uses_expert_map,
            "group_size": self.group_size,
            "buildable": self.buildable,
            "not_buildable_because": self.not_buildable_because,
        }


def choose_prepare_finalize(parallel: ParallelConfig, experts_format: ActivationFormat) -> PrepareFinalizeChoice:
    """Pick how tokens reach experts that take ``experts_format``; InputError for impossible pairs.

    Pure, so remembered per (parallel config, format): every layer of a model asks the same.
    """
    return _choose(parallel, _format(experts_format))


def forget_choices() -> None:
    """Forget the remembered choices (the next of each is computed again)."""
    _choose.cache_clear()


@lru_cache(maxsize=64)
def _choose(parallel: ParallelConfig, fmt: ActivationFormat) -> PrepareFinalizeChoice:
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
        return PrepareFinalizeChoice(
            "AllGatherReduceScatterPrepareFinalize",
            PrepareFinalizeKind.ALLGATHER_REDUCESCATTER,
            fmt,
            f"dp_size={parallel.dp_size} without expert parallelism ({sizes}): every rank gathers all ranks' "
            f"tokens, computes its slice of every expert's intermediate dimension ({fmt.value} format) and "
            f"reduce-scatters the partial sums back (vLLM's naive DP fallback)",
            uses_expert_map=False,
            group_size=parallel.dp_size,
            not_buildable_because=_nested_tp(parallel, "all-gather/reduce-scatter", sizes),
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
            not_buildable_because=f"it is one of vLLM's prepare/finalize kernels: {why}",
        )
    if kind is AllToAllKind.TORCH_ALL2ALL:
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
            not_buildable_because=_nested_tp(parallel, "all-to-all", sizes),
        )
    return PrepareFinalizeChoice(
        "AllGatherReduceScatterPrepareFinalize",
        PrepareFinalizeKind.ALLGATHER_REDUCESCATTER,
        fmt,
        f"dp_size={parallel.dp_size} with expert parallelism ({sizes}): tokens travel by all-gather and "
        f"reduce-scatter (allgather_reducescatter); each rank computes only its own experts' slots "
        f"({fmt.value} format, expert map)",
        uses_expert_map=True,
        group_size=parallel.dp_size,
        not_buildable_because=_nested_tp(parallel, "all-gather/reduce-scatter", sizes),
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


def _nested_tp(parallel: ParallelConfig, how: str, sizes: str) -> str | None:
    """moe-fsm's torch P/Fs talk over one group in which each rank is a whole data-parallel replica.

    With tp_size > 1 vLLM also all-reduces over each replica's TP group and
    deduplicates the replica's identical tokens; that nesting is not built here.
    A fact about moe-fsm's runtime, not about vLLM's decision: the choice stands.
    """
    if parallel.tp_size == 1:
        return None
    return (f"moe-fsm's {how} prepare/finalize runs one rank per data-parallel replica (tp_size=1); "
            f"tensor parallelism inside a replica is not built here: {sizes}")
