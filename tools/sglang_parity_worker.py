"""SGLang 0.5.23's own answer for parity scenarios: one process per faked machine, run by tools/sglang_parity.py.

Runs inside an isolated venv with SGLang's source on the path (see docs/sglang-parity.md); never imports
moe-fsm. The machine is faked where SGLang probes it, before any SGLang module that binds a probe is
imported, so SGLang computes its own module constants (``_use_aiter``, ``ENABLE_JIT_DEEPGEMM``, ...) from it:
``sglang.srt.utils.common``'s ``is_cuda``, ``is_hip``, ``is_xpu``, ``is_cpu``, ``is_gfx95_supported``,
``get_device_sm``, ``get_device_capability``, ``cpu_has_amx_support``, ``is_flashinfer_available``,
``is_triton_kernels_available`` and ``get_nvidia_driver_version`` (an older driver than 595: moe-fsm's facts do
not record it), ``torch.version.cuda`` (12.9) and ``torch.cuda.get_device_capability``; importable kernel packages
(``deep_gemm``, ``flashinfer``, ``triton_kernels``) are stub modules when the machine has them, absent when not.
``torchvision`` is a stub too (only multimodal configs import it). Each scenario then sets its env, builds a
``ServerArgs`` through SGLang's own argparse, runs the MoE hooks of ``run_resolution_pipeline`` in its order on a
checkpoint config (architecture, quantization_config), and, for the layer, makes the quantization method SGLang's
config class makes, runs FusedMoE's two checks and ``create_moe_runner``, and reports ``get_moe_runner_backend``.

Protocol: argv[1] is the machine (JSON), argv[2] the file the answers go to (a JSON list, one per scenario of
the JSON list on stdin): SGLang logs to the standard streams.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.abc
import importlib.machinery
import json
import os
import sys
import tempfile
import types
import warnings
from pathlib import Path

MANAGED_ENV = ("SGLANG_ENABLE_JIT_DEEPGEMM", "SGLANG_USE_AITER", "SGLANG_INT4_WEIGHT",
               "SGLANG_FLASHINFER_CUTEDSL_NVFP4_W4A16", "SGLANG_FLASHINFER_NVFP4_PER_TOKEN_ACTIVATION",
               "SGLANG_USE_CPU_ENGINE")


# SGLang's compiled kernel package, present on every machine it runs on (sglang-kernel's CUDA, ROCm, CPU or XPU build)
KERNEL_PACKAGES = ["sgl_kernel"]


class _Stub(type):
    """What a stub module hands out: a class (so it can be a base class) that is also callable, subscriptable,
    iterable (empty) and false, whose attributes are more of the same."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        stub = _Stub(name, (), {})
        setattr(cls, name, stub)  # the same stub each time: code compares them by identity
        return stub

    def __call__(cls, *args, **kwargs):
        return cls

    def __getitem__(cls, key):
        return cls

    def __iter__(cls):
        return iter(())

    def __bool__(cls):
        return False


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        stub = _Stub(name, (), {})
        setattr(self, name, stub)
        return stub


class _Stubs(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Packages the faked machine has but this one need not: importable, every attribute a stub."""

    def __init__(self, names):
        self.names = tuple(names)

    def find_spec(self, fullname, path, target=None):
        if any(fullname == n or fullname.startswith(n + ".") for n in self.names):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def fake_machine(machine: dict) -> None:
    """Answer SGLang's probes from the machine's facts; must run before SGLang's modules import them."""
    import torch

    vendor, capability = machine["vendor"], machine.get("capability")
    libraries = set(machine.get("libraries", ()))
    stubs = ["torchvision"] + [name for name in ("deep_gemm", "flashinfer", "triton_kernels", "aiter")
                               if name in libraries]
    stubs += KERNEL_PACKAGES
    sys.meta_path.insert(0, _Stubs(stubs))
    # transformers asks the stub torchvision's version from its distribution metadata
    metadata = Path(tempfile.mkdtemp(prefix="sglang-parity-")) / "torchvision-0.28.0.dist-info"
    metadata.mkdir()
    (metadata / "METADATA").write_text("Metadata-Version: 2.1\nName: torchvision\nVersion: 0.28.0\n")
    sys.path.append(str(metadata.parent))
    if vendor == "cpu":
        os.environ["SGLANG_USE_CPU_ENGINE"] = "1"  # what --device cpu sets; is_cpu() reads it
    cuda = vendor == "cuda"
    gcn = machine.get("gcn_arch") or ""
    rocm_capability = (int(gcn[3]), int(gcn[4])) if vendor == "rocm" else None
    if cuda:
        torch.version.cuda = "12.9"
        torch.cuda.get_device_capability = lambda device=None: tuple(capability)
    if vendor == "rocm":  # what torch on ROCm reports: the gfx arch (and its capability form, gfx942 -> (9, 4))
        torch.cuda.get_device_capability = lambda device=None: rocm_capability
        torch.cuda.get_device_properties = lambda device=None: types.SimpleNamespace(
            gcnArchName=f"{gcn}:sramecc+:xnack-", name=machine.get("device_name", "AMD Instinct"),
            major=rocm_capability[0], minor=rocm_capability[1], total_memory=192 << 30, multi_processor_count=304)

    from sglang.srt import utils
    from sglang.srt.utils import common

    probes = {
        "is_cuda": lambda: cuda,
        "is_hip": lambda: vendor == "rocm",
        "is_xpu": lambda: vendor == "xpu",
        "is_cpu": lambda: vendor == "cpu",
        "is_gfx95_supported": lambda: vendor == "rocm" and gcn.startswith("gfx95"),
        "get_device_sm": lambda: capability[0] * 10 + capability[1] if cuda else 0,
        "get_device_capability": lambda device_id=0: (tuple(capability) if cuda else
                                                      rocm_capability if vendor == "rocm" else (None, None)),
        "cpu_has_amx_support": lambda: vendor == "cpu" and bool(machine.get("cpu_amx")),
        "is_flashinfer_available": lambda: cuda and "flashinfer" in libraries,
        "is_triton_kernels_available": lambda: "triton_kernels" in libraries,
        "get_nvidia_driver_version": lambda: (580,),
    }
    for name, probe in probes.items():
        setattr(common, name, probe)
        setattr(utils, name, probe)
    for name in ("is_sm100_supported", "is_sm90_supported", "is_sm120_supported", "is_sm110_supported",
                 "is_blackwell_supported", "is_sm100_or_sm110_supported", "is_hopper_with_cuda_12_3", "is_sm120",
                 "is_sm121"):
        getattr(common, name).cache_clear()


class _NoDispatcher:
    """FusedMoE makes its token dispatcher after the runner is chosen; it is communication (DeepEP buffers over a
    process group this process does not have), so the harness stands a do-nothing one in for it."""

    def __init__(self, *args, **kwargs):
        pass


def import_sglang():
    """SGLang's modules the answers come from (imported once the machine is faked)."""
    warnings.filterwarnings("ignore")
    mods = {}
    for name in ("sglang.srt.server_args", "sglang.srt.arg_groups.mega_moe_hook", "sglang.srt.arg_groups.model_hook",
                 "sglang.srt.arg_groups.moe_hook", "sglang.srt.arg_groups.overrides",
                 "sglang.srt.arg_groups.model_override_base", "sglang.srt.model_executor.cuda_graph_config",
                 "sglang.srt.runtime_context", "sglang.srt.layers.moe.utils", "sglang.srt.layers.moe.moe_runner",
                 "sglang.srt.layers.moe.fused_moe_triton.layer", "sglang.srt.layers.quantization.unquant",
                 "sglang.srt.layers.quantization.fp8", "sglang.srt.layers.quantization.modelopt_quant",
                 "sglang.srt.layers.quantization.mxfp4", "sglang.srt.layers.quantization.w4afp8",
                 "sglang.srt.layers.quantization.moe_wna16", "sglang.srt.layers.quantization.gptq",
                 "sglang.srt.layers.quantization.awq",
                 "sglang.srt.layers.quantization.compressed_tensors.compressed_tensors"):
        mods[name.rsplit(".", 1)[-1]] = __import__(name, fromlist=["_"])
    mods["layer"].create_moe_dispatcher = _NoDispatcher
    return types.SimpleNamespace(**mods)


def server_args(sg, scenario: dict):
    """SGLang's ServerArgs for the scenario's flags, through SGLang's own argparse (invalid choices exit)."""
    argv = ["--model-path", "fake-model", "--moe-runner-backend", scenario["backend"],
            "--moe-a2a-backend", scenario["parallel"].get("a2a_backend") or "none",
            "--tp-size", str(scenario["parallel"]["tp_size"]), "--ep-size", str(scenario["parallel"]["ep_size"]),
            "--attn-dp-size", str(scenario["parallel"]["dp_size"]),
            "--deepep-mode", scenario["parallel"].get("deepep_mode") or "auto"]
    if scenario["model"].get("quantization"):
        argv += ["--quantization", scenario["model"]["quantization"]]
    if scenario["model"].get("draft"):
        argv += ["--speculative-algorithm", "EAGLE"]
    if scenario["machine"]["vendor"] == "cpu":
        argv += ["--device", "cpu"]
    parser = argparse.ArgumentParser()
    sg.server_args.ServerArgs.add_cli_args(parser)
    args = parser.parse_args(argv)
    record = sg.server_args.ServerArgs.from_cli_args(args)
    # What earlier hooks of the pipeline resolve and the MoE hooks read: the CUDA-graph config, and chunked
    # prefill off (handle_gpu_memory_settings sizes it from GPU memory; off, the all-to-all token budgets, which
    # moe-fsm's profile assumes fit, are not checked)
    record._resolved_overrides = [("harness: earlier hooks",
                                   {"cuda_graph_config": sg.cuda_graph_config.default_cuda_graph_config(),
                                    "chunked_prefill_size": -1})]
    return record


def model_config(scenario: dict):
    """The checkpoint config the hooks read (model_config_of hands a fixture's config back as it is)."""
    from transformers import PretrainedConfig

    hf = PretrainedConfig(architectures=[scenario["model"].get("architecture") or NO_OVERRIDE_ARCH])
    quant = checkpoint_quantization_config(scenario)
    if quant is not None:
        hf.quantization_config = quant
    return types.SimpleNamespace(hf_config=hf, nvfp4_moe_meta=None, dtype=None, is_fp4_experts=False,
                                 hf_quant_config=quant or {}, decision_config=None, is_hybrid_swa=False,
                                 attention_arch=None)


def checkpoint_quantization_config(scenario: dict) -> dict | None:
    """config.json's quantization_config for the declared quant_method and the layer's scheme."""
    declared, facts = scenario["declared"], scenario["layer"]
    if declared is None:
        return None
    if declared == "compressed-tensors":
        return compressed_tensors_config(facts)
    if declared == "modelopt":
        return {"quant_method": "modelopt", "quant_algo": "NVFP4" if facts["family"] == "nvfp4" else "FP8"}
    if declared in ("gptq", "awq", "moe_wna16"):
        return {"quant_method": declared, "bits": facts["bits"], "group_size": facts["group_size"],
                "desc_act": facts["act_order"], "sym": not facts["zero_point"], "zero_point": facts["zero_point"]}
    if declared == "fp8" and facts.get("fp8_weight") == "block":
        return {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
    return {"quant_method": declared}


NO_OVERRIDE_ARCH = "MixtralForCausalLM"  # what an unknown architecture is read as: one no MoE override names


def resolve_server(sg, scenario: dict, record) -> None:
    """The MoE hooks of run_resolution_pipeline, in its order."""
    record._model_config = model_config(scenario)
    record._model_config_built_from = None
    record._quantization_explicitly_unset = False
    sg.mega_moe_hook.handle_mega_moe(record)
    sg.model_hook.handle_model_specific_adjustments(record)
    sg.moe_hook.handle_moe_kernel_config(record)
    sg.moe_hook.handle_a2a_moe(record)
    if scenario["model"].get("draft"):
        sg.overrides.run_post_process_pass(record, sg.overrides._speculative_moe_runner_default)
        sg.moe_hook.validate_deepep_v2_speculative_draft(record)


def fused_moe(sg, scenario: dict):
    """SGLang's own FusedMoE for the layer: its constructor makes the quantization method, checks it, creates the
    weights (small shapes, on this CPU) and calls create_moe_runner."""
    import torch

    facts = scenario["layer"]
    swiglu = facts["activation"] == "swigluoai" or facts.get("swiglu_limit") is not None
    return sg.layer.FusedMoE(
        num_experts=facts["num_experts"], hidden_size=facts["hidden_size"], intermediate_size=facts["intermediate_size"],
        layer_id=0, top_k=facts["top_k"], params_dtype=torch.bfloat16, quant_config=quant_config(sg, scenario),
        prefix="model.layers.0.mlp.experts", activation="silu", gemm1_alpha=1.702 if swiglu else None,
        gemm1_clamp_limit=facts.get("swiglu_limit"), with_bias=bool(facts.get("bias")))


def quant_config(sg, scenario: dict):
    """The quantization config SGLang builds for the layer's method (None: unquantized)."""
    layer_facts, method = scenario["layer"], scenario["method"]
    if method == "unquantized":
        return None
    if method in ("fp8", "mxfp8"):
        block = [1, 32] if method == "mxfp8" else ([128, 128] if layer_facts["fp8_weight"] == "block" else None)
        return sg.fp8.Fp8Config(is_checkpoint_fp8_serialized=True,
                                activation_scheme="static" if layer_facts.get("static_act") else "dynamic",
                                weight_block_size=block, use_mxfp8=method == "mxfp8")
    if method == "modelopt_fp4":
        return sg.modelopt_quant.ModelOptFp4Config.from_config(
            {"quant_method": "modelopt", "quantization": {"quant_algo": "NVFP4", "group_size": 16}})
    if method == "modelopt_fp8":
        return sg.modelopt_quant.ModelOptFp8Config.from_config(
            {"quant_method": "modelopt", "quantization": {"quant_algo": "FP8"}})
    if method == "mxfp4":
        return sg.mxfp4.Mxfp4Config.from_config({"quant_method": "mxfp4"})
    if method == "w4afp8":
        return sg.w4afp8.W4AFp8Config.from_config({"quant_method": "w4afp8", "weight_block_size": [128, 128]})
    if method == "moe_wna16":
        return sg.moe_wna16.MoeWNA16Config.from_config(
            {"quant_method": "gptq", "bits": layer_facts["bits"], "group_size": layer_facts["group_size"],
             "desc_act": layer_facts["act_order"], "sym": not layer_facts["zero_point"], "lm_head": False})
    if method == "gptq_marlin":
        return sg.gptq.GPTQMarlinConfig.from_config(
            {"quant_method": "gptq", "bits": layer_facts["bits"], "group_size": layer_facts["group_size"],
             "desc_act": layer_facts["act_order"], "sym": not layer_facts["zero_point"], "lm_head": False})
    if method == "awq_marlin":
        return sg.awq.AWQMarlinConfig.from_config(
            {"quant_method": "awq", "bits": layer_facts["bits"], "group_size": layer_facts["group_size"],
             "zero_point": layer_facts["zero_point"], "lm_head": False})
    if method == "compressed-tensors":
        return sg.compressed_tensors.CompressedTensorsConfig.from_config(compressed_tensors_config(layer_facts))
    raise NotImplementedError(f"the harness makes no {method} config")


def compressed_tensors_config(layer_facts: dict) -> dict:
    """A compressed-tensors config whose one group targets the experts' Linear layers."""
    family = layer_facts["family"]
    if family == "fp8":
        weight_strategy = {"block": "block", "channel": "channel", "tensor": "tensor"}[layer_facts["fp8_weight"]]
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": weight_strategy, "dynamic": False}
        if weight_strategy == "block":
            weights["block_structure"] = [128, 128]
        act_strategy = {"group": "group", "token": "token", "tensor": "tensor"}[layer_facts["fp8_act"]]
        acts = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": act_strategy,
                "dynamic": not layer_facts.get("static_act")}
        if act_strategy == "group":
            acts["group_size"] = 128
    elif family == "nvfp4":
        weights = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "group_size": 16,
                   "dynamic": False}
        acts = None if layer_facts.get("weight_only") else {
            "num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "group_size": 16,
            "dynamic": "local"}
    else:  # int_wna16
        group = layer_facts["group_size"]
        weights = {"num_bits": layer_facts["bits"], "type": "int", "symmetric": not layer_facts["zero_point"],
                   "strategy": "channel" if group == -1 else "group", "group_size": None if group == -1 else group,
                   "dynamic": False, "actorder": "group" if layer_facts["act_order"] else None}
        acts = None
    group = {"targets": ["Linear"], "weights": weights}
    if acts is not None:
        group["input_activations"] = acts
    fmt = "pack-quantized" if family == "int_wna16" else ("nvfp4-pack-quantized" if family == "nvfp4" else "float-quantized")
    return {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {"group_0": group},
            "ignore": ["lm_head"]}


RANK_ZERO = {"moe_ep_rank": 0, "moe_tp_rank": 0, "tp_group": 0}


def layer_answer(sg, scenario: dict, record) -> dict:
    """The layer's runner: published config, initialize_moe_config, then FusedMoE.__init__'s sequence for the
    layer (the quantization method, its two checks, create_weights, create_moe_runner), under the draft's scopes
    for a draft layer; the answer is the method's get_moe_runner_backend."""
    utils = sg.utils
    sg.runtime_context.get_context().set_server_args(record)
    parallel = sg.runtime_context.get_parallel()
    parallel.clear_stamp()
    parallel.override_permanently(**RANK_ZERO)  # this process is rank 0 of every group
    utils.initialize_moe_config()
    with contextlib.ExitStack() as scopes:
        if scenario["model"].get("draft"):
            scopes.enter_context(utils.draft_model_build_scope())
            scopes.enter_context(utils.speculative_moe_backend_context())
            scopes.enter_context(utils.speculative_moe_a2a_backend_context())
        runner, a2a = utils.get_moe_runner_backend(), utils.get_moe_a2a_backend()
        layer = fused_moe(sg, scenario)
        method, reported = layer.quant_method, layer.runner_backend
    view = sg.model_override_base.resolved_view(record)
    return {"ok": True, "method": type(method).__name__,
            "layer_runner": None if reported is None else reported.value,
            "moe_runner_backend": runner.value, "moe_a2a_backend": a2a.value, "ep_size": view.ep_size}


def answer(sg, scenario: dict) -> dict:
    for name in MANAGED_ENV:
        if name != "SGLANG_USE_CPU_ENGINE":
            os.environ.pop(name, None)
    os.environ.update(scenario["env"])
    stage = "argparse"
    try:
        record = server_args(sg, scenario)
        stage = "server"
        resolve_server(sg, scenario, record)
        stage = "layer"
        return layer_answer(sg, scenario, record)
    except SystemExit:
        return {"ok": False, "stage": stage, "error": "SystemExit", "message": "argparse refused the flags"}
    except Exception as err:  # SGLang's refusal, whatever its class (ValueError, AssertionError, ...)
        return {"ok": False, "stage": stage, "error": type(err).__name__, "message": str(err)[:500]}


def main() -> None:
    machine = json.loads(sys.argv[1])
    for name in MANAGED_ENV:  # the import-time env of this process is the machine's
        os.environ.pop(name, None)
    os.environ.update(machine.get("import_env", {}))
    fake_machine(machine)
    sg = import_sglang()
    scenarios = json.load(sys.stdin)
    answers = []
    for scenario in scenarios:
        scenario["machine"] = machine
        answers.append(answer(sg, scenario))
    with open(sys.argv[2], "w") as out:
        json.dump(answers, out)


if __name__ == "__main__":
    main()
