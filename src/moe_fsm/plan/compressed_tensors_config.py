"""compressed-tensors' ``quantization_config`` to each MoE layer's scheme, as vLLM 0.31-0.33's
``CompressedTensorsConfig`` reads it (SGLang's reader reuses it with its own method rules).

The config's ``config_groups`` are matched on the experts' unfused projections (gate, up, down by the model's
checkpoint names), ``ignore`` first; each group's weight and input ``QuantizationArgs`` are validated as
compressed-tensors' pydantic model validates them (``_CtArgs``), and the pair picks vLLM's MoE method and the
scheme it hands its oracle (``_ct_method``). Torch-free, core.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Optional

from moe_fsm.errors import InputError
from moe_fsm.inputs.quant import NVFP4_STATIC, QuantFamily, QuantScheme
from moe_fsm.plan.name_matching import VllmRegex, capped
from moe_fsm.plan.quant_fields import (
    DEFAULT_PROJECTIONS, LayerContext, LayerQuant, Mapped, Reader, Refusal, Refused, bad_field, not_modelled, read_flag,
    read_int, read_names, read_object, unquantized,
)

MAX_GROUPS = 256  # config_groups, each tried for every layer's three projections


@dataclass(frozen=True)
class _CtArgs:
    """compressed-tensors' QuantizationArgs, validated as its pydantic model is (the fields vLLM reads)."""

    num_bits: int
    type: str
    symmetric: bool
    group_size: Optional[int]
    strategy: str
    block_structure: Optional[tuple[int, int]]
    dynamic: bool
    actorder: Optional[str]
    scale_dtype: Optional[str]

    def text(self) -> str:
        return (f"{self.type} {self.num_bits}-bit {self.strategy}"
                + (f" group {self.group_size}" if self.group_size else "") + (" dynamic" if self.dynamic else ""))


STRATEGIES = ("tensor", "channel", "group", "block", "token", "tensor_group", "attn_head")


def _ct_dynamic(args: dict, where: str) -> bool:
    """A compressed-tensors ``dynamic`` read as compressed-tensors' ``QuantizationArgs`` (the pydantic model vLLM
    validates every group's weights and input_activations with) reads it; whatever that model refuses is refused here.

    Accepted: true / false (also the numbers 1 / 0), absent meaning false, and "local" (any case) with the
    ``tensor_group`` strategy, which counts as dynamic. Any other string is refused there, "true" and "false"
    included: its validator turns strings into its ``DynamicType`` enum, whose only member is "local".
    """
    value = args.get("dynamic", False)
    if isinstance(value, str):
        strategy = args.get("strategy")
        if value.lower() == "local" and isinstance(strategy, str) and strategy.lower() == "tensor_group":
            return True
    elif isinstance(value, (bool, int, float)) and value in (0, 1):
        return bool(value)
    raise bad_field(f"{where}.dynamic", "true or false (JSON booleans, not strings), or \"local\" with strategy tensor_group",
               value)


def _ct_args(value, where: str, refuse_group_actorder: bool = True) -> Optional[_CtArgs]:
    """compressed-tensors' QuantizationArgs of one group; ``refuse_group_actorder``: vLLM's refusal of group /
    dynamic activation ordering (engines whose Marlin kernels take it, SGLang's, pass False)."""
    if value is None:
        return None
    args = read_object(value, where)
    kind = args.get("type", "int")
    if not isinstance(kind, str) or kind.lower() not in ("int", "float"):
        raise bad_field(f"{where}.type", "'int' or 'float'", kind)
    bits = read_int(args.get("num_bits", 8), f"{where}.num_bits", low=1)
    symmetric = args.get("symmetric", True)
    symmetric = True if symmetric is None else read_flag(symmetric, f"{where}.symmetric")
    group = args.get("group_size")
    if group is not None:
        group = read_int(group, f"{where}.group_size", low=-1)
    strategy = args.get("strategy")
    if strategy is not None and (not isinstance(strategy, str) or strategy.lower() not in STRATEGIES):
        raise bad_field(f"{where}.strategy", f"one of {list(STRATEGIES)}", strategy)
    strategy = strategy.lower() if strategy else ("tensor" if group is None else "group" if group > 0 else "channel"
                                                  if group == -1 else None)
    if strategy is None:
        raise bad_field(f"{where}.group_size", "a positive group size, or -1 (per channel)", group)
    dynamic = _ct_dynamic(args, where)
    if strategy == "token" and not dynamic:
        raise bad_field(f"{where}.strategy", "'token' only with dynamic: true (compressed-tensors: no static token "
                   "quantization)", strategy)
    if strategy in ("group", "tensor_group") and (group is None or group <= 0):
        raise bad_field(f"{where}.group_size", f"a positive integer with strategy {strategy}", group)
    if group is not None and group > 0 and strategy not in ("group", "tensor_group"):
        raise bad_field(f"{where}.strategy", "'group' (or 'tensor_group') when group_size is set", strategy)
    block = args.get("block_structure")
    if block is not None:
        if isinstance(block, str) and re.fullmatch(r"\d+x\d+", block):
            block = [int(x) for x in block.split("x")]
        if not isinstance(block, list) or len(block) != 2 or not all(
                isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in block):
            raise bad_field(f"{where}.block_structure", "a list of two positive integers [rows, cols]", block)
    if (strategy == "block") != (block is not None):
        raise bad_field(f"{where}.block_structure", "given exactly when strategy is 'block'", block)
    if dynamic and strategy not in ("token", "tensor", "tensor_group", "group"):
        raise bad_field(f"{where}.dynamic", f"false with strategy {strategy} (dynamic takes token, tensor, tensor_group or "
                   "group)", args.get("dynamic"))
    actorder = args.get("actorder")
    if actorder is not None and not (isinstance(actorder, bool) or isinstance(actorder, str)):
        raise bad_field(f"{where}.actorder", "null, false or an ordering name", actorder)
    if refuse_group_actorder and (actorder is True or isinstance(actorder, str) and actorder.lower() in ("group", "dynamic")):
        raise Refusal("Compressed-tensors group/dynamic activation ordering "
                       f"(actorder={'group' if actorder is True else actorder.lower()!r}) is no longer supported. Use a "
                       "checkpoint with static/weight activation ordering or without activation ordering.")
    scale = args.get("scale_dtype")
    scale = scale.lower().removeprefix("torch.") if isinstance(scale, str) else None
    return _CtArgs(bits, kind.lower(), symmetric, group, strategy, tuple(block) if block else None, dynamic,
                   actorder.lower() if isinstance(actorder, str) else None, scale)


@dataclass(frozen=True)
class CtScheme:
    weights: Optional[_CtArgs]
    input_activations: Optional[_CtArgs]
    format: Optional[str]


ACTIVATION_FORMATS = ("naive-quantized", "int-quantized", "float-quantized", "nvfp4-pack-quantized")


def _is_fp8_w8a8(w: _CtArgs, a: Optional[_CtArgs]) -> bool:
    if w is None or a is None or not (w.type == a.type == "float") or not w.symmetric or w.dynamic:
        return False
    if w.strategy not in ("tensor", "channel", "block"):
        return False
    return a.dynamic or (a.symmetric and a.strategy == "tensor")


def _ct_method(s: CtScheme, ctx: LayerContext) -> LayerQuant:
    """CompressedTensorsMoEMethod.get_moe_method's dispatch, in its order: the first scheme test that holds."""
    w, a = s.weights, s.input_activations
    mxfp4 = w.type == "float" and w.num_bits == 4 and w.strategy == "group" and w.group_size == 32 and w.symmetric
    if ctx.rules.ct_mxfp4_w4a8 and mxfp4 and a is not None and a.type == "float" and a.num_bits == 8 and not w.dynamic \
            and a.dynamic and a.strategy in ("token", "group") and a.symmetric:
        return not_modelled("compressed-tensors MXFP4 weights, dynamic FP8 activations: vLLM's "
                             "CompressedTensorsW4A8Mxfp4MoEMethod picks DeepSeek-V4's MXFP4 backend list, not modelled")
    if mxfp4:
        return not_modelled("compressed-tensors MXFP4: vLLM's CompressedTensorsW4A4Mxfp4MoEMethod picks its experts "
                             "outside the MXFP4 oracle (CUTLASS MXFP4 where compiled for the GPU, XPU, else Marlin); "
                             "moe-fsm has no policy for that choice")
    if w.type == "float" and w.num_bits == 8 and w.strategy == "group" and w.group_size == 32 and w.symmetric \
            and w.scale_dtype == "uint8":
        return Mapped(QuantScheme.mxfp8(), "compressed-tensors MXFP8", method="CompressedTensorsW8A8Mxfp8MoEMethod")
    if w.strategy in ("channel", "group") and a is None and not w.dynamic:
        if not (2 <= w.num_bits <= 8 and s.format == "pack-quantized"):
            return Refused("For Fused MoE layers, only format: pack-quantized and bits: [2, 3, 4, 5, 6, 7, 8] is "
                           f"supported but got format: pack-quantized and bits: {w.num_bits}")
        group = -1 if w.group_size is None else w.group_size
        if w.num_bits not in (4, 8):
            return not_modelled(f"compressed-tensors W{w.num_bits}A16: moe-fsm's WNA16 schemes are 4- or 8-bit")
        scheme = QuantScheme.int_wna16(w.num_bits, group, not w.symmetric, "compressed-tensors")
        # CompressedTensorsWNA16MoEMethod: off Marlin it asserts group scales ("channelwise is not supported")
        channel = w.strategy == "channel"
        return Mapped(scheme, f"compressed-tensors W{w.num_bits}A16 {w.strategy}"
                      + (f" {group}" if group > 0 else "") + ("" if w.symmetric else " asymmetric"),
                      method="CompressedTensorsWNA16MoEMethod",
                      only_backends=("MARLIN", "BATCHED_MARLIN") if channel else (),
                      only_reason="CompressedTensorsWNA16MoEMethod asserts group-wise weights on every backend but "
                                  "Marlin (channelwise is not supported by this kernel)" if channel else "")
    nvfp4 = lambda q: q is not None and q.strategy == "tensor_group" and q.type == "float" and q.num_bits == 4 \
        and q.group_size == 16 and q.symmetric  # noqa: E731
    if nvfp4(w):
        if not (a is None or nvfp4(a)):
            return Refused(f"For NVFP4 weights, input quantization must also be NVFP4 format or None for NVFP4A16, "
                           f"found {a.text()}")
        scheme = QuantScheme(QuantFamily.NVFP4, NVFP4_STATIC, None) if a is None else QuantScheme.nvfp4()
        return Mapped(scheme, f"compressed-tensors NVFP4 {'W4A16' if a is None else 'W4A4'}",
                      method="CompressedTensorsW4A4Nvfp4MoEMethod")
    if _is_fp8_w8a8(w, a):
        per_tensor = w.strategy == "tensor" and a.strategy == "tensor"
        per_channel = w.strategy == "channel" and a.strategy == "token"
        if not (per_tensor or per_channel or w.strategy == "block"):
            return Refused("CompressedTensorsW8A8Fp8MoEMethod asserts block weights when the scales are neither per "
                           f"tensor nor channel x token (got {w.strategy} weights, {a.strategy} activations)",
                           "AssertionError")
        if per_channel and not a.dynamic:
            return Refused("For FP8 Fused MoE layer, we require either per tensor or channelwise, dynamic per token "
                           "quantization.")
        if w.strategy == "block":  # kFp8Static128BlockSym whatever block_structure says, dynamic 1x128 activations
            scheme, text = QuantScheme.fp8("block", "group"), "128x128 blocks, dynamic 1x128 activations"
        elif per_channel:
            scheme, text = QuantScheme.fp8("channel", "token"), "channel weights, dynamic per-token activations"
        elif a.dynamic:  # vLLM's ct2vllm_act: a dynamic per-tensor activation is keyed kFp8Dynamic128Sym
            scheme, text = QuantScheme.fp8("tensor", "group"), "tensor weights, dynamic activations (keyed 1x128)"
        else:
            scheme, text = QuantScheme.fp8("tensor", "tensor", static_activation=True), "tensor weights, static activations"
        return Mapped(scheme, f"compressed-tensors FP8 {text}", allow_vllm_cutlass=True,
                      method="CompressedTensorsW8A8Fp8MoEMethod")
    if a is not None and w.num_bits == a.num_bits == 8 and w.strategy in ("tensor", "channel") and a.strategy == "token" \
            and w.symmetric and not w.dynamic and a.dynamic:
        if w.strategy != "channel":
            return Refused("For INT8 Fused MoE layers, we require channelwise, dynamic per token quantization. Found "
                           f"{w.text()}, {a.text()}")
        return Mapped(QuantScheme.int8("channel", "token"), "compressed-tensors INT8 W8A8 channel x dynamic token",
                      method="CompressedTensorsW8A8Int8MoEMethod")
    if a is not None and w.type == "int" and a.type == "float" and w.num_bits == 4 and a.num_bits == 8 \
            and w.strategy == "group" and a.strategy == "token" and w.symmetric and a.symmetric and not w.dynamic \
            and a.dynamic:
        if w.group_size != 128:
            return Refused("Only group size 128 supported for W4A8 MoE", "AssertionError")
        return Mapped(QuantScheme.w4a8(128), "compressed-tensors W4A8 (INT4 group 128, dynamic FP8 per token)",
                      method="CompressedTensorsW4A8Fp8MoEMethod")
    if a is not None and w.type == a.type == "int" and w.num_bits == 4 and a.num_bits == 8 \
            and w.strategy in ("group", "channel") and a.strategy == "token" and w.symmetric and not w.dynamic and a.dynamic:
        group = -1 if w.group_size is None else w.group_size
        ispp = ctx.intermediate_per_partition
        if group != -1 and (ctx.hidden_size % group or ispp % group):
            return Refused(f"Group size ({group}) must evenly divide both hidden size ({ctx.hidden_size}) and "
                           f"intermediate size per partition ({ispp}).")
        return Mapped(QuantScheme.w4a8_int8(group), f"compressed-tensors W4A8-INT8 group {group}",
                      method="CompressedTensorsW4A8Int8MoEMethod")
    return Refused(f"Unsupported FusedMoe scheme: {w.text()}, {a.text() if a else None}", "RuntimeError")


class CompressedTensorsReader(Reader):
    """CompressedTensorsConfig: the experts' unfused projections ``<experts>.0.<gate|up|down>`` matched against
    ``ignore`` and each target (exact, ``re:``, then the class ``RoutedExperts``, which a ``Linear`` target also
    names); all three must agree; the group's args pick the MoE method."""

    MIN_CAPABILITY = 70
    REFUSE_GROUP_ACTORDER = True  # vLLM refuses group / dynamic activation ordering when it reads the groups

    def __init__(self, config: dict, ctx: LayerContext, method: str) -> None:
        super().__init__(config, ctx, method)
        self.ignore = VllmRegex(read_names(config.get("ignore"), "ignore"), "ignore")
        groups = read_object(config.get("config_groups"), "config_groups", {})
        if len(groups) > MAX_GROUPS:
            raise InputError(f"quantization_config: config_groups holds {len(groups)} groups; moe-fsm takes at most "
                             f"{MAX_GROUPS} (published checkpoints have one to three)")
        fmt = config.get("format")
        self.targets: dict[str, CtScheme] = {}
        for name, group in groups.items():
            group = read_object(group, f"config_groups[{name!r}]")
            targets = read_names(group.get("targets"), f"config_groups[{name!r}].targets")
            if len(targets) == 1 and targets[0].endswith("Attention"):
                continue  # attention quantization goes with the KV cache in vLLM (skipped before its args are read)
            weights = _ct_args(read_object(group.get("weights"), f"config_groups[{name!r}].weights"),
                               f"config_groups[{name!r}].weights", self.REFUSE_GROUP_ACTORDER)
            inputs = _ct_args(group.get("input_activations"), f"config_groups[{name!r}].input_activations",
                              self.REFUSE_GROUP_ACTORDER)
            group_format = group.get("format")
            act_format = (group_format if group_format is not None else fmt) in ACTIVATION_FORMATS
            if act_format and inputs is None and weights.type != "float":
                # _quantization_scheme_map_from_config: an activation format without input_activations is W8A16 FP8
                raise Refusal("compressed-tensors asserts float weights for a group with an activation quantization "
                               f"format ({group_format if group_format is not None else fmt}) and no input_activations",
                               "AssertionError")
            for target in targets:
                self.targets[target] = CtScheme(weights, inputs if (act_format or inputs) else None,
                                                 group_format if group_format is not None else fmt)
        if "Linear" in self.targets and "RoutedExperts" not in self.targets:  # _add_fused_moe_to_target_scheme_map
            self.targets["RoutedExperts"] = self.targets["Linear"]
        self.matcher = VllmRegex(list(self.targets), "config_groups targets")
        capped(self.matcher.regexes + self.ignore.regexes, "config_groups and ignore", "regex")

    def _scheme(self, module: str) -> tuple[Optional[CtScheme], str]:
        hit = self.ignore.first(module)
        if hit:
            return None, f"ignored ({hit!r})"
        target = self.matcher.first(module) or self.matcher.first_containing("RoutedExperts")
        return (self.targets[target], target) if target is not None else (None, "")

    def projection_names(self) -> tuple[str, str, str]:
        """The unfused names matched: the model's own (0.32+), else gate/up/down_proj."""
        return self.ctx.projections if self.ctx.rules.ct_checkpoint_projection_names else DEFAULT_PROJECTIONS

    def method_of(self, scheme: CtScheme) -> LayerQuant:
        return _ct_method(scheme, self.ctx)

    def layer(self, experts: str) -> LayerQuant:
        found = [self._scheme(f"{experts}.0.{proj}") for proj in self.projection_names()]
        last = found[-1][0]
        if any(scheme != last for scheme, _ in found):
            return Refused("All MoE projections need to have same quantization scheme but found multiple")
        if last is None:
            why = found[0][1]
            return unquantized(f"compressed-tensors: {why}" if why else "compressed-tensors: no config group targets "
                                "the experts")
        mapped = self.method_of(last)
        if isinstance(mapped, Mapped):
            return replace(mapped, source=f"{mapped.source} (target {found[-1][1]!r})")
        return mapped
