"""The environment variables vLLM 0.33.0's MoE oracles and experts classes read (vllm/envs.py).

Parsed as vLLM parses them: the ``bool(int(...))`` variables refuse anything
that is not an integer (vLLM raises ValueError when it reads one; moe-fsm when
the decision starts), the AITER switches read true for ``1``/``true`` in any
case and false for anything else. 0.33 no longer reads VLLM_USE_FLASHINFER_MOE_FP16/
FP8/FP4, VLLM_FLASHINFER_MOE_BACKEND or VLLM_TEST_FORCE_FP8_MARLIN.
"""

from __future__ import annotations

from typing import Callable

from moe_fsm.errors import EnvVarError
from moe_fsm.inputs.env import EnvRegistry, EnvVar


def int_bool(name: str) -> Callable[[str], bool]:
    """vLLM's ``bool(int(os.getenv(name, default)))``."""

    def parse(raw: str) -> bool:
        try:
            return bool(int(raw))
        except ValueError:
            raise EnvVarError(name, raw, "an integer (0 is off, any other integer on)") from None

    return parse


def true_word(name: str) -> Callable[[str], bool]:
    """vLLM's ``os.getenv(name, default).lower() in ("true", "1")``: never an error."""

    def parse(raw: str) -> bool:
        return raw.lower() in ("true", "1")

    return parse


def lower_text(raw: str) -> str:
    """vLLM reads the string as it is and compares it lower-cased."""
    return raw.strip().lower()


INTEGER = "an integer (0 is off, any other integer on)"
TRUE_WORDS = "true or 1 (any case) is on, anything else off"

ENV = EnvRegistry.of(
    EnvVar("VLLM_BATCH_INVARIANT", False, int_bool("VLLM_BATCH_INVARIANT"), INTEGER,
           "Batch-invariant kernels only: every experts class without batch invariance is rejected."),
    EnvVar("VLLM_USE_DEEP_GEMM", True, int_bool("VLLM_USE_DEEP_GEMM"), INTEGER,
           "DeepGEMM globally; set, with VLLM_MOE_USE_DEEP_GEMM, it forces (1) or prunes (0) DeepGEMM for FP8 MoE."),
    EnvVar("VLLM_MOE_USE_DEEP_GEMM", True, int_bool("VLLM_MOE_USE_DEEP_GEMM"), INTEGER,
           "DeepGEMM for MoE only; 0 prunes it."),
    EnvVar("VLLM_ROCM_USE_AITER", False, true_word("VLLM_ROCM_USE_AITER"), TRUE_WORDS, "AITER master switch on ROCm."),
    EnvVar("VLLM_ROCM_USE_AITER_MOE", True, true_word("VLLM_ROCM_USE_AITER_MOE"), TRUE_WORDS,
           "AITER MoE switch on ROCm (needs VLLM_ROCM_USE_AITER too)."),
    EnvVar("VLLM_B12X_MOE_FP4_FORCE_A16", False, int_bool("VLLM_B12X_MOE_FP4_FORCE_A16"), INTEGER,
           "The b12x NVFP4 MoE runs W4A16 (explicit moe_backend='b12x' only)."),
    EnvVar("VLLM_HUMMING_MOE_GEMM_TYPE", None, lower_text, "indexed, grouped, grouped_contiguous, grouped_masked or auto",
           "Which Humming MoE GEMM (indexed / grouped); unset or auto: grouped with expert parallelism, else indexed."),
    EnvVar("VLLM_CPU_INT4_W4A8", True, int_bool("VLLM_CPU_INT4_W4A8"), INTEGER,
           "zentorch's DA8W4 INT4 MoE path for WNA16 checkpoints on CPU; 0 turns it off."),
    EnvVar("VLLM_USE_FLASHINFER_MOE_INT4", False, int_bool("VLLM_USE_FLASHINFER_MOE_INT4"), INTEGER,
           "FlashInfer's TRTLLM MXINT4 MoE for WNA16 (INT4 group-32) checkpoints on Blackwell."),
)
