"""vLLM 0.32.0: ``select_mxfp4_moe_backend``, as its differences from 0.33.0's.

* no ``AITER_TRITON_MXFP4_MXFP4`` backend (gfx1250's Triton W4A4; nor the name ``aiter_triton_mxfp4_mxfp4``);
* ``AITER_MXFP4_BF16`` / ``AITER_MXFP4_MXFP4`` run the single ``AiterExperts``;
* an explicit TRTLLM request with LoRA tries the backend's own classes only (0.33's ``_requested_kernel_cls``
  puts ``TrtLlmMxfp4LoRAExperts`` first and refuses the MXFP8 variant with LoRA);
* before the auto scan, ``_requires_qwen38_tep8_emulation``: Qwen3.8 Flash Next's routed experts (512 experts,
  hidden 2560, intermediate 640, MXFP4 activations) under eight-way expert parallelism on gfx950 run the
  OCP MX emulation (the native AITER W4A4 kernel is not numerically reliable for that shape).
"""

from __future__ import annotations

from dataclasses import replace

from moe_fsm.backends.requirements import Condition
from moe_fsm.fsm.policy import frozen
from moe_fsm.fsm.steps import Shortcut
from moe_fsm.inputs.platform import Vendor
from moe_fsm.inputs.quant import MXFP4_DYNAMIC
from moe_fsm.profiles.derive import derived_policy
from moe_fsm.profiles.vllm_0_33.mxfp4 import ALTERNATIVES as V033_ALTERNATIVES
from moe_fsm.profiles.vllm_0_33.mxfp4 import NO_LORA_WITH_MXFP8
from moe_fsm.profiles.vllm_0_33.mxfp4 import POLICY as V033

ALTERNATIVES = frozen({name: tuple(b for b in backends if b != "AITER_TRITON_MXFP4_MXFP4")
                       for name, backends in V033_ALTERNATIVES.items() if name != "aiter_triton_mxfp4_mxfp4"})

QWEN38_TEP8 = (
    Condition("MXFP4 activations", lambda ctx: ctx.layer.quant.activation == MXFP4_DYNAMIC,
              "the layer's activations are not MXFP4"),
    Condition("eight-way expert parallelism (64 local experts of 512)",
              lambda ctx: ctx.parallel.use_ep and ctx.parallel.tp_size * ctx.parallel.dp_size == 8
              and ctx.layer.num_experts == 512,
              "not 512 experts under eight-way expert parallelism"),
    Condition("Qwen3.8 Flash Next's routed-expert shape (hidden 2560, intermediate 640)",
              lambda ctx: (ctx.layer.hidden_size, ctx.layer.intermediate_size) == (2560, 640),
              "not the hidden 2560 / intermediate 640 shape"),
    Condition("ROCm gfx950", lambda ctx: ctx.platform.vendor is Vendor.ROCM and "gfx950" in (ctx.platform.gcn_arch or ""),
              "not a ROCm gfx950 device"),
)

_explicit = V033.step("explicit_user_choice")
POLICY = derived_policy(
    V033,
    drop_backends=("AITER_TRITON_MXFP4_MXFP4",),
    kernels_of={"AITER_MXFP4_BF16": ("AiterExperts",), "AITER_MXFP4_MXFP4": ("AiterExperts",),
                "FLASHINFER_TRTLLM_MXFP4_MXFP8": V033.backends["FLASHINFER_TRTLLM_MXFP4_MXFP8"].kernels},
    replace_steps={"explicit_user_choice": replace(_explicit, alternatives=ALTERNATIVES, lora_kernels=frozen({}))},
    insert_before={"auto_scan": (Shortcut("qwen38_tep8_emulation", when=QWEN38_TEP8, candidates=("EMULATION",)),)},
)
# The MXFP8 TRTLLM variant has no LoRA refusal of its own in 0.32 (its kernels' LoRA check answers).
POLICY = replace(POLICY, backends=frozen({
    name: (replace(spec, extra=tuple(r for r in spec.extra if r is not NO_LORA_WITH_MXFP8)) if r_has else spec)
    for name, spec in POLICY.backends.items() for r_has in [NO_LORA_WITH_MXFP8 in spec.extra]}))
