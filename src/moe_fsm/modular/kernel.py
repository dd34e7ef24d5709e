"""The modular kernel: prepare -> experts -> finalize, for one MoE layer.

What the selection engine's decision builds: a prepare/finalize object and an
experts object that share an activation format, joined for a layer. A call
validates everything it was handed first (so bad input fails before any kernel
runs, with a reason), then quantizes and dispatches through prepare, computes
through the experts and reduces through finalize.

    kernel = ModularKernel(LocalPrepareFinalize(), TorchExperts(layer), layer)
    out = kernel(hidden_states, w1, w2, topk_weights, topk_ids, scales=scales)
"""

from __future__ import annotations

import statistics
import time
from typing import Optional, Union

import torch

from moe_fsm.errors import KernelInputError
from moe_fsm.inputs.layer import MoELayer
from moe_fsm.modular.interfaces import ActivationFormat, ExpertScales, Experts, PrepareFinalize, WeightAndReduce
from moe_fsm.modular.validation import validate_call

_REDUCE_FOR_FORMAT = {
    ActivationFormat.STANDARD: (WeightAndReduce.EXPERTS, WeightAndReduce.CONTIGUOUS),
    ActivationFormat.BATCHED: (WeightAndReduce.BATCHED,),
}


def check_pairing(prepare_finalize: PrepareFinalize, experts: Experts, layer: MoELayer) -> None:
    """The construction-time checks: formats agree, the reduction fits the format, one layer."""
    pf_format, ex_format = prepare_finalize.activation_format, experts.activation_format
    if pf_format is not ex_format:
        raise KernelInputError(
            f"{prepare_finalize.name} moves tokens in the {pf_format.value} activation format but "
            f"{experts.name} computes in the {ex_format.value} format; pair experts and prepare/finalize of the same format"
        )
    accepted = _REDUCE_FOR_FORMAT[ex_format]
    if experts.weight_and_reduce not in accepted:
        raise KernelInputError(
            f"{experts.name} declares weight-and-reduce {experts.weight_and_reduce.value!r}, which the "
            f"{ex_format.value} format does not take; accepted: {[r.value for r in accepted]}"
        )
    built_for = getattr(experts, "layer", None)
    if built_for is not None and built_for != layer:
        raise KernelInputError(f"{experts.name} was built for a different layer than this kernel's; build both from one MoELayer")


class StageClock:
    """Where a :class:`ModularKernel`'s calls spend their time: dispatch (prepare), experts, combine (finalize).

    Set ``kernel.stage_clock = StageClock()`` and call the kernel: each call records
    four marks, CUDA events on a GPU (recorded on the stream, so no host
    synchronisation while the calls run) or ``perf_counter`` readings on the CPU.
    :meth:`medians` reads them back. Leave it unset during a CUDA-graph capture.
    """

    STAGES = ("dispatch", "experts", "combine")

    def __init__(self) -> None:
        self._calls: list[list[Union[torch.cuda.Event, float]]] = []

    def mark(self, device: torch.device) -> Union[torch.cuda.Event, float]:
        if device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(device))
            return event
        return time.perf_counter()

    def record(self, marks: list[Union[torch.cuda.Event, float]]) -> None:
        self._calls.append(marks)

    @property
    def calls(self) -> int:
        return len(self._calls)

    def medians(self, skip: int = 0) -> dict[str, float]:
        """Median milliseconds of each stage over the recorded calls, leaving out the first ``skip`` (warm-up)."""
        calls = self._calls[skip:] if len(self._calls) > skip else self._calls
        if not calls:
            return {stage: float("nan") for stage in self.STAGES}
        per_stage: list[list[float]] = [[] for _ in self.STAGES]
        for marks in calls:
            for i, (begin, end) in enumerate(zip(marks, marks[1:])):
                if isinstance(begin, float):
                    per_stage[i].append((end - begin) * 1e3)
                else:
                    end.synchronize()
                    per_stage[i].append(begin.elapsed_time(end))
        return {stage: statistics.median(times) for stage, times in zip(self.STAGES, per_stage)}


class ModularKernel:
    """``kernel(hidden_states, w1, w2, topk_weights, topk_ids, *, scales, expert_map) -> [M, K]``."""

    def __init__(self, prepare_finalize: PrepareFinalize, experts: Experts, layer: MoELayer) -> None:
        check_pairing(prepare_finalize, experts, layer)
        self.prepare_finalize = prepare_finalize
        self.experts = experts
        self.layer = layer
        self._validated: set = set()  # call signatures already checked (validate_call)
        self.stage_clock: Optional[StageClock] = None  # set to time dispatch, experts and combine

    @property
    def name(self) -> str:
        return f"{self.prepare_finalize.name}+{self.experts.name}"

    @property
    def capturable(self) -> bool:
        """Whether a call only launches device work (no host read of a device value): CUDA-graph capturable."""
        return self.prepare_finalize.host_sync_free and self.experts.host_sync_free

    def __call__(
        self,
        hidden_states: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        *,
        scales: Optional[ExpertScales] = None,
        expert_map: Optional[torch.Tensor] = None,
        check_values: bool = True,
    ) -> torch.Tensor:
        """The layer's output for this rank's tokens, in hidden_states' dtype.

        Zero tokens still pass through prepare and finalize (a distributed
        prepare/finalize must join its collectives) and yield ``[0, K]``.
        ``check_values=False`` (routing from a router, whose top-k ids are in range
        by construction) checks shapes, dtypes and devices once per signature and
        never reads a tensor's values, on the CPU too; an id out of range then
        contributes nothing, as in the Triton kernels.
        """
        scales = scales or ExpertScales()
        validate_call(self.layer, hidden_states, w1, w2, topk_weights, topk_ids, scales, expert_map, self._validated,
                      values=check_values)
        on_input = self.layer.router_weight_on_input
        clock, device = self.stage_clock, hidden_states.device
        marks = [clock.mark(device)] if clock is not None else None
        prepared = self.prepare_finalize.prepare(
            hidden_states,
            topk_weights,
            topk_ids,
            num_experts=self.layer.num_experts,
            expert_map=expert_map,
            apply_router_weight_on_input=on_input,
            quantize=self.experts.input_quantizer(scales),
        )
        if marks is not None:
            marks.append(clock.mark(device))
        expert_output = self.experts.apply(prepared, w1, w2, scales, apply_router_weight_on_input=on_input)
        if marks is not None:
            marks.append(clock.mark(device))
        output = torch.empty(hidden_states.shape, dtype=hidden_states.dtype, device=hidden_states.device)
        self.prepare_finalize.finalize(
            output,
            expert_output,
            prepared,
            topk_weights=prepared.topk_weights,
            topk_ids=prepared.topk_ids,
            apply_router_weight_on_input=on_input,
            reduce=self.experts.weight_and_reduce,
        )
        if marks is not None:
            marks.append(clock.mark(device))
            clock.record(marks)
        return output
