"""Quantization schemes of an MoE layer's experts.

A scheme is the pair (weight key, activation key) that vLLM's oracles pass to
every support check, plus the family that picks which oracle policy applies.
Keys are small frozen values so that a support predicate can list the pairs a
kernel accepts as plain data.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from moe_fsm.inputs.hashing import hashed_once
from moe_fsm.errors import InputError


class QuantFamily(str, Enum):
    """Which selection policy applies: one per vLLM oracle."""

    UNQUANTIZED = "unquantized"
    FP8 = "fp8"
    NVFP4 = "nvfp4"


class Granularity(str, Enum):
    """What one scale covers."""

    TENSOR = "tensor"  # one scale per tensor (per expert for weights)
    CHANNEL = "channel"  # one scale per output row of a weight
    TOKEN = "token"  # one scale per activation row
    BLOCK_128x128 = "block128x128"  # DeepSeek-style weight blocks
    GROUP_1x128 = "group1x128"  # per token, per 128 columns
    GROUP_1x16 = "group1x16"  # NVFP4: e4m3 scale per 16 elements, plus a global fp32 scale


@hashed_once
@dataclass(frozen=True)
class QuantKey:
    """The data type and scale layout of one quantized operand (weights or activations)."""

    dtype: str  # "fp8_e4m3" or "nvfp4"
    granularity: Granularity
    static: bool

    def __str__(self) -> str:
        return _KEY_TEXT.get(self) or f"{self.dtype}:{'static' if self.static else 'dynamic'}:{self.granularity.value}"

    def to_json(self) -> dict:
        return {"dtype": self.dtype, "granularity": self.granularity.value, "static": self.static}

    @classmethod
    def from_json(cls, data: dict) -> "QuantKey":
        return cls(data["dtype"], Granularity(data["granularity"]), bool(data["static"]))


FP8 = "fp8_e4m3"
FP4 = "nvfp4"

FP8_STATIC_TENSOR = QuantKey(FP8, Granularity.TENSOR, True)
FP8_DYNAMIC_TENSOR = QuantKey(FP8, Granularity.TENSOR, False)
FP8_STATIC_CHANNEL = QuantKey(FP8, Granularity.CHANNEL, True)
FP8_STATIC_TOKEN = QuantKey(FP8, Granularity.TOKEN, True)
FP8_DYNAMIC_TOKEN = QuantKey(FP8, Granularity.TOKEN, False)
FP8_STATIC_BLOCK128 = QuantKey(FP8, Granularity.BLOCK_128x128, True)
FP8_DYNAMIC_GROUP128 = QuantKey(FP8, Granularity.GROUP_1x128, False)
NVFP4_STATIC = QuantKey(FP4, Granularity.GROUP_1x16, True)
NVFP4_DYNAMIC = QuantKey(FP4, Granularity.GROUP_1x16, False)

FP8_WEIGHT_SCALES = {
    "tensor": FP8_STATIC_TENSOR,
    "channel": FP8_STATIC_CHANNEL,
    "block": FP8_STATIC_BLOCK128,
}
FP8_ACTIVATION_SCALES = {
    ("tensor", True): FP8_STATIC_TENSOR,
    ("tensor", False): FP8_DYNAMIC_TENSOR,
    ("token", True): FP8_STATIC_TOKEN,
    ("token", False): FP8_DYNAMIC_TOKEN,
    ("group", False): FP8_DYNAMIC_GROUP128,
}

FLOAT_DTYPES = ("bfloat16", "float16", "float32")

_KEY_TEXT: dict = {}
_KEY_TEXT.update({
    key: f"{key.dtype}:{'static' if key.static else 'dynamic'}:{key.granularity.value}"
    for key in (*FP8_WEIGHT_SCALES.values(), *FP8_ACTIVATION_SCALES.values(), NVFP4_STATIC, NVFP4_DYNAMIC)
})


@hashed_once
@dataclass(frozen=True)
class QuantScheme:
    """Family plus the (weight, activation) keys; unquantized layers have neither key."""

    family: QuantFamily
    weight: QuantKey | None = None
    activation: QuantKey | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.family, QuantFamily):
            try:
                object.__setattr__(self, "family", QuantFamily(self.family))
            except (ValueError, TypeError):
                raise InputError(
                    f"quantization family {self.family!r} is not one of {[f.value for f in QuantFamily]}"
                ) from None
        for name in ("weight", "activation"):
            key = getattr(self, name)
            if key is not None and not isinstance(key, QuantKey):
                raise InputError(f"a scheme's {name} key must be a QuantKey or None, got {key!r}")
        if self.family is QuantFamily.UNQUANTIZED and (self.weight or self.activation):
            raise InputError("an unquantized scheme has no weight or activation quantization key")
        if self.family is QuantFamily.FP8:
            if self.weight not in FP8_WEIGHT_SCALES.values():
                raise InputError(
                    f"FP8 weight key {self.weight} is not one of "
                    f"{sorted(str(k) for k in FP8_WEIGHT_SCALES.values())}"
                )
            if self.activation not in FP8_ACTIVATION_SCALES.values():
                raise InputError(
                    f"FP8 activation key {self.activation} is not one of "
                    f"{sorted(str(k) for k in FP8_ACTIVATION_SCALES.values())}"
                )
        if self.family is QuantFamily.NVFP4:
            if self.weight != NVFP4_STATIC or self.activation not in (NVFP4_DYNAMIC, None):
                raise InputError(
                    "an NVFP4 scheme has weight key nvfp4:static:group1x16 and activation key "
                    "nvfp4:dynamic:group1x16 (or none, for weight-only W4A16)"
                )

    @classmethod
    def unquantized(cls) -> "QuantScheme":
        return cls(QuantFamily.UNQUANTIZED)

    @classmethod
    def fp8(cls, weight_scale: str = "block", activation_scale: str = "group", static_activation: bool = False) -> "QuantScheme":
        """FP8 w8a8: weight_scale in tensor|channel|block, activation_scale in tensor|token|group."""
        if not isinstance(static_activation, bool):
            raise InputError(f"FP8 static_activation must be True or False, got {static_activation!r}")
        if not isinstance(weight_scale, str) or weight_scale not in FP8_WEIGHT_SCALES:
            raise InputError(f"FP8 weight_scale {weight_scale!r} is not one of {sorted(FP8_WEIGHT_SCALES)}")
        act = FP8_ACTIVATION_SCALES.get((activation_scale, static_activation)) if isinstance(activation_scale, str) else None
        if act is None:
            accepted = sorted(f"{g} ({'static' if s else 'dynamic'})" for g, s in FP8_ACTIVATION_SCALES)
            kind = "static" if static_activation else "dynamic"
            raise InputError(f"FP8 activation scale {activation_scale!r} ({kind}) is not one of {accepted}")
        return cls(QuantFamily.FP8, FP8_WEIGHT_SCALES[weight_scale], act)

    @classmethod
    def nvfp4(cls) -> "QuantScheme":
        return cls(QuantFamily.NVFP4, NVFP4_STATIC, NVFP4_DYNAMIC)

    @property
    def is_block_fp8(self) -> bool:
        return self.weight == FP8_STATIC_BLOCK128

    def describe(self) -> str:
        if self.family is QuantFamily.UNQUANTIZED:
            return "unquantized"
        return f"{self.family.value} w={self.weight} a={self.activation}"

    def to_json(self) -> dict:
        return {
            "family": self.family.value,
            "weight": self.weight.to_json() if self.weight else None,
            "activation": self.activation.to_json() if self.activation else None,
        }

    @classmethod
    def from_json(cls, data: dict) -> "QuantScheme":
        family = QuantFamily(data["family"])
        weight = QuantKey.from_json(data["weight"]) if data.get("weight") else None
        activation = QuantKey.from_json(data["activation"]) if data.get("activation") else None
        return cls(family, weight, activation)
