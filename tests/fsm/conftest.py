import pytest

from moe_fsm.decision import select
from moe_fsm.inputs.layer import MoELayer
from moe_fsm.inputs.parallel import ParallelConfig
from moe_fsm.inputs.platform import preset
from moe_fsm.inputs.quant import QuantScheme

SCHEMES = {
    "bf16": QuantScheme.unquantized(),
    "fp8_block": QuantScheme.fp8("block", "group"),
    "fp8_tensor": QuantScheme.fp8("tensor", "tensor", static_activation=True),
    "fp8_tensor_dyn": QuantScheme.fp8("tensor", "tensor"),
    "fp8_channel": QuantScheme.fp8("channel", "token"),
    "nvfp4": QuantScheme.nvfp4(),
}


@pytest.fixture
def pick():
    """pick(scheme, platform, env={}, backend='auto', parallel=None, **layer_fields) -> Decision."""

    def _pick(scheme, platform, env=None, backend="auto", parallel=None, **layer_fields):
        layer = MoELayer(quant=SCHEMES[scheme], **layer_fields)
        return select(layer, parallel or ParallelConfig(), backend, env or {}, preset(platform))

    return _pick
