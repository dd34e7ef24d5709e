"""Quantization schemes of an MoE layer's experts.

A scheme is the pair (weight key, activation key) that vLLM's oracles pass to
every support check, plus the family that picks which oracle policy applies.
Keys are small frozen values so that a support predicate can list the pairs a
kernel accepts as plain data.

The keys mirror vLLM 0.33.0's ``quant_utils`` (``QuantKey(dtype, ScaleDesc(scale
dtype, static, GroupShape), symmetric)``): two keys are equal exactly when vLLM's
are. Where vLLM's key leaves a fact to the checkpoint config (the group size of
``kInt4Static``'s ``GroupShape(1, -1)``, GPTQ/AWQ zero points that ride beside a
symmetric key, the checkpoint format the WNA16 oracle inspects), the scheme
carries it next to the keys: ``group_size``, ``zero_point``, ``checkpoint``,
``act_order``.

Element dtypes are logical: ``int4`` is vLLM's ``uint4b8`` (GPTQ: stored + 8) and
the INT4 values W4A8-INT8 keeps in int8 storage; ``int8`` is ``uint8b128`` in
WNA16 and ``torch.int8`` in W8A8; ``uint4``/``uint8`` are the asymmetric forms
(with zero points); ``fp4_e2m1`` is an MX FP4 element.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from functools import cached_property

from moe_fsm.inputs.hashing import computed_once, hashed_once
from moe_fsm.errors import InputError


class QuantFamily(str, Enum):
    """Which selection policy applies: one per vLLM oracle."""

    UNQUANTIZED = "unquantized"
    FP8 = "fp8"
    NVFP4 = "nvfp4"
    MXFP4 = "mxfp4"  # gpt-oss; FP4 e2m1 weights, E8M0 scale per 32
    MXFP8 = "mxfp8"  # FP8 e4m3 weights and activations, E8M0 scale per 32
    INT8 = "int8"  # W8A8: per-channel INT8 weights, per-token (or per-tensor) INT8 activations
    INT_WNA16 = "int_wna16"  # GPTQ/AWQ/compressed-tensors INT4/INT8 weights, 16-bit activations
    W4A8 = "w4a8"  # INT4 weights, dynamic per-token FP8 activations (CUTLASS sm90)
    W4A8_INT8 = "w4a8_int8"  # INT4 weights, INT8 activations quantized inside the CPU kernel


class Granularity(str, Enum):
    """What one scale covers."""

    TENSOR = "tensor"  # one scale per tensor (per expert for weights)
    CHANNEL = "channel"  # one scale per output row of a weight
    TOKEN = "token"  # one scale per activation row
    BLOCK_128x128 = "block128x128"  # DeepSeek-style weight blocks
    GROUP_1x128 = "group1x128"  # per row, per 128 columns (FP8 activations; W4A8-INT8 weights)
    GROUP_1x16 = "group1x16"  # NVFP4: e4m3 scale per 16 elements, plus a global fp32 scale
    GROUP_1x32 = "group1x32"  # per row, per 32 columns (MX formats with E8M0 scales; INT4 group 32)
    GROUP_1x64 = "group1x64"  # per row, per 64 columns (W4A8-INT8 weights)
    GROUP = "group"  # per row, per G columns with G from the checkpoint (vLLM's GroupShape(1, -1))


GROUP_WIDTH = {Granularity.GROUP_1x16: 16, Granularity.GROUP_1x32: 32, Granularity.GROUP_1x64: 64, Granularity.GROUP_1x128: 128}


@hashed_once
@dataclass(frozen=True)
class QuantKey:
    """The data type and scale layout of one quantized operand (weights or activations).

    ``scale_dtype`` None is the format's usual scale (fp32 for FP8 and INT8, e4m3
    for NVFP4); keys that vLLM tells apart by scale dtype name it ("e8m0" for MX,
    "float16" for WNA16, "bfloat16" for W4A8-INT8 groups).
    """

    dtype: str  # see QUANT_DTYPES
    granularity: Granularity
    static: bool
    symmetric: bool = True
    scale_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in QUANT_DTYPES:
            raise InputError(f"quantized dtype {self.dtype!r} is not one of {list(QUANT_DTYPES)}")
        if not isinstance(self.granularity, Granularity):
            try:
                object.__setattr__(self, "granularity", Granularity(self.granularity))
            except ValueError:
                raise InputError(
                    f"scale granularity {self.granularity!r} is not one of {[g.value for g in Granularity]}"
                ) from None
        if self.scale_dtype is not None and self.scale_dtype not in SCALE_DTYPES:
            raise InputError(f"scale dtype {self.scale_dtype!r} is not one of {list(SCALE_DTYPES)}")

    def __str__(self) -> str:
        text = f"{self.dtype}:{'static' if self.static else 'dynamic'}:{self.granularity.value}"
        if not self.symmetric:
            text += ":asym"
        return text + (f":{self.scale_dtype}" if self.scale_dtype else "")

    @property
    def group_width(self) -> int | None:
        """Columns one scale covers for fixed-width groups; None otherwise."""
        return GROUP_WIDTH.get(self.granularity)

    @computed_once
    def to_json(self) -> dict:
        """Fields at their defaults are left out, so older keys keep their recorded form. Built once per
        key (keys are interned, so every trace of the process shares it); read-only."""
        data = {"dtype": self.dtype, "granularity": self.granularity.value, "static": self.static}
        if not self.symmetric:
            data["symmetric"] = False
        if self.scale_dtype is not None:
            data["scale_dtype"] = self.scale_dtype
        return data

    @classmethod
    def from_json(cls, data: dict) -> "QuantKey":
        unknown = sorted(set(data) - {"dtype", "granularity", "static", "symmetric", "scale_dtype"})
        if unknown:
            raise InputError(f"unknown quantization key field(s) {unknown}")
        return cls(
            data["dtype"], Granularity(data["granularity"]), bool(data["static"]),
            bool(data.get("symmetric", True)), data.get("scale_dtype"),
        )


FP8 = "fp8_e4m3"
FP4 = "nvfp4"
MX_FP4 = "fp4_e2m1"
INT4 = "int4"
UINT4 = "uint4"
INT8 = "int8"
UINT8 = "uint8"
QUANT_DTYPES = (FP8, FP4, MX_FP4, INT4, UINT4, INT8, UINT8)
E8M0 = "e8m0"
SCALE_DTYPES = (E8M0, "float16", "bfloat16", "float32")

FP8_STATIC_TENSOR = QuantKey(FP8, Granularity.TENSOR, True)
FP8_DYNAMIC_TENSOR = QuantKey(FP8, Granularity.TENSOR, False)
FP8_STATIC_CHANNEL = QuantKey(FP8, Granularity.CHANNEL, True)
FP8_STATIC_TOKEN = QuantKey(FP8, Granularity.TOKEN, True)
FP8_DYNAMIC_TOKEN = QuantKey(FP8, Granularity.TOKEN, False)
FP8_STATIC_BLOCK128 = QuantKey(FP8, Granularity.BLOCK_128x128, True)
FP8_DYNAMIC_GROUP128 = QuantKey(FP8, Granularity.GROUP_1x128, False)
NVFP4_STATIC = QuantKey(FP4, Granularity.GROUP_1x16, True)
NVFP4_DYNAMIC = QuantKey(FP4, Granularity.GROUP_1x16, False)

# MX: one power-of-two E8M0 scale per 32 elements (kMxfp4Static/Dynamic, kMxfp8Static/Dynamic).
MXFP4_STATIC = QuantKey(MX_FP4, Granularity.GROUP_1x32, True, scale_dtype=E8M0)
MXFP4_DYNAMIC = QuantKey(MX_FP4, Granularity.GROUP_1x32, False, scale_dtype=E8M0)
MXFP8_STATIC = QuantKey(FP8, Granularity.GROUP_1x32, True, scale_dtype=E8M0)
MXFP8_DYNAMIC = QuantKey(FP8, Granularity.GROUP_1x32, False, scale_dtype=E8M0)

# WNA16: fp16 group scales (kInt4Static, kInt4Static32, kInt4StaticAsym, kInt4Static32Asym, kInt8Static).
INT4_STATIC_GROUP = QuantKey(INT4, Granularity.GROUP, True, scale_dtype="float16")
INT4_STATIC_GROUP32 = QuantKey(INT4, Granularity.GROUP_1x32, True, scale_dtype="float16")
UINT4_STATIC_GROUP = QuantKey(UINT4, Granularity.GROUP, True, symmetric=False, scale_dtype="float16")
UINT4_STATIC_GROUP32 = QuantKey(UINT4, Granularity.GROUP_1x32, True, symmetric=False, scale_dtype="float16")
INT8_STATIC_GROUP = QuantKey(INT8, Granularity.GROUP, True, scale_dtype="float16")
UINT8_STATIC_GROUP = QuantKey(UINT8, Granularity.GROUP, True, symmetric=False, scale_dtype="float16")

# W8A8 INT8 (kInt8StaticChannelSym, kInt8DynamicTokenSym, ... and the asymmetric activation keys).
INT8_STATIC_CHANNEL = QuantKey(INT8, Granularity.CHANNEL, True)
INT8_STATIC_TENSOR = QuantKey(INT8, Granularity.TENSOR, True)
INT8_DYNAMIC_TOKEN = QuantKey(INT8, Granularity.TOKEN, False)
INT8_DYNAMIC_TENSOR = QuantKey(INT8, Granularity.TENSOR, False)
INT8_DYNAMIC_TOKEN_ASYM = QuantKey(INT8, Granularity.TOKEN, False, symmetric=False)
INT8_STATIC_TENSOR_ASYM = QuantKey(INT8, Granularity.TENSOR, True, symmetric=False)
INT8_DYNAMIC_TENSOR_ASYM = QuantKey(INT8, Granularity.TENSOR, False, symmetric=False)

# W4A8-INT8 (CPU DA8W4): bf16 group scales, or fp32 per-channel (kInt4W4A8Static*).
W4A8_INT8_GROUP128 = QuantKey(INT4, Granularity.GROUP_1x128, True, scale_dtype="bfloat16")
W4A8_INT8_GROUP64 = QuantKey(INT4, Granularity.GROUP_1x64, True, scale_dtype="bfloat16")
W4A8_INT8_GROUP32 = QuantKey(INT4, Granularity.GROUP_1x32, True, scale_dtype="bfloat16")
W4A8_INT8_GROUP = QuantKey(INT4, Granularity.GROUP, True, scale_dtype="bfloat16")
W4A8_INT8_CHANNEL = QuantKey(INT4, Granularity.CHANNEL, True)

# One object per distinct key, the named ones above first: a scheme holds these objects, so a support
# check finds its keys in a catalog's sets by identity instead of comparing them field by field.
_INTERNED_KEYS: dict[QuantKey, QuantKey] = {k: k for k in list(globals().values()) if isinstance(k, QuantKey)}

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

# The activation keys an MXFP4 layer may carry (vLLM's _MXFP4_SCHEME_CANDIDATES); None: 16-bit.
MXFP4_ACTIVATIONS = {
    "none": None,
    "mxfp4": MXFP4_DYNAMIC,
    "mxfp8": MXFP8_DYNAMIC,
    "fp8-group": FP8_DYNAMIC_GROUP128,
    "fp8-tensor": FP8_STATIC_TENSOR,
}
INT8_WEIGHT_SCALES = {"channel": INT8_STATIC_CHANNEL, "tensor": INT8_STATIC_TENSOR}
INT8_ACTIVATION_SCALES = {  # (granularity, static, symmetric)
    ("token", False, True): INT8_DYNAMIC_TOKEN,
    ("token", False, False): INT8_DYNAMIC_TOKEN_ASYM,
    ("tensor", False, True): INT8_DYNAMIC_TENSOR,
    ("tensor", False, False): INT8_DYNAMIC_TENSOR_ASYM,
    ("tensor", True, True): INT8_STATIC_TENSOR,  # kInt8StaticTensorSym, also the per-tensor weight key
    ("tensor", True, False): INT8_STATIC_TENSOR_ASYM,
}
W4A8_INT8_GROUPS = {128: W4A8_INT8_GROUP128, 64: W4A8_INT8_GROUP64, 32: W4A8_INT8_GROUP32}
# How a WNA16 checkpoint format spells its weight key (vLLM's quant methods differ here).
WNA16_CHECKPOINTS = ("gptq", "awq", "compressed-tensors", "moe_wna16")
W4A8_GROUP_SIZE = 128  # compressed-tensors W4A8-FP8 asserts it

FLOAT_DTYPES = ("bfloat16", "float16", "float32")


def _wna16_weight_key(bits: int, group_size: int, zero_point: bool, checkpoint: str) -> QuantKey:
    """vLLM's key for a WNA16 checkpoint: only compressed-tensors marks zero points in the key (uint4, asymmetric);
    GPTQ/AWQ/MoeWNA16 pass them beside a symmetric key; AWQ always uses kInt4Static; a 4-bit group of 32 is kInt4Static32."""
    asym_in_key = zero_point and checkpoint == "compressed-tensors"
    if bits == 8:
        return UINT8_STATIC_GROUP if asym_in_key else INT8_STATIC_GROUP
    group32 = group_size == 32 and checkpoint in ("compressed-tensors", "moe_wna16")
    if asym_in_key:
        return UINT4_STATIC_GROUP32 if group32 else UINT4_STATIC_GROUP
    return INT4_STATIC_GROUP32 if group32 else INT4_STATIC_GROUP


def _check_group_size(family: str, group_size, allowed_channel: bool = True) -> None:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or not (group_size > 0 or (allowed_channel and group_size == -1)):
        accepted = "a positive integer" + (" or -1 (one scale per output channel)" if allowed_channel else "")
        raise InputError(f"{family} group_size must be {accepted}, got {group_size!r}")


# Per family: the (weight, activation) keys a scheme may hold, and whether it has a group size.
_FAMILY_KEYS = {
    QuantFamily.MXFP4: ((MXFP4_STATIC,), tuple(MXFP4_ACTIVATIONS.values())),
    QuantFamily.MXFP8: ((MXFP8_STATIC,), (MXFP8_DYNAMIC,)),
    QuantFamily.INT8: (tuple(INT8_WEIGHT_SCALES.values()), tuple(INT8_ACTIVATION_SCALES.values())),
    QuantFamily.INT_WNA16: (
        (INT4_STATIC_GROUP, INT4_STATIC_GROUP32, UINT4_STATIC_GROUP, UINT4_STATIC_GROUP32, INT8_STATIC_GROUP,
         UINT8_STATIC_GROUP),
        (None,),
    ),
    QuantFamily.W4A8: ((INT4_STATIC_GROUP,), (FP8_DYNAMIC_TOKEN,)),
    QuantFamily.W4A8_INT8: ((*W4A8_INT8_GROUPS.values(), W4A8_INT8_GROUP, W4A8_INT8_CHANNEL), (None,)),
}
GROUPED_FAMILIES = (QuantFamily.INT_WNA16, QuantFamily.W4A8, QuantFamily.W4A8_INT8)


def keys_text(weight: "QuantKey | None", activation: "QuantKey | None") -> str:
    """A (weight, activation) pair as support messages write it: ``fp8_e4m3:static:tensor x none``."""
    return f"{weight or 'none'} x {activation or 'none'}"


@hashed_once
@dataclass(frozen=True)
class QuantScheme:
    """Family plus the (weight, activation) keys; unquantized layers have neither key.

    Integer-weight families also carry what vLLM reads from the checkpoint config
    beside the key: ``group_size`` (columns per weight scale; -1 is one scale per
    output channel), ``zero_point`` (asymmetric weights with zero points),
    ``checkpoint`` (WNA16: gptq | awq | compressed-tensors | moe_wna16) and
    ``act_order`` (GPTQ ``desc_act`` / compressed-tensors group activation order).
    """

    family: QuantFamily
    weight: QuantKey | None = None
    activation: QuantKey | None = None
    group_size: int | None = None
    zero_point: bool = False
    checkpoint: str | None = None
    act_order: bool = False

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
            if key is not None:  # interned: support checks find the catalog's own key object, not a field-by-field equal
                object.__setattr__(self, name, _INTERNED_KEYS.setdefault(key, key))
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
        if self.family in _FAMILY_KEYS:
            weights, activations = _FAMILY_KEYS[self.family]
            if self.weight not in weights:
                raise InputError(f"{self.family.value} weight key {self.weight} is not one of {[str(k) for k in weights]}")
            if self.activation not in activations:
                raise InputError(
                    f"{self.family.value} activation key {self.activation} is not one of {[str(k) for k in activations]}"
                )
        self._check_checkpoint_facts()
        # (weight, activation): the pair vLLM's support checks receive, built once with the scheme
        object.__setattr__(self, "keys", (self.weight, self.activation))

    @cached_property
    def keys_text(self) -> str:
        return keys_text(self.weight, self.activation)

    def _check_checkpoint_facts(self) -> None:
        family = self.family.value
        if self.family not in GROUPED_FAMILIES:
            if self.group_size is not None or self.zero_point or self.checkpoint is not None or self.act_order:
                raise InputError(
                    f"group_size, zero_point, checkpoint and act_order describe integer-weight checkpoints "
                    f"({', '.join(f.value for f in GROUPED_FAMILIES)}); a {family} scheme has none"
                )
            return
        _check_group_size(family, self.group_size)
        width = self.weight.group_width
        if width is not None and self.group_size != width:
            raise InputError(f"{family} weight key {self.weight} has groups of {width}, but group_size is {self.group_size}")
        if self.weight.granularity is Granularity.CHANNEL and self.group_size != -1:
            raise InputError(f"{family} weight key {self.weight} is per channel, but group_size is {self.group_size}")
        if not self.weight.symmetric and not self.zero_point:
            raise InputError(f"{family} weight key {self.weight} is asymmetric; it needs zero_point=True")
        if self.family is QuantFamily.INT_WNA16:
            if self.checkpoint not in WNA16_CHECKPOINTS:
                raise InputError(f"int_wna16 checkpoint {self.checkpoint!r} is not one of {list(WNA16_CHECKPOINTS)}")
        elif self.checkpoint is not None or self.act_order:
            raise InputError(f"checkpoint and act_order are WNA16 facts; a {family} scheme has neither")
        if self.family is not QuantFamily.INT_WNA16 and self.zero_point:
            raise InputError(f"{family} weights are symmetric; zero points are a WNA16 option")

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

    @classmethod
    def mxfp4(cls, activation: str = "none") -> "QuantScheme":
        """MXFP4 weights (gpt-oss); activations 16-bit ("none") or quantized: mxfp4|mxfp8|fp8-group|fp8-tensor."""
        if activation not in MXFP4_ACTIVATIONS:
            raise InputError(f"MXFP4 activation {activation!r} is not one of {list(MXFP4_ACTIVATIONS)}")
        return cls(QuantFamily.MXFP4, MXFP4_STATIC, MXFP4_ACTIVATIONS[activation])

    @classmethod
    def mxfp8(cls) -> "QuantScheme":
        return cls(QuantFamily.MXFP8, MXFP8_STATIC, MXFP8_DYNAMIC)

    @classmethod
    def int8(cls, weight_scale: str = "channel", activation_scale: str = "token", static_activation: bool = False,
             symmetric_activation: bool = True) -> "QuantScheme":
        """INT8 W8A8: weight_scale channel|tensor; activations per token or per tensor, symmetric or not."""
        if weight_scale not in INT8_WEIGHT_SCALES:
            raise InputError(f"INT8 weight_scale {weight_scale!r} is not one of {sorted(INT8_WEIGHT_SCALES)}")
        act = INT8_ACTIVATION_SCALES.get((activation_scale, static_activation, symmetric_activation))
        if act is None:
            accepted = [f"{g} ({'static' if st else 'dynamic'}, {'symmetric' if sy else 'asymmetric'})"
                        for g, st, sy in INT8_ACTIVATION_SCALES]
            asked = f"{activation_scale!r} ({'static' if static_activation else 'dynamic'}, " \
                    f"{'symmetric' if symmetric_activation else 'asymmetric'})"
            raise InputError(f"INT8 activation scale {asked} is not one of {accepted}")
        return cls(QuantFamily.INT8, INT8_WEIGHT_SCALES[weight_scale], act)

    @classmethod
    def int_wna16(cls, bits: int = 4, group_size: int = 128, zero_point: bool = False, checkpoint: str = "gptq",
                  act_order: bool = False) -> "QuantScheme":
        """INT4/INT8 weights with 16-bit activations, as a GPTQ/AWQ/compressed-tensors checkpoint ships them."""
        if bits not in (4, 8):
            raise InputError(f"int_wna16 bits must be 4 or 8, got {bits!r}")
        if checkpoint not in WNA16_CHECKPOINTS:
            raise InputError(f"int_wna16 checkpoint {checkpoint!r} is not one of {list(WNA16_CHECKPOINTS)}")
        if checkpoint == "awq" and bits != 4:
            raise InputError("AWQ MoE checkpoints are 4-bit (vLLM: AutoAWQMoEMethod only supports 4bit)")
        _check_group_size("int_wna16", group_size)
        weight = _wna16_weight_key(bits, group_size, zero_point, checkpoint)
        return cls(QuantFamily.INT_WNA16, weight, None, group_size, bool(zero_point), checkpoint, bool(act_order))

    @classmethod
    def w4a8(cls, group_size: int = W4A8_GROUP_SIZE) -> "QuantScheme":
        """INT4 weights (symmetric, groups of 128) with dynamic per-token FP8 activations."""
        if group_size != W4A8_GROUP_SIZE:
            raise InputError(f"W4A8 (FP8 activations) supports group_size {W4A8_GROUP_SIZE} only, got {group_size!r}")
        return cls(QuantFamily.W4A8, INT4_STATIC_GROUP, FP8_DYNAMIC_TOKEN, group_size)

    @classmethod
    def w4a8_int8(cls, group_size: int = 128) -> "QuantScheme":
        """INT4 weights (symmetric) for the CPU DA8W4 kernel; group_size -1 is per channel."""
        _check_group_size("w4a8_int8", group_size)
        if group_size == -1:
            weight = W4A8_INT8_CHANNEL
        else:
            weight = W4A8_INT8_GROUPS.get(group_size, W4A8_INT8_GROUP)
        return cls(QuantFamily.W4A8_INT8, weight, None, group_size)

    @property
    def is_block_fp8(self) -> bool:
        return self.weight == FP8_STATIC_BLOCK128

    @property
    def weight_bits(self) -> int | None:
        """Bits per stored weight value for integer weights; None for float formats."""
        if self.weight is None:
            return None
        return {INT4: 4, UINT4: 4, INT8: 8, UINT8: 8}.get(self.weight.dtype)

    def describe(self) -> str:
        if self.family is QuantFamily.UNQUANTIZED:
            return "unquantized"
        text = f"{self.family.value} w={self.weight} a={self.activation}"
        if self.group_size is not None:
            text += f" group={self.group_size}"
        if self.zero_point:
            text += " zero-point"
        if self.checkpoint:
            text += f" ({self.checkpoint}{', act-order' if self.act_order else ''})"
        return text

    def to_json(self) -> dict:
        """Checkpoint facts appear only for the families that have them, so older schemes keep their form."""
        data = {
            "family": self.family.value,
            "weight": self.weight.to_json() if self.weight else None,
            "activation": self.activation.to_json() if self.activation else None,
        }
        if self.family in GROUPED_FAMILIES:
            data["group_size"] = self.group_size
            data["zero_point"] = self.zero_point
        if self.family is QuantFamily.INT_WNA16:
            data["checkpoint"] = self.checkpoint
            data["act_order"] = self.act_order
        return data

    @classmethod
    def from_json(cls, data: dict) -> "QuantScheme":
        unknown = sorted(set(data) - {"family", "weight", "activation", "group_size", "zero_point", "checkpoint", "act_order"})
        if unknown:
            raise InputError(f"unknown quant field(s) {unknown}")
        family = QuantFamily(data["family"])
        weight = QuantKey.from_json(data["weight"]) if data.get("weight") else None
        activation = QuantKey.from_json(data["activation"]) if data.get("activation") else None
        return cls(family, weight, activation, data.get("group_size"), bool(data.get("zero_point", False)),
                   data.get("checkpoint"), bool(data.get("act_order", False)))
