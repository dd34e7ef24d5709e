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


# SGLang's --moe-a2a-backend choices (0.5.23, srt/arg_groups/fields/exec_.py) and --deepep-mode.
A2A_BACKENDS = ("none", "deepep", "mooncake", "nixl", "mori", "ascend_fuseep", "flashinfer", "megamoe", "deepep_v2",
                "pplx", "ascend_tp", "flashinfer_megamoe")
DEEPEP_MODES = ("auto", "normal", "low_latency")


@hashed_once
@dataclass(frozen=True)
class ParallelConfig:
    """tp/dp/ep sizes; ``batched_activation_format`` says experts see [E_local, T, K] inputs.

    ``all2all`` is how vLLM moves tokens under DP+EP. ``a2a_backend`` and ``deepep_mode`` are SGLang's
    ``--moe-a2a-backend`` (None: not given, SGLang's ``none``) and ``--deepep-mode``, which its
    server-argument pipeline reads when it resolves the MoE runner; vLLM's profiles do not read them.
    """

    tp_size: int = 1
    dp_size: int = 1
    ep_size: int = 1
    batched_activation_format: bool = False
    all2all: AllToAllKind = AllToAllKind.ALLGATHER_REDUCESCATTER
    a2a_backend: str | None = None
    deepep_mode: str = "auto"

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
        if self.a2a_backend is not None and self.a2a_backend not in A2A_BACKENDS:
            raise InputError(f"a2a_backend {self.a2a_backend!r} is not one of {list(A2A_BACKENDS)} (or None)")
        if self.deepep_mode not in DEEPEP_MODES:
            raise InputError(f"deepep_mode {self.deepep_mode!r} is not one of {list(DEEPEP_MODES)}")
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
        # SGLang's flags are recorded only when given, so traces without them keep their form
        if self.a2a_backend is None:
            del data["a2a_backend"]
        if self.deepep_mode == "auto":
            del data["deepep_mode"]
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
