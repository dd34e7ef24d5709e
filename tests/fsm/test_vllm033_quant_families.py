"""vLLM 0.33's MX and integer families: the data the golden traces cannot show on their own."""

from __future__ import annotations

import dataclasses
import glob
from pathlib import Path

import pytest

from moe_fsm import profiles
from moe_fsm.cli import main as cli
from moe_fsm.decision import select
from moe_fsm.errors import BackendUnsupportedError, NoBackendError
from moe_fsm.fsm.candidate_steps import ExplicitAlternatives
from moe_fsm.fsm.policy import Reorder
from moe_fsm.inputs.layer import Activation, MoELayer
from moe_fsm.inputs.platform import preset
from moe_fsm.inputs.quant import QuantFamily, QuantScheme

PROFILE = profiles.get("vllm-0.33")
ROOT = Path(__file__).resolve().parents[2]
FAMILIES = ("mxfp4", "mxfp8", "int8", "int_wna16", "w4a8", "w4a8_int8")
GPT_OSS = MoELayer(quant=QuantScheme.mxfp4(), num_experts=32, top_k=4, hidden_size=2880, intermediate_size=2880,
                   activation=Activation.SWIGLUOAI, swiglu_limit=7.0, bias=True)


def test_every_name_priority_and_kernel_exists():
    for family in FAMILIES:
        policy = PROFILE.policy(QuantFamily(family))
        for spec in policy.backends.values():
            assert all(k in PROFILE.kernels for k in spec.kernels), spec
        for order in policy.priority.values():
            assert set(order) <= set(policy.backends), family
        assert set(policy.user_names.values()) <= set(policy.backends), family
        for step in policy.steps:
            if isinstance(step, ExplicitAlternatives):
                for names in step.alternatives.values():
                    assert set(names) <= set(policy.backends), family


def test_reorder_next_to_a_backend():
    rule = Reorder((), ("TRITON",), "after:BATCHED_MARLIN", "test")
    assert rule.apply(["A", "TRITON", "MARLIN", "BATCHED_MARLIN", "X"]) == ["A", "MARLIN", "BATCHED_MARLIN", "TRITON", "X"]
    assert rule.apply(["A", "TRITON"]) == ["A", "TRITON"]  # no anchor: unchanged


def test_mxfp4_variants_follow_the_checkpoint_activation():
    """The same name means the BF16 variant for gpt-oss and the MXFP8 one for an MXFP8-activation checkpoint."""
    sm100 = preset("sm100")
    bf16 = select(GPT_OSS, backend="flashinfer_trtllm", env={}, platform=sm100, policy="vllm-0.33")
    assert bf16.backend == "FLASHINFER_TRTLLM_MXFP4_BF16"
    mxfp8 = select(dataclasses.replace(GPT_OSS, quant=QuantScheme.mxfp4("mxfp8")), backend="flashinfer_trtllm",
                   env={}, platform=sm100, policy="vllm-0.33")
    assert mxfp8.backend == "FLASHINFER_TRTLLM_MXFP4_MXFP8"


def test_error_types_are_vllms():
    """MXFP8 raises ValueError when nothing fits; W4A8 raises NotImplementedError even for a named backend."""
    with pytest.raises(BackendUnsupportedError, match="No MXFP8 MoE backends available") as err:
        select(MoELayer(quant=QuantScheme.mxfp8(), num_experts=1024, top_k=8, hidden_size=4096, intermediate_size=1536),
               env={"VLLM_BATCH_INVARIANT": "1"}, platform=preset("sm90"), policy="vllm-0.33")
    assert isinstance(err.value, ValueError)
    with pytest.raises(NoBackendError) as err:
        select(MoELayer(quant=QuantScheme.w4a8(), hidden_size=4096, intermediate_size=1536), backend="cutlass", env={},
               platform=preset("sm100"), policy="vllm-0.33")
    assert isinstance(err.value, NotImplementedError)


@pytest.mark.parametrize("family", FAMILIES)
def test_explain_tells_every_golden_story(family, capsys):
    prefix = {"int_wna16": "wna16", "w4a8_int8": "w4a8i8"}.get(family, family)
    files = sorted(glob.glob(str(ROOT / "traces" / "vllm-0.33" / "golden" / f"{prefix}-*.json")))
    assert files
    for path in files[::4]:
        assert cli.main(["explain", path]) in (0, None), path
        assert capsys.readouterr().out
