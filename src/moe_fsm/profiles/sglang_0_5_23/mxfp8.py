"""SGLang 0.5.23's MXFP8 MoE layers: ``Fp8MoEMethod`` with ``use_mxfp8`` (``--quantization mxfp8``), the same
runner choice as FP8 (``fp8.py``); the server's mxfp8 quantization constraint (``pipeline.py``) has already
narrowed the runner when ``--quantization mxfp8`` is given.
"""

from __future__ import annotations

from moe_fsm.inputs.quant import QuantFamily
from moe_fsm.profiles.sglang_0_5_23.fp8 import FP8_METHOD_RULES, RUNNERS
from moe_fsm.profiles.sglang_0_5_23.kernels import sglang_policy

# Fp8MoEMethod's runners, less FlashInfer CUTLASS (it runs MXFP8's experts on triton), plus FlashInfer MegaMOE
MXFP8_RUNNERS = (*(r for r in RUNNERS if r != "flashinfer_cutlass"), "flashinfer_megamoe")

POLICY = sglang_policy(QuantFamily.MXFP8, "MXFP8", {"mxfp8": FP8_METHOD_RULES, "fp8": FP8_METHOD_RULES},
                       MXFP8_RUNNERS)
