"""Built-in model presets: real MoE architectures at reduced size, no downloads.

Each preset keeps the real model's expert count, top-k, layer count and the
ratio of hidden to intermediate size, and divides both sizes by ``shrink`` so a
2-core CPU runs every layer in seconds. Quantization per layer is as the real
checkpoints ship it, including the mixed NVFP4+FP8 checkpoint of vLLM PR #43334.
Each layer carries its checkpoint's architecture and declared quant method
(``MoELayer.model``), which SGLang's model overrides read; vLLM's profiles do not.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_fsm.errors import InputError
from moe_fsm.inputs.layer import MoELayer
from moe_fsm.inputs.model_facts import ModelFacts
from moe_fsm.inputs.quant import QuantScheme
from moe_fsm.plan.decider import LayerSpec


@dataclass(frozen=True)
class ModelPreset:
    """``policy`` is the profile that decides when the caller names none: a preset whose family only a
    newer profile models (MXFP4, GPTQ) would otherwise fail under the default ``seeds``."""

    name: str
    like: str
    shrink: int
    layers: tuple[LayerSpec, ...]
    policy: str | None = None

    def describe(self) -> str:
        first = self.layers[0].layer
        families = sorted({spec.layer.family.value for spec in self.layers})
        return (
            f"{self.name} ({self.like}-like, sizes / {self.shrink}): {len(self.layers)} MoE layers, "
            f"E={first.num_experts} top-{first.top_k}, K={first.hidden_size} N={first.intermediate_size}, "
            f"{'+'.join(families)}"
        )


def _uniform(name: str, like: str, shrink: int, count: int, first_index: int, layer: MoELayer,
             policy: str | None = None) -> ModelPreset:
    specs = tuple(LayerSpec(f"model.layers.{first_index + i}.mlp.experts", layer) for i in range(count))
    return ModelPreset(name, like, shrink, specs, policy)


def _mixed_nvfp4_fp8() -> ModelPreset:
    """Qwen3.6-35B-A3B-like modelopt checkpoint: NVFP4 experts, every fourth layer FP8 per-tensor."""
    shape = dict(num_experts=256, top_k=8, hidden_size=256, intermediate_size=64,
                 model=ModelFacts(architecture="Qwen3_5MoeForConditionalGeneration", quant_method="modelopt"))
    nvfp4 = MoELayer(quant=QuantScheme.nvfp4(), **shape)
    fp8 = MoELayer(quant=QuantScheme.fp8("tensor", "tensor", static_activation=True), **shape)
    specs = tuple(
        LayerSpec(f"model.layers.{i}.mlp.experts", fp8 if i % 4 == 3 else nvfp4) for i in range(40)
    )
    return ModelPreset("mixed-nvfp4-fp8", "Qwen3.6-35B-A3B (modelopt NVFP4 + FP8)", 8, specs)


def _gpt_oss_20b() -> ModelPreset:
    """gpt-oss-20b: MXFP4 experts with biases, SwiGLU-OAI clamped at 7. 2880 / 9 = 320 keeps the MX blocks of 32 whole."""
    layer = MoELayer(quant=QuantScheme.mxfp4(), num_experts=32, top_k=4, hidden_size=320, intermediate_size=320,
                     activation="swigluoai", swiglu_limit=7.0, bias=True,
                     model=ModelFacts(architecture="GptOssForCausalLM", quant_method="mxfp4"))
    return _uniform("gpt-oss-20b", "gpt-oss-20b (MXFP4)", 9, 24, 0, layer, policy="vllm-0.33")


def _qwen3_gptq_int4() -> ModelPreset:
    """Qwen3-30B-A3B-GPTQ-Int4: symmetric INT4 weights, 16-bit activations.

    The checkpoint's groups of 128 do not divide the shrunken intermediate size
    (768 / 8 = 96), so the preset keeps the group count per hidden row close
    instead: groups of 32.
    """
    layer = MoELayer(quant=QuantScheme.int_wna16(4, 32, checkpoint="gptq"), num_experts=128, top_k=8,
                     hidden_size=256, intermediate_size=96,
                     model=ModelFacts(architecture="Qwen3MoeForCausalLM", quant_method="gptq"))
    return _uniform("qwen3-30b-a3b-gptq-int4", "Qwen3-30B-A3B-GPTQ-Int4", 8, 48, 0, layer, policy="vllm-0.33")


PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        _uniform("qwen3-30b-a3b", "Qwen3-30B-A3B", 8, 48, 0,
                 MoELayer(num_experts=128, top_k=8, hidden_size=256, intermediate_size=96,
                          model=ModelFacts(architecture="Qwen3MoeForCausalLM"))),
        _uniform("mixtral-8x7b", "Mixtral-8x7B", 8, 32, 0,
                 MoELayer(num_experts=8, top_k=2, hidden_size=512, intermediate_size=1792,
                          model=ModelFacts(architecture="MixtralForCausalLM"))),
        _uniform("deepseek-v3", "DeepSeek-V3 (block FP8)", 8, 58, 3,
                 MoELayer(quant=QuantScheme.fp8("block", "group"), num_experts=256, top_k=8,
                          hidden_size=896, intermediate_size=256,
                          model=ModelFacts(architecture="DeepseekV3ForCausalLM", quant_method="fp8"))),
        _mixed_nvfp4_fp8(),
        _gpt_oss_20b(),
        _qwen3_gptq_int4(),
    )
}
DEFAULT_PRESET = "qwen3-30b-a3b"


def preset(name: str) -> ModelPreset:
    try:
        return PRESETS[name]
    except KeyError:
        raise InputError(f"model preset {name!r} is not one of {sorted(PRESETS)}") from None
