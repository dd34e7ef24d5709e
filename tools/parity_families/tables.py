"""How to ask vLLM 0.33's MX and integer oracles, built from moe-fsm's inputs the way vLLM's callers build it.

The arguments are written from the callers (quantization/mxfp4.py, quark, the
compressed-tensors MoE methods, auto_gptq.py, auto_awq.py, moe_wna16.py), not
from moe-fsm's keys, so the parity run also checks moe-fsm's key construction.
"""

from __future__ import annotations

from parity_table import FamilyTable

ORACLE = "vllm.model_executor.layers.fused_moe.oracle."


def _qu(vllm):
    return vllm.qu


def _activation_key(vllm, key):
    """The activation keys MXFP4's callers pass: none (BF16), kMxfp4Dynamic, kMxfp8Dynamic, FP8 group / tensor."""
    if key is None:
        return None
    qu = _qu(vllm)
    if key.dtype == "fp4_e2m1":
        return qu.kMxfp4Dynamic
    if key.granularity.value == "group1x32":
        return qu.kMxfp8Dynamic
    return {"group1x128": qu.kFp8Dynamic128Sym, "tensor": qu.kFp8StaticTensorSym}[key.granularity.value]


def _int8_keys(vllm, quant):
    qu = _qu(vllm)
    weight = {"channel": qu.kInt8StaticChannelSym, "tensor": qu.kInt8StaticTensorSym}[quant.weight.granularity.value]
    a = quant.activation
    table = {
        ("token", False, True): qu.kInt8DynamicTokenSym, ("token", False, False): qu.kInt8DynamicTokenAsym,
        ("tensor", False, True): qu.kInt8DynamicTensorSym, ("tensor", False, False): qu.kInt8DynamicTensorAsym,
        ("tensor", True, False): qu.kInt8StaticTensorAsym,
    }
    return weight, table[(a.granularity.value, a.static, a.symmetric)]


def _wna16_arguments(vllm, inputs, config):
    """select_wna16_moe_backend's arguments as each checkpoint format's MoE method builds them."""
    import torch
    from compressed_tensors.quantization import QuantizationArgs, QuantizationStrategy
    from vllm.model_executor.layers.quantization.auto_awq import AutoAWQConfig
    from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQConfig
    from vllm.model_executor.layers.quantization.moe_wna16 import MoeWNA16Config
    from vllm.scalar_type import scalar_types

    qu, quant = _qu(vllm), inputs.layer.quant
    bits, group, zp, ckpt = quant.weight_bits, quant.group_size, quant.zero_point, quant.checkpoint
    if ckpt == "gptq":
        config_obj = object.__new__(AutoGPTQConfig)
        config_obj.desc_act, config_obj.group_size, config_obj.is_sym = quant.act_order, group, not zp
        dtype, scale = (scalar_types.uint4b8, qu.kInt4StaticGroupScale) if bits == 4 else \
            (scalar_types.uint8b128, qu.kInt8StaticGroupScale)
        weight = qu.QuantKey(dtype, scale)
        return weight, config_obj, zp, True, True
    if ckpt == "awq":
        config_obj = object.__new__(AutoAWQConfig)
        config_obj.group_size, config_obj.zero_point, config_obj.weight_bits = group, zp, 4
        return qu.kInt4Static, config_obj, zp, True, True
    if ckpt == "compressed-tensors":
        # model_construct: the compressed-tensors installed here may refuse actorder="group", which the version
        # vLLM 0.33 pins reads (and vLLM's oracle compares with); the values are as a checkpoint's config gives them.
        args = QuantizationArgs.model_construct(
            num_bits=bits, type="int", symmetric=not zp, group_size=group if group > 0 else None,
            strategy=QuantizationStrategy.GROUP if group > 0 else QuantizationStrategy.CHANNEL,
            actorder="group" if quant.act_order else None)
        sym = {4: scalar_types.uint4b8, 8: scalar_types.uint8b128}
        asym = {4: scalar_types.uint4, 8: scalar_types.uint8}
        dtype = (sym if not zp else asym)[bits]
        if bits == 4:
            scale = qu.kInt4Static32GroupScale if group == 32 else qu.kInt4StaticGroupScale
        else:
            scale = qu.kInt8StaticGroupScale
        return qu.QuantKey(dtype, scale, symmetric=not zp), args, zp, False, True
    config_obj = object.__new__(MoeWNA16Config)  # moe_wna16
    config_obj.group_size, config_obj.has_zp, config_obj.weight_bits = group, zp, bits
    if bits == 4:
        weight = qu.QuantKey(qu.INT4_DTYPE, qu.kInt4Static32GroupScale if group == 32 else qu.kInt4StaticGroupScale)
    else:
        weight = qu.QuantKey(qu.INT8_DTYPE, qu.kInt8StaticGroupScale)
    del torch
    return weight, config_obj, zp, False, False


def _w4a8_int8_arguments(vllm, inputs, config):
    """compressed_tensors_moe_w4a8_int8: QuantKey(int8, ScaleDesc(fp32 per channel | bf16 GroupShape(1, G)))."""
    import torch

    qu, group = _qu(vllm), inputs.layer.quant.group_size
    if group == -1:
        scale = qu.ScaleDesc(torch.float32, True, qu.GroupShape(-1, 1))
    else:
        scale = qu.ScaleDesc(torch.bfloat16, True, qu.GroupShape(1, group))
    return qu.QuantKey(torch.int8, scale, symmetric=True), None


def _result(value) -> tuple[str, str | None]:
    backend, cls = value
    if cls is None:
        return backend.name, None
    name = cls.__name__
    if name == "CPUExpertsInt4":  # two vLLM classes share the name; moe-fsm qualifies them by module
        name = f"{cls.__module__.rsplit('.', 1)[-1]}.{name}"
    return backend.name, name


def tables() -> list[FamilyTable]:
    return [
        FamilyTable("mxfp4", ORACLE + "mxfp4", "select_mxfp4_moe_backend",
                    lambda vllm, inputs, config: (_activation_key(vllm, inputs.layer.quant.activation),), _result),
        FamilyTable("mxfp8", ORACLE + "mxfp8", "select_mxfp8_moe_backend", lambda vllm, inputs, config: (), _result),
        FamilyTable("int8", ORACLE + "int8", "select_int8_moe_backend",
                    lambda vllm, inputs, config: _int8_keys(vllm, inputs.layer.quant), _result),
        FamilyTable("int_wna16", ORACLE + "int_wna16", "select_wna16_moe_backend", _wna16_arguments, _result),
        FamilyTable("w4a8", ORACLE + "w4a8", "select_w4a8_moe_backend", lambda vllm, inputs, config: (), _result),
        FamilyTable("w4a8_int8", ORACLE + "w4a8_int8", "select_w4a8_int8_moe_backend", _w4a8_int8_arguments, _result),
    ]
