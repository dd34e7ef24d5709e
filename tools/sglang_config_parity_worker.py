"""SGLang 0.5.23's own reading of checkpoint configs, for tools/sglang_config_parity.py: one process per faked machine.

Runs inside the isolated venv of tools/sglang_parity.py (docs/sglang-parity.md), never imports moe-fsm, and fakes
the machine the same way (``sglang_parity_worker.fake_machine``). For each checkpoint directory it runs SGLang's own
config path: ``ModelConfig._verify_quantization`` (``_parse_quant_hf_config``, the override classes, the registry and
ROCm checks) on an object holding the directory's config.json, ``get_quantization_config`` (the AMX CPU list),
``model_loader.weight_utils.get_quant_config`` (the config class's ``from_config`` on the files there), the minimum
capability check of ``model_loader/loader.py`` (the harness repeats its three lines: it sits inside
``_get_quantization_config``, which needs a whole model class), then the class's ``get_quant_method`` for each MoE
layer's module name on a ``FusedMoE`` that holds only the facts the methods read (sizes, activation, router weight on
the input). The answer per layer is the method's class name and, where it delegates to one (compressed-tensors,
Quark), its scheme's (None: SGLang builds ``UnquantizedFusedMoEMethod``), or the stage and message of SGLang's refusal.

Protocol: argv[1] is the machine (JSON), argv[2] the answers' file; stdin a JSON list of
{"dir", "layers": [module names], "hidden_size", "intermediate_size", "tp_size", "router_weight_on_input"}.
"""

from __future__ import annotations

import json
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sglang_parity_worker import MANAGED_ENV, RANK_ZERO, fake_machine, import_sglang, server_args  # noqa: E402


def _model_config(mc, directory: str):
    """SGLang's ModelConfig holding only what _verify_quantization reads (its __init__ loads a whole model)."""
    from transformers import PretrainedConfig

    with open(os.path.join(directory, "config.json")) as f:
        raw = json.load(f)
    obj = mc.ModelConfig.__new__(mc.ModelConfig)
    obj.hf_config = PretrainedConfig(**raw)
    obj.model_path = directory
    obj.revision = None
    obj.quantization = None
    obj.is_draft_model = False
    obj.is_draft_quantization_explicit = False
    obj.dtype = None
    return obj


def _layer(FusedMoE, job: dict):
    """A FusedMoE with the facts get_quant_method and the methods' constructors read, and no weights."""
    import torch

    layer = FusedMoE.__new__(FusedMoE)
    torch.nn.Module.__init__(layer)
    layer.hidden_size = job["hidden_size"]
    layer.intermediate_size_per_partition = job["intermediate_size"] // job["tp_size"]
    layer.moe_runner_config = types.SimpleNamespace(apply_router_weight_on_input=job["router_weight_on_input"],
                                                    is_gated=True, activation="silu")
    layer.use_triton_kernels = layer.use_flashinfer_trtllm_moe = layer.use_deep_gemm = False
    layer.moe_tp_size = job["tp_size"]
    return layer


def read(sg, job: dict) -> dict:
    from sglang.srt.configs import model_config as mc
    from sglang.srt.layers.quantization import get_quantization_config
    from sglang.srt.model_loader.weight_utils import get_quant_config
    from sglang.srt.utils import get_device_capability

    stage = "verify_quantization"
    try:
        model = _model_config(mc, job["dir"])
        model._verify_quantization()
        if model.quantization is None:
            return {"ok": True, "quantization": None, "layers": [None] * len(job["layers"])}
        stage = "get_quantization_config"
        get_quantization_config(model.quantization)
        stage = "get_quant_config"
        config = get_quant_config(model, types.SimpleNamespace(download_dir=None, model_loader_extra_config={}), {})
        stage = "min_capability"
        major, minor = get_device_capability()
        if major is not None and minor is not None and major * 10 + minor < config.get_min_capability():
            raise ValueError(f"The quantization method {model.quantization} is not supported for the current GPU. "
                             f"Minimum capability: {config.get_min_capability()}. Current capability: "
                             f"{major * 10 + minor}.")
    except Exception as err:
        return {"ok": False, "stage": stage, "error": type(err).__name__, "message": str(err)[:400]}
    layers = []
    for prefix in job["layers"]:
        try:
            layer = _layer(sg.layer.FusedMoE, job)
            method = config.get_quant_method(layer, prefix)
            scheme = getattr(layer, "scheme", None)  # compressed-tensors' and Quark's methods delegate to a scheme
            layers.append(None if method is None else
                          [type(method).__name__] + ([type(scheme).__name__] if scheme is not None else []))
        except Exception as err:
            layers.append({"error": type(err).__name__, "message": str(err)[:400]})
    return {"ok": True, "quantization": model.quantization, "layers": layers}


def main() -> None:
    machine = json.loads(sys.argv[1])
    for name in MANAGED_ENV:
        os.environ.pop(name, None)
    fake_machine(machine)
    sg = import_sglang()
    # the methods' constructors read the resolved MoE runner: a default server (auto runner, no all-to-all)
    scenario = {"backend": "auto", "parallel": {"tp_size": 1, "ep_size": 1, "dp_size": 1}, "model": {},
                "machine": machine}
    record = server_args(sg, scenario)
    sg.runtime_context.get_context().set_server_args(record)
    parallel = sg.runtime_context.get_parallel()
    parallel.clear_stamp()
    parallel.override_permanently(**RANK_ZERO)
    sg.utils.initialize_moe_config()
    answers = [read(sg, job) for job in json.load(sys.stdin)]
    with open(sys.argv[2], "w") as out:
        json.dump(answers, out)


if __name__ == "__main__":
    main()
