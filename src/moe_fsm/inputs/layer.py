"""The MoE layer as the selector sees it: shapes, quantization and options."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from enum import Enum

from moe_fsm.inputs.hashing import field_dict, hashed_once
from moe_fsm.errors import InputError
from moe_fsm.inputs.model_facts import ModelFacts
from moe_fsm.inputs.quant import FLOAT_DTYPES, QuantFamily, QuantScheme


class Activation(str, Enum):
    """Gated activations: w1 holds gate then up, and act(gate) * up feeds w2."""

    SILU = "silu"
    SWIGLUOAI = "swigluoai"
    GELU = "gelu"


def dtype_name(dtype) -> str:
    """``"bfloat16"``, ``"torch.bfloat16"`` or ``torch.bfloat16`` -> ``"bfloat16"`` (by its text: no torch import)."""
    text = str(dtype)
    name = text[len("torch."):] if text.startswith("torch.") else text
    if name not in FLOAT_DTYPES:
        raise InputError(f"dtype {dtype!r} is not one of {list(FLOAT_DTYPES)} (names or torch dtypes)")
    return name


@hashed_once
@dataclass(frozen=True)
class MoELayer:
    """One MoE layer. ``intermediate_size`` is N in w1 = [E, 2N, K], w2 = [E, K, N].

    ``allow_vllm_cutlass`` is the FP8 oracle's switch that compressed-tensors
    checkpoints turn on; other FP8 checkpoints leave vLLM's CUTLASS kernels out.
    ``bias``: the experts add a bias after each GEMM (gpt-oss; vLLM's ``has_bias``).
    ``dtype`` takes a name ("bfloat16") or an engine's dtype object (``torch.bfloat16``),
    stored as the name so the layer stays JSON-able and the core needs no torch.
    ``model``: what an engine reads beyond the layer (architecture, declared quant method, server
    ``--quantization``, speculative draft; ``inputs/model_facts.py``); None when not given.
    """

    quant: QuantScheme = field(default_factory=QuantScheme.unquantized)
    num_experts: int = 8
    top_k: int = 2
    hidden_size: int = 1024
    intermediate_size: int = 512
    activation: Activation = Activation.SILU
    swiglu_limit: float | None = None
    lora: bool = False
    router_weight_on_input: bool = False
    dtype: str = "bfloat16"
    allow_vllm_cutlass: bool = False
    bias: bool = False
    model: ModelFacts | None = None

    def __post_init__(self) -> None:
        if self.model is not None and not isinstance(self.model, ModelFacts):
            raise InputError(f"model must be a ModelFacts or None, got {self.model!r:.80}")
        if not isinstance(self.quant, QuantScheme):
            raise InputError(
                f"quant must be a QuantScheme (QuantScheme.unquantized(), .fp8(...), .nvfp4()), got {self.quant!r}"
            )
        for name in ("lora", "router_weight_on_input", "allow_vllm_cutlass", "bias"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise InputError(f"{name} must be True or False, got {value!r}")
        for name in ("num_experts", "top_k", "hidden_size", "intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InputError(f"{name} must be a positive integer, got {value!r}")
        if self.top_k > self.num_experts:
            raise InputError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}")
        if not isinstance(self.activation, Activation):
            try:
                object.__setattr__(self, "activation", Activation(self.activation))
            except (ValueError, TypeError):
                raise InputError(
                    f"activation {self.activation!r} is not one of {[a.value for a in Activation]}"
                ) from None
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        if self.swiglu_limit is not None:
            if (isinstance(self.swiglu_limit, bool) or not isinstance(self.swiglu_limit, (int, float))
                    or not math.isfinite(self.swiglu_limit) or self.swiglu_limit <= 0):
                raise InputError(f"swiglu_limit must be a positive finite number or None, got {self.swiglu_limit!r}")
            object.__setattr__(self, "swiglu_limit", float(self.swiglu_limit))
        if self.router_weight_on_input and self.top_k != 1:
            raise InputError("router_weight_on_input needs top_k == 1 (the weight scales the one expert's input)")
        if self.quant.family is QuantFamily.NVFP4:
            # One e4m3 scale per 16 elements along each GEMM's reduction dimension: K for w1, N for w2.
            for name in ("hidden_size", "intermediate_size"):
                if getattr(self, name) % 16:
                    raise InputError(
                        f"NVFP4 needs {name} divisible by 16 (one block scale per 16 values along the GEMM's "
                        f"reduction), got {getattr(self, name)}"
                    )
        self._check_groups()

    def _check_groups(self) -> None:
        """Weight scale groups run along K of both GEMMs, so they must divide hidden and intermediate size."""
        quant = self.quant
        width = quant.weight.group_width if quant.weight is not None else None
        if quant.family is QuantFamily.NVFP4 or width is None and (quant.group_size or -1) < 1:
            return
        group = width or quant.group_size
        if self.hidden_size % group or self.intermediate_size % group:
            raise InputError(
                f"{quant.family.value} group size ({group}) must evenly divide both hidden size ({self.hidden_size}) "
                f"and intermediate size ({self.intermediate_size})"
            )

    @property
    def family(self) -> QuantFamily:
        return self.quant.family

    def to_json(self) -> dict:
        data = field_dict(self)
        data["quant"] = self.quant.to_json()
        data["activation"] = self.activation.value
        if not self.bias:
            del data["bias"]  # recorded only when set, so traces of bias-free layers keep their form
        if self.model is None:
            del data["model"]  # likewise: only layers given model facts record them
        else:
            data["model"] = self.model.to_json()
        return data

    @classmethod
    def from_json(cls, data: dict) -> "MoELayer":
        if not isinstance(data, dict):
            raise InputError(f"a layer must be an object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InputError(f"unknown layer field(s) {unknown}; accepted: {sorted(known)}")
        values = dict(data)
        if "quant" in values:
            values["quant"] = QuantScheme.from_json(values["quant"])
        if values.get("model") is not None:
            values["model"] = ModelFacts.from_json(values["model"])
        if "activation" in values:
            values["activation"] = Activation(values["activation"]) if values["activation"] in [a.value for a in Activation] else values["activation"]
        return cls(**values)
