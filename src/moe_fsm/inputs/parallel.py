"""How the layer is spread over devices: tensor, data and expert parallel sizes."""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import Enum

from moe_fsm.inputs.hashing import field_dict, hashed_once
from moe_fsm.errors import InputError


class AllToAllKind(str, Enum):
    """How tokens travel between ranks when data and expert parallelism are both on.

    ``allgather_reducescatter`` and ``torch_all2all`` are built by moe-fsm on
    torch.distributed; the others are vLLM's kernels, modelled so that a
    selection for them is explained, and rejected where they cannot be built.
    """

    ALLGATHER_REDUCESCATTER = "allgather_reducescatter"
    TORCH_ALL2ALL = "torch_all2all"
    DEEPEP_HIGH_THROUGHPUT = "deepep_high_throughput"
    DEEPEP_LOW_LATENCY = "deepep_low_latency"
    FLASHINFER_ALL2ALLV = "flashinfer_all2allv"


@hashed_once
@dataclass(frozen=True)
class ParallelConfig:
    """tp/dp/ep sizes; ``batched_activation_format`` says experts see [E_local, T, K] inputs."""

    tp_size: int = 1
    dp_size: int = 1
    ep_size: int = 1
    batched_activation_format: bool = False
    all2all: AllToAllKind = AllToAllKind.ALLGATHER_REDUCESCATTER

    def __post_init__(self) -> None:
        for name in ("tp_size", "dp_size", "ep_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InputError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.batched_activation_format, bool):
            raise InputError(f"batched_activation_format must be True or False, got {self.batched_activation_format!r}")
        if not isinstance(self.all2all, AllToAllKind):
            try:
                object.__setattr__(self, "all2all", AllToAllKind(self.all2all))
            except (ValueError, TypeError):
                raise InputError(
                    f"all2all {self.all2all!r} is not one of {[k.value for k in AllToAllKind]}"
                ) from None
        if self.all2all is AllToAllKind.DEEPEP_LOW_LATENCY and self.use_all2all_kernels and not self.batched_activation_format:
            raise InputError("all2all 'deepep_low_latency' dispatches in the batched activation format; set batched_activation_format")

    @property
    def use_ep(self) -> bool:
        return self.ep_size > 1

    @property
    def use_dp(self) -> bool:
        return self.dp_size > 1

    @property
    def use_all2all_kernels(self) -> bool:
        """vLLM's rule: tokens move between ranks only with both DP and EP."""
        return self.use_dp and self.use_ep

    def to_json(self) -> dict:
        data = field_dict(self)
        data["all2all"] = self.all2all.value
        return data

    @classmethod
    def from_json(cls, data: dict) -> "ParallelConfig":
        if not isinstance(data, dict):
            raise InputError(f"a parallel config must be an object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InputError(f"unknown parallel field(s) {unknown}; accepted: {sorted(known)}")
        return cls(**data)
