"""SGLang 0.5.23's INT4/INT8 weight-only MoE methods (16-bit activations) and their runner choice.

- ``compressed-tensors`` (``CompressedTensorsConfig.get_moe_scheme``): INT4 groups of 32, symmetric, with the
  flashinfer_trtllm runner -> the MXINT4 TRT-LLM scheme (reports flashinfer_trtllm, calls its kernel itself);
  on ROCm the Triton WNA16 scheme; an explicit triton needs 4-bit symmetric groups of 32 or 128 without
  activation order and takes the Triton scheme, as auto does on SM100 for such weights; anything else the
  Marlin scheme.
- ``moe_wna16`` (``MoeWNA16Method``): the Triton runner.
- ``gptq_marlin`` / ``awq_marlin`` (what SGLang serves GPTQ and AWQ checkpoints with on CUDA): asserts the
  runner is auto, then Marlin. Their CPU and NPU schemes are not modelled.
"""

from __future__ import annotations

from moe_fsm.backends.requirements import Condition
from moe_fsm.errors import NoBackendError
from moe_fsm.fsm.runner_steps import First, Rule, is_, is_not
from moe_fsm.inputs.quant import QuantFamily
from moe_fsm.profiles.sglang_0_5_23.facts import CUDA, HIP, SM100, WNA16_TRITON_OK, negated
from moe_fsm.profiles.sglang_0_5_23.kernels import sglang_policy
from moe_fsm.profiles.sglang_0_5_23.layer import RUNNER, direct, runner_at

MXINT4 = Condition("INT4 weights, symmetric, in groups of 32 (_is_mxint4a16)",
                   lambda ctx: ctx.layer.quant.weight_bits == 4 and ctx.layer.quant.group_size == 32
                   and not ctx.layer.quant.zero_point,
                   "not symmetric INT4 weights in groups of 32")

COMPRESSED_TENSORS_RULES = (
    First((
        Rule("MXINT4 weights with flashinfer_trtllm -> CompressedTensorsMxInt4MoE (reports flashinfer_trtllm)",
             when=(MXINT4, is_(RUNNER, "flashinfer_trtllm", "experimental_sgl_trtllm")),
             sets=direct("flashinfer_trtllm")),
        Rule("ROCm -> CompressedTensorsWNA16TritonMoE", when=(HIP,), sets=runner_at("triton")),
        Rule("an explicit triton needs weights the Triton WNA16 MoE supports",
             when=(is_(RUNNER, "triton"), negated(WNA16_TRITON_OK)),
             fail="The Triton WNA16 MoE backend only supports symmetric INT4 group quantization with group_size=32 "
                  "or 128 and no actorder."),
        Rule("an explicit triton -> CompressedTensorsWNA16TritonMoE", when=(is_(RUNNER, "triton"),),
             sets=runner_at("triton")),
        Rule("auto on SM100 with weights the Triton WNA16 MoE supports -> CompressedTensorsWNA16TritonMoE",
             when=(is_(RUNNER, "auto"), SM100, WNA16_TRITON_OK), sets=runner_at("triton")),
        Rule("otherwise -> CompressedTensorsWNA16MoE (Marlin)", sets=runner_at("marlin")),
    )),
)

MOE_WNA16_RULES = (Rule("MoeWNA16Method builds the Triton runner", sets=runner_at("triton")),)


def _marlin_rules(method: str) -> tuple:
    return (
        Rule(f"{method}: moe-fsm models its CUDA scheme only", when=(negated(CUDA),),
             fail=f"moe-fsm's sglang-0.5.23 profile models {method} MoE on CUDA only", error=NoBackendError),
        Rule(f"{method}: create_moe_runner asserts the runner is auto", when=(is_not(RUNNER, "auto"),),
             fail=f"{method} MoE asserts --moe-runner-backend auto, got {{moe_runner_backend}}"),
        Rule(f"{method} -> MARLIN", sets=runner_at("marlin")),
    )


RUNNERS = ("triton", "marlin", "flashinfer_trtllm")

POLICY = sglang_policy(QuantFamily.INT_WNA16, "INT WNA16", {
    "compressed-tensors": COMPRESSED_TENSORS_RULES, "moe_wna16": MOE_WNA16_RULES,
    "gptq_marlin": _marlin_rules("gptq_marlin"), "awq_marlin": _marlin_rules("awq_marlin"),
}, RUNNERS)
