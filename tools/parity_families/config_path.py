"""Parity on the config path: vLLM's own reading of a checkpoint's quantization config, then its oracle, against
``moe-fsm plan``.

For every checkpoint config of tests/data/configs/ and generated variants of its quantization config, on a set
of platforms and parallel layouts, vLLM's side runs what vLLM runs when it loads the checkpoint, with only the
machine faked (``Faked``): ``_normalize_quantization_config`` (model_arch_config_convertor.py), the override
loop of ``ModelConfig._verify_quantization`` (a bare ModelConfig holding the config, the model type and no
``--quantization``), ``get_quantization_config(name).from_config`` (with ModelOpt's ``_online_quantization_args``
as ``get_quant_config`` adds it), the minimum-capability check of ``VllmConfig._get_quantization_config``, then
``resolve_quant_method(quant_config, layer, prefix)`` for a ``RoutedExperts`` layer (a bare one holding vLLM's
``FusedMoEConfig`` of the model and its checkpoint projection names), whose method class picks its backend in its
constructor (``UnquantizedFusedMoEMethod`` for ``None``). moe-fsm's side is ``plan_model`` on the same config.
Compared per layer: the outcome, vLLM's MoE method class, the backend, the experts class, and for failures the
exception type and whether it came from an oracle (a ``fused_moe/oracle/`` or ``experts/`` frame) or from the
config path (moe-fsm's REFUSED rows).

What the model code would give vLLM is taken from moe-fsm's model config reading (the experts' module names,
shapes, activation, expert biases, checkpoint projection names): both sides see the same model. The current
vLLM config carries the model type (``hf_config`` / ``hf_text_config``: Quark and FP8's per-model DeepGEMM rule
read it) and no user quantization override.
"""

from __future__ import annotations

import copy
import json
import random
import tempfile
import traceback
from pathlib import Path
from types import SimpleNamespace

CONFIGS = Path(__file__).resolve().parents[2] / "tests" / "data" / "configs"
PLATFORMS = ("sm80", "sm89", "sm90", "sm100", "sm120", "rocm-mi300", "rocm-mi355", "xpu", "cpu-x86-amx", "cpu-arm")
VARIANT_PLATFORMS = ("sm80", "sm90", "sm100", "rocm-mi355", "xpu", "cpu-x86-amx")
PARALLEL = ({}, {"tp_size": 2}, {"tp_size": 4}, {"tp_size": 8}, {"tp_size": 4, "ep_size": 4})
DEBUG = False  # print vLLM's tracebacks (a maintainer looking into a disagreement)
ERRORS = {"BackendUnsupportedError": "ValueError", "NoBackendError": "NotImplementedError"}


# -- scenarios ---------------------------------------------------------------------------------------------------------


def _fixture(name: str) -> dict:
    """A fixture's config.json, with hf_quant_config.json folded in as its quantization_config (vLLM's own order)."""
    config = json.loads((CONFIGS / name / "config.json").read_text())
    beside = CONFIGS / name / "hf_quant_config.json"
    if "quantization_config" not in config and beside.is_file():
        config["quantization_config"] = json.loads(beside.read_text())
    return config


def _quant(config: dict) -> dict | None:
    return config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")


def _with_quant(config: dict, quant) -> dict:
    config = copy.deepcopy(config)
    if "text_config" in config and "quantization_config" not in config:
        config["text_config"]["quantization_config"] = quant
    else:
        config["quantization_config"] = quant
    if quant is None:
        config.pop("quantization_config", None)
    return config


def _ct(weights: dict, inputs: dict | None = None, fmt: str = "pack-quantized", **extra) -> dict:
    group = {"targets": ["Linear"], "weights": weights, "input_activations": inputs}
    return {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {"group_0": group}, **extra}


INT = {"type": "int", "strategy": "group", "symmetric": True, "dynamic": False}
FP8 = {"type": "float", "num_bits": 8, "symmetric": True, "dynamic": False}
TOKEN = {"type": "float", "num_bits": 8, "strategy": "token", "dynamic": True, "symmetric": True}
NV = {"type": "float", "num_bits": 4, "strategy": "tensor_group", "group_size": 16, "symmetric": True}
MX4 = {"dtype": "fp4", "qscheme": "per_group", "group_size": 32, "scale_format": "e8m0", "is_dynamic": False}
Q_FP8 = {"dtype": "fp8_e4m3", "qscheme": "per_tensor", "is_dynamic": False, "symmetric": True}


def _variants(quant: dict | None, model_type: str) -> list[tuple[str, object]]:
    """Variants of one fixture's quantization config: the checkpoint facts vLLM's config path reads, one at a time."""
    method = (quant or {}).get("quant_method")
    out: list[tuple[str, object]] = []
    if method == "gptq":
        for group in (-1, 32, 64, 256):
            out.append((f"group{group}", {**quant, "group_size": group}))
        out += [("desc_act", {**quant, "desc_act": True}), ("desc_act-channel", {**quant, "desc_act": True, "group_size": -1}),
                ("asym", {**quant, "sym": False}), ("bits8", {**quant, "bits": 8}), ("bits3", {**quant, "bits": 3}),
                ("no-sym", {k: v for k, v in quant.items() if k != "sym"}),
                ("dynamic-skip", {**quant, "dynamic": {r"-:.*layers\.[0-9]\..*experts": {}}}),
                ("dynamic-bits8", {**quant, "dynamic": {r"+:.*experts": {"bits": 8, "group_size": 64}}}),
                ("dynamic-act-order", {**quant, "dynamic": {r".*": {"desc_act": True}}}),
                ("upper-case", {**quant, "quant_method": "GPTQ"}), ("gptq_marlin", {**quant, "quant_method": "gptq_marlin"})]
    elif method == "awq":
        out += [("group64", {**quant, "group_size": 64}), ("group256", {**quant, "group_size": 256}),
                ("no-zero-point", {**quant, "zero_point": False}), ("bits8", {**quant, "bits": 8}),
                ("not-convert-experts", {**quant, "modules_to_not_convert": ["experts"]}),
                ("w_bit", {"quant_method": "awq", "w_bit": 4, "q_group_size": 128, "zero_point": True}),
                ("awq_marlin", {**quant, "quant_method": "awq_marlin"})]
    elif method == "fp8":
        base = {k: v for k, v in quant.items() if k != "weight_block_size"}
        out += [("tensor-dynamic", base), ("tensor-static", {**base, "activation_scheme": "static"}),
                ("block64", {**quant, "weight_block_size": [64, 64]}),
                ("block-static", {**quant, "weight_block_size": [128, 128], "activation_scheme": "static"}),
                ("block3d", {**quant, "weight_block_size": [1, 128, 128]}),
                ("store-mxfp4", {**quant, "store_dtype": "mxfp4"}), ("fbgemm", {**quant, "quant_method": "fbgemm_fp8"})]
    elif method == "modelopt" or "producer" in (quant or {}):
        body = quant.get("quantization") if isinstance(quant.get("quantization"), dict) else None
        for algo in ("FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO", "NVFP4", "W4A16_NVFP4", "MXFP8", "INT4_AWQ"):
            if body is not None:
                out.append((f"nested-{algo}", {**quant, "quantization": {**body, "quant_algo": algo}}))
            out.append((f"flat-{algo}", {"quant_method": "modelopt", "quant_algo": algo, "exclude_modules": ["lm_head"]}))
        if body is not None:
            out.append(("nested-no-kv-field", {**quant, "quantization": {k: v for k, v in body.items()
                                                                        if k != "kv_cache_quant_algo"}}))
        if quant.get("quant_algo") == "MIXED_PRECISION":
            layers = quant["quantized_layers"]
            out.append(("mixed-block", {**quant, "quantized_layers": {k: {**v, "quant_algo": "FP8_PB_WO"}
                                                                      if v.get("quant_algo") == "FP8" else v
                                                                      for k, v in layers.items()}}))
            out.append(("mixed-mxfp8", {**quant, "quantized_layers": {k: {**v, "quant_algo": "MXFP8"}
                                                                      for k, v in layers.items()}}))
            out.append(("mixed-empty", {**quant, "quantized_layers": {}}))
    elif method == "compressed-tensors":
        ignore = quant.get("ignore")
        out += [
            ("w4a16-g32", _ct({**INT, "num_bits": 4, "group_size": 32}, ignore=ignore)),
            ("w4a16-g128-asym", _ct({**INT, "num_bits": 4, "group_size": 128, "symmetric": False}, ignore=ignore)),
            ("w4a16-channel", _ct({**INT, "num_bits": 4, "strategy": "channel"}, ignore=ignore)),
            ("w8a16-g128", _ct({**INT, "num_bits": 8, "group_size": 128}, ignore=ignore)),
            ("w4a16-actorder", _ct({**INT, "num_bits": 4, "group_size": 128, "actorder": "group"}, ignore=ignore)),
            ("w4a16-int-quantized", _ct({**INT, "num_bits": 4, "group_size": 128}, fmt="int-quantized", ignore=ignore)),
            ("int8-w8a8", _ct({**INT, "num_bits": 8, "strategy": "channel"},
                              {"type": "int", "num_bits": 8, "strategy": "token", "dynamic": True}, "int-quantized")),
            ("int8-tensor", _ct({**INT, "num_bits": 8, "strategy": "tensor"},
                                {"type": "int", "num_bits": 8, "strategy": "token", "dynamic": True}, "int-quantized")),
            ("fp8-tensor-static", _ct({**FP8, "strategy": "tensor"}, {**FP8, "strategy": "tensor"}, "float-quantized")),
            ("fp8-tensor-dynamic", _ct({**FP8, "strategy": "tensor"}, {**FP8, "strategy": "tensor", "dynamic": True},
                                       "float-quantized")),
            ("fp8-channel-static-tensor", _ct({**FP8, "strategy": "channel"}, {**FP8, "strategy": "tensor"}, "float-quantized")),
            ("fp8-block", _ct({**FP8, "strategy": "block", "block_structure": [128, 128]},
                              {**FP8, "strategy": "group", "group_size": 128, "dynamic": True}, "float-quantized")),
            ("fp8-w8a16", _ct({**FP8, "strategy": "channel"}, None, "float-quantized")),
            ("nvfp4-w4a4", _ct(NV, {**NV, "dynamic": "local"}, "nvfp4-pack-quantized")),
            ("nvfp4-w4a16", _ct(NV, None, "nvfp4-pack-quantized")),
            ("nvfp4-fp8-act", _ct(NV, TOKEN, "nvfp4-pack-quantized")),
            ("mxfp8", _ct({**FP8, "strategy": "group", "group_size": 32, "scale_dtype": "torch.uint8"},
                          {**FP8, "strategy": "group", "group_size": 32, "dynamic": True}, "mxfp8-quantized")),
            ("mxfp4", _ct({"type": "float", "num_bits": 4, "strategy": "group", "group_size": 32}, None, "mxfp4-pack-quantized")),
            ("w4a8-fp8", _ct({**INT, "num_bits": 4, "group_size": 128}, TOKEN, "int-quantized")),
            ("w4a8-fp8-g64", _ct({**INT, "num_bits": 4, "group_size": 64}, TOKEN, "int-quantized")),
            ("w4a8-int8", _ct({**INT, "num_bits": 4, "group_size": 64},
                              {"type": "int", "num_bits": 8, "strategy": "token", "dynamic": True}, "int-quantized")),
            ("ignore-experts", {**quant, "ignore": ["re:.*experts.*"]}),
            ("ignore-down-only", {**quant, "ignore": ["re:.*experts\\.0\\.(down_proj|w2)$"]}),
            ("experts-by-name", {**quant, "config_groups": {"g": {**next(iter(quant["config_groups"].values())),
                                                                 "targets": ["re:.*experts\\.\\d+\\.(gate|up|down)_proj$"]}}}),
            ("spelled-underscore", {**quant, "quant_method": "compressed_tensors"}),
        ]
    elif method == "quark":
        glob = quant["global_quant_config"]
        out += [("w-mxfp4", {**quant, "global_quant_config": {**glob, "input_tensors": None}}),
                ("w-mxfp4-a-fp8-static", {**quant, "global_quant_config": {**glob, "input_tensors": Q_FP8}}),
                ("w-mxfp4-a-fp8-dynamic", {**quant, "global_quant_config": {**glob, "input_tensors": {**Q_FP8, "is_dynamic": True}}}),
                ("w-mxfp6", {**quant, "global_quant_config": {**glob, "weight": {**MX4, "dtype": "fp6_e3m2"}, "input_tensors": None}}),
                ("fp8-tensor", {**quant, "global_quant_config": {**glob, "weight": Q_FP8, "input_tensors": Q_FP8}}),
                ("fp8-channel-token", {**quant, "global_quant_config": {**glob, "weight": {**Q_FP8, "qscheme": "per_channel"},
                                                                       "input_tensors": {**Q_FP8, "qscheme": "per_channel",
                                                                                         "is_dynamic": True}}}),
                ("fp8-channel-static", {**quant, "global_quant_config": {**glob, "weight": {**Q_FP8, "qscheme": "per_channel"},
                                                                        "input_tensors": Q_FP8}}),
                ("w-mxfp8", {**quant, "global_quant_config": {**glob, "weight": {**MX4, "dtype": "fp8_e4m3"},
                                                             "input_tensors": {**MX4, "dtype": "fp8_e4m3", "is_dynamic": True}}}),
                ("exclude-child", {**quant, "exclude": ["model.layers.3.mlp.experts.7.down_proj"]}),
                ("no-export", {k: v for k, v in quant.items() if k != "export"})]
    elif method == "mxfp4":
        out.append(("model-type-not-gpt-oss", quant))
    elif method is None:  # an unquantized checkpoint: configs naming the experts by the model's own projections
        names = "(w1|w2|w3)" if model_type == "mixtral" else "(gate|up|down)_proj"
        by_name = _ct({**INT, "num_bits": 4, "group_size": 128})
        by_name["config_groups"]["group_0"]["targets"] = [f"re:.*experts\\.\\d+\\.{names}$"]
        out += [("ct-experts-by-name", by_name), ("ct-linear", _ct({**INT, "num_bits": 4, "group_size": 128})),
                ("modelopt-flat-exclude-experts", {"quant_method": "modelopt", "quant_algo": "NVFP4",
                                                   "exclude_modules": ["*.experts"]})]
    if method:
        out += [("bitsandbytes", {"quant_method": "bitsandbytes", "load_in_4bit": True}), ("no-method", {"bits": 4}),
                ("unquantized", None)]
    return out


def grid(rng_seed: int = 0) -> list[dict]:
    """Every fixture on every platform and parallel layout, then its variants on fewer of both."""
    rng = random.Random(rng_seed)
    scenarios = []
    for directory in sorted(p for p in CONFIGS.iterdir() if (p / "config.json").is_file()):
        config = _fixture(directory.name)
        quant = _quant(config)
        model_type = (config.get("text_config") or config).get("model_type", config.get("model_type"))
        for platform in PLATFORMS:
            for parallel in PARALLEL:
                scenarios.append({"fixture": directory.name, "variant": "published", "config": config,
                                  "platform": platform, "parallel": parallel, "env": {}})
        for label, variant in _variants(quant, model_type):
            for platform in VARIANT_PLATFORMS:
                for parallel in ({}, rng.choice(PARALLEL[1:])):
                    scenarios.append({"fixture": directory.name, "variant": label, "config": _with_quant(config, variant),
                                      "platform": platform, "parallel": parallel, "env": {}})
        if quant and quant.get("quant_method") == "fp8":
            for platform in ("sm90", "sm100"):
                scenarios.append({"fixture": directory.name, "variant": "batch-invariant",
                                  "config": _with_quant(config, {k: v for k, v in quant.items() if k != "weight_block_size"}),
                                  "platform": platform, "parallel": {}, "env": {"VLLM_BATCH_INVARIANT": "1"}})
    return scenarios


# -- the two sides -----------------------------------------------------------------------------------------------------


def _layers(model) -> list[int]:
    """The MoE layers compared: the first, the second and the fourth (mixed checkpoints change every few layers)."""
    moe = list(model.moe_layers)
    return sorted({moe[i] for i in (0, 1, 3) if i < len(moe)})


def moe_fsm_answers(scenario: dict, profile: str) -> tuple[object, dict[int, dict]]:
    """``plan_model`` on the scenario's config: (the model config, {layer: answer})."""
    from moe_fsm.errors import InputError
    from moe_fsm.inputs.parallel import ParallelConfig
    from moe_fsm.inputs.platform import preset
    from moe_fsm.plan.model_config import read_model_config
    from moe_fsm.plan.plan import plan_model
    from moe_fsm.plan.quant_fields import Mapped, Refused

    with tempfile.TemporaryDirectory(prefix="moe-fsm-parity-") as folder:
        path = Path(folder) / "config.json"
        path.write_text(json.dumps(scenario["config"]))
        model = read_model_config(path)
        try:
            plan = plan_model(path, platform=preset(scenario["platform"]), parallel=ParallelConfig(**scenario["parallel"]),
                              env=scenario["env"], trace_dir=Path(folder) / "traces", policy=profile)
        except InputError as err:
            return model, {i: {"outcome": "invalid", "message": str(err)} for i in _layers(model)}
    rows = {row.index: row for row in plan.layers}
    answers = {}
    for index in _layers(model):
        row = rows[index]
        method = getattr(row.quant, "method", None)
        if row.decision is not None:
            d = row.decision
            answers[index] = {"outcome": "fallback_none" if d.backend == "NONE" else "selected", "method": method,
                              "backend": d.backend, **({"kernel": d.kernel} if d.backend != "NONE" else {})}
        elif row.error is not None:
            kind = row.error.split(":", 1)[0]
            if kind in ERRORS:  # the oracle failed
                answers[index] = {"outcome": "failed", "stage": "oracle", "error": ERRORS[kind], "message": row.error}
            elif kind == "AssertionError":  # vLLM's method refused the backend its oracle chose
                answers[index] = {"outcome": "failed", "stage": "config", "error": kind, "message": row.error}
            else:
                answers[index] = {"outcome": "invalid", "message": row.error}
        elif isinstance(row.quant, Refused):
            answers[index] = {"outcome": "failed", "stage": "config", "error": row.quant.error, "message": row.quant.reason}
        else:
            answers[index] = {"outcome": "not_modelled", "message": row.quant.reason}
        assert isinstance(row.quant, (Mapped, Refused)) or answers[index]["outcome"] == "not_modelled"
    return model, answers


# The exception kinds compared, most specific first (pydantic's ValidationError is a ValueError to vLLM's callers).
KINDS = (NotImplementedError, AssertionError, ValueError, RuntimeError, AttributeError, KeyError, TypeError)


def _kind(err: BaseException) -> str:
    return next((k.__name__ for k in KINDS if isinstance(err, k)), type(err).__name__)


def _stage(err: BaseException) -> str:
    frames = [f.filename for f in traceback.extract_tb(err.__traceback__)]
    return "oracle" if any("/fused_moe/oracle/" in f or "/fused_moe/experts/" in f for f in frames) else "config"


def _backend(method) -> tuple[str | None, str | None]:
    """The backend enum and experts class a vLLM MoE method chose in its constructor."""
    import enum

    backend = next((v for k, v in vars(method).items() if k.endswith("backend") and isinstance(v, enum.Enum)), None)
    experts = getattr(method, "experts_cls", None)
    return (backend.name if backend is not None else None), (experts.__name__ if experts is not None else None)


def vllm_answers(vllm, scenario: dict, model, profile: str) -> dict[int, dict]:
    """vLLM's reading of the config and each compared layer's MoE method (see the module docstring)."""
    from dataclasses import replace

    from moe_fsm import profiles
    from moe_fsm.decision import make_inputs
    from moe_fsm.inputs.layer import MoELayer
    from moe_fsm.inputs.parallel import ParallelConfig
    from moe_fsm.inputs.platform import preset
    import vllm.config.vllm as vllm_config
    from vllm.config.model import ModelConfig
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    from vllm.model_executor.layers.quantization import get_quantization_config
    from vllm.model_executor.layers.quantization.base_config import resolve_quant_method
    from vllm.model_executor.layers.quantization.modelopt import ModelOptQuantConfigBase
    from vllm.transformers_utils.model_arch_config_convertor import ModelArchConfigConvertorBase

    g = model.geometry
    layer = MoELayer(num_experts=g.num_experts, top_k=g.top_k, hidden_size=g.hidden_size,
                     intermediate_size=g.intermediate_size, activation=g.activation, swiglu_limit=g.swiglu_limit,
                     dtype=g.dtype, bias=g.bias, router_weight_on_input=g.router_weight_on_input)
    inputs = replace(make_inputs(layer, ParallelConfig(**scenario["parallel"]), "auto", scenario["env"],
                                 preset(scenario["platform"])), profile=profiles.ProfileChoice(profile, "parity"))
    layers = _layers(model)
    hf_config = SimpleNamespace(model_type=model.model_type)
    with vllm.facts(inputs, scenario["env"]):
        # Platform.verify_quantization reads the class's list (RocmPlatform's, XPUPlatform's; empty: every method)
        vllm.platform.__class__.supported_quantization = PLATFORM_LISTS.get(inputs.platform.vendor.value, [])
        vllm_config._current_vllm_config.kernel_config = SimpleNamespace(moe_backend="auto")  # no --moe-backend
        vllm_config._current_vllm_config.model_config = SimpleNamespace(
            hf_config=hf_config, hf_text_config=hf_config, quantization_config=None)
        try:
            quant_config = None
            raw = copy.deepcopy(model.quantization)
            if raw is not None:
                normalized = ModelArchConfigConvertorBase._normalize_quantization_config(
                    None, SimpleNamespace(quantization_config=raw))
                checker = object.__new__(ModelConfig)
                for key, value in (("quantization", None), ("model_arch_config", SimpleNamespace(quantization_config=normalized)),
                                   ("hf_config", hf_config), ("allow_deprecated_quantization", False)):
                    object.__setattr__(checker, key, value)
                ModelConfig._verify_quantization(checker)
                if checker.quantization is not None:
                    cls = get_quantization_config(checker.quantization)
                    config = dict(normalized)
                    if issubclass(cls, ModelOptQuantConfigBase):
                        config["_online_quantization_args"] = None
                    quant_config = cls.from_config(config)
                    cap = vllm.platform.get_device_capability()
                    if cap is not None and cap.to_int() < quant_config.get_min_capability():
                        raise ValueError(f"The quantization method {checker.quantization} is not supported for the "
                                         f"current GPU. Minimum capability: {quant_config.get_min_capability()}. "
                                         f"Current capability: {cap.to_int()}.")
        except Exception as err:  # noqa: BLE001 - vLLM refused the checkpoint: every layer carries it
            if DEBUG:
                traceback.print_exception(err)
            return {i: {"outcome": "failed", "stage": "config", "error": _kind(err), "message": str(err)}
                    for i in layers}
        answers = {}
        for index in layers:
            experts = object.__new__(RoutedExperts)
            experts.moe_config = vllm.moe_config(inputs)
            gate, up, down = model.projections
            experts.ckpt_gate_proj_name, experts.ckpt_up_proj_name, experts.ckpt_down_proj_name = gate, up, down
            experts.layer_name = model.experts_module(index)
            try:
                method = resolve_quant_method(quant_config, experts, experts.layer_name) if quant_config else None
                if method is None:
                    method = UnquantizedFusedMoEMethod(experts.moe_config)
            except Exception as err:  # noqa: BLE001
                stage = _stage(err)
                answers[index] = {"outcome": "failed", "stage": stage, "error": _kind(err), "message": str(err)}
                continue
            backend, kernel = _backend(method)
            answers[index] = {"outcome": "fallback_none" if backend == "NONE" else "selected",
                              "method": type(method).__name__, "backend": backend,
                              **({"kernel": kernel} if backend != "NONE" else {})}
        return answers


KEYS = ("outcome", "method", "backend", "kernel", "error", "stage")


def same(theirs: dict, ours: dict) -> bool:
    if theirs.get("outcome") == "failed" and ours.get("outcome") == "failed":
        return all(theirs.get(k) == ours.get(k) for k in ("error", "stage"))
    # moe-fsm's catalog qualifies the two CPUExpertsInt4 classes by module (cpu_moe.CPUExpertsInt4); vLLM names the class
    short = {**ours, "kernel": ours["kernel"].rsplit(".", 1)[-1]} if ours.get("kernel") else ours
    return all(theirs.get(k) == short.get(k) for k in KEYS)


PLATFORM_LISTS: dict[str, list[str]] = {}  # vendor -> vLLM's supported_quantization, read by prepare()


def _supported_quantization(source: Path) -> list[str]:
    """The ``supported_quantization`` list literal of a vLLM platform class, read from its source (vllm/platforms/
    rocm.py cannot be imported without a ROCm torch)."""
    import ast

    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "supported_quantization":
            return list(ast.literal_eval(node.value))
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "supported_quantization" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise LookupError(f"{source} has no supported_quantization list")


def prepare(vllm) -> None:
    """Import every quantization and fused-MoE module of vLLM once, on this machine's own (CPU) platform, then
    fake their library probes as the oracles' are: some compute class attributes from compiled ops at import time
    (online/fp8.py asks cutlass_fp8_supported() of the GPU for its linear method), and the MoE methods import
    their modules lazily, after Faked patched the probes of the modules loaded then."""
    import contextlib
    import importlib
    import pkgutil

    import vllm.model_executor.layers.fused_moe as fused_moe
    import vllm.model_executor.layers.quantization as quantization

    for package in (quantization, fused_moe):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            with contextlib.suppress(Exception):
                importlib.import_module(info.name)
    vllm._patch_probes()
    vllm._patch_family_probes()
    # What the MoE methods' constructors read of the current vLLM config besides the model (UnquantizedFusedMoEMethod
    # is a CustomOp: it asks the compilation config which forward to dispatch; the unquantized oracle asks for LoRA).
    import vllm.config.vllm as vllm_config
    from vllm.config import CompilationConfig

    vllm_config._current_vllm_config.compilation_config = CompilationConfig(custom_ops=["none"])
    platforms = Path(vllm_config.__file__).resolve().parents[1] / "platforms"
    PLATFORM_LISTS.update({"rocm": _supported_quantization(platforms / "rocm.py"),
                           "xpu": _supported_quantization(platforms / "xpu.py")})
    vllm_config._current_vllm_config.lora_config = None


def run(vllm, profile: str, declared_reason, *, limit: int | None = None, show: int = 50, only: list[str] | None = None):
    """Compare every scenario's compared layers; (rows, Counter of verdicts, {fixture: Counter})."""
    from collections import Counter

    prepare(vllm)

    scenarios = [s for s in grid() if not only or s["fixture"] in only]
    if limit:
        scenarios = scenarios[:limit]
    rows, counts, by_fixture, shown = [], Counter(), {}, 0
    for scenario in scenarios:
        model, ours = moe_fsm_answers(scenario, profile)
        theirs = vllm_answers(vllm, scenario, model, profile)
        for index in sorted(ours):
            a, b = theirs[index], ours[index]
            described = {k: scenario[k] for k in ("fixture", "variant", "platform", "parallel", "env")}
            row = {"scenario": {**described, "layer": index}, "vllm": a, "moe_fsm": b}
            if same(a, b):
                verdict = "agree"
            else:
                reason = declared_reason({"layer": {}, "env": scenario["env"]}, a, b)
                verdict = "declared" if reason else "disagree"
                if reason:
                    row["declared"] = reason
            row["verdict"] = verdict
            counts[verdict] += 1
            by_fixture.setdefault(scenario["fixture"], Counter())[verdict] += 1
            if verdict == "disagree" and shown < show:
                shown += 1
                print(f"DISAGREE {json.dumps(row['scenario'])}\n  vllm:    {json.dumps(a)[:400]}\n  moe-fsm: {json.dumps(b)[:400]}")
            rows.append(row)
    return rows, counts, by_fixture, len(scenarios)
