"""SGLang 0.5.23's W4AFP8 MoE method (INT4 weights, FP8 activations): ``W4AFp8MoEMethod``
(``layers/quantization/w4afp8.py``). ``create_moe_runner`` builds no runner whatever the server resolved:
``apply`` calls its CUTLASS kernel ``cutlass_w4a8_moe`` itself, and ``get_moe_runner_backend`` reports None.
"""

from __future__ import annotations

from moe_fsm.fsm.runner_steps import Rule
from moe_fsm.inputs.quant import QuantFamily
from moe_fsm.profiles.sglang_0_5_23.kernels import sglang_policy
from moe_fsm.profiles.sglang_0_5_23.layer import no_runner

W4AFP8_RULES = (Rule("W4AFp8MoEMethod calls cutlass_w4a8_moe itself, whatever the runner",
                     sets=no_runner("cutlass_w4a8")),)

POLICY = sglang_policy(QuantFamily.W4A8, "W4A8", {"w4afp8": W4AFP8_RULES}, ("cutlass_w4a8",))
