"""A vLLM plugin: every MoE layer's real backend choice, explained by moe-fsm.

Registered under vLLM's ``vllm.general_plugins`` entry point group (pyproject.toml), so every vLLM process
calls :func:`register` at start-up. It does nothing unless ``MOE_FSM_VLLM_TRACE_DIR`` is set; then it wraps
the running vLLM's MoE oracle selection (the module functions ``select_*_moe_backend`` wherever vLLM's
modules hold them, and ``select_backend`` of the ``MoEKernelOracle`` subclasses), and each selection also
writes, per layer, into that directory:

* ``<pid>-layerNNN-<family>.json``: the plugin's record: vLLM's version, the moe-fsm profile and why
  (an unknown vLLM gets the nearest profile, and the reason says so), the inputs translated from vLLM's own
  ``FusedMoEConfig`` / quant keys / env / platform, **what vLLM's oracle returned** (backend and experts
  class, or the exception), moe-fsm's decision under that profile, and whether they agree (when not: the
  first step of moe-fsm's path where the two part, and moe-fsm's verdict on vLLM's backend);
* ``<pid>-layerNNN-<family>.trace.json``: moe-fsm's decision trace (``moe-fsm explain`` / ``replay`` it).

It never changes vLLM's behaviour: the wrapped function runs first, exactly as called; its return value is
passed back untouched and its exception re-raised unchanged; anything that goes wrong inside the plugin is
logged (logger ``moe_fsm.vllm``) and vLLM proceeds. A disagreement is one WARNING line.

This module is a face, like the CLI: the decision core never imports it; it imports vLLM only inside vLLM.
"""

from __future__ import annotations

import importlib
import inspect
import itertools
import json
import logging
import os
import sys
import threading
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

ENV_VAR = "MOE_FSM_VLLM_TRACE_DIR"
ORACLE_PACKAGE = "vllm.model_executor.layers.fused_moe.oracle"
log = logging.getLogger("moe_fsm.vllm")

# family -> (oracle module, its selection function); a release without one of them simply has no such module.
ORACLES: dict[str, tuple[str, str]] = {
    "unquantized": (f"{ORACLE_PACKAGE}.unquantized", "select_unquantized_moe_backend"),
    "fp8": (f"{ORACLE_PACKAGE}.fp8", "select_fp8_moe_backend"),
    "nvfp4": (f"{ORACLE_PACKAGE}.nvfp4", "select_nvfp4_moe_backend"),
    "mxfp4": (f"{ORACLE_PACKAGE}.mxfp4", "select_mxfp4_moe_backend"),
    "mxfp8": (f"{ORACLE_PACKAGE}.mxfp8", "select_mxfp8_moe_backend"),
    "int8": (f"{ORACLE_PACKAGE}.int8", "select_int8_moe_backend"),
    "int_wna16": (f"{ORACLE_PACKAGE}.int_wna16", "select_wna16_moe_backend"),
    "w4a8": (f"{ORACLE_PACKAGE}.w4a8", "select_w4a8_moe_backend"),
    "w4a8_int8": (f"{ORACLE_PACKAGE}.w4a8_int8", "select_w4a8_int8_moe_backend"),
}
# The families whose inputs this plugin translates; for the others the record holds vLLM's choice only.
TRANSLATED = ("unquantized", "fp8", "nvfp4", "mxfp4")

_active = threading.local()  # re-entrancy: an oracle class delegating to a wrapped function records once


@dataclass
class Installed:
    """What :func:`install` wrapped, and where the records go."""

    trace_dir: Path
    vllm_version: str | None
    wrapped: list[str]
    counter: Any

    def next_layer(self) -> int:
        return next(self.counter)


_installed: Installed | None = None


# ---------------------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------------------

def register() -> None:
    """vLLM's general-plugin hook: a no-op unless MOE_FSM_VLLM_TRACE_DIR is set; never raises."""
    trace_dir = os.environ.get(ENV_VAR, "").strip()
    if not trace_dir:
        return
    try:
        install(trace_dir)
    except Exception:  # noqa: BLE001 - the plugin must never stop vLLM
        log.exception("moe-fsm: could not install the MoE tracing plugin; vLLM proceeds without it")


def install(trace_dir: str | os.PathLike) -> Installed:
    """Wrap the running vLLM's MoE oracles (idempotent); returns what was wrapped."""
    global _installed
    path = Path(trace_dir)
    path.mkdir(parents=True, exist_ok=True)
    if _installed is None:
        _installed = Installed(path, _vllm_version(), [], itertools.count())
    else:
        _installed.trace_dir = path
    for family, (module_name, function) in ORACLES.items():
        try:
            module = importlib.import_module(module_name)
        except Exception as err:  # noqa: BLE001 - a release without this oracle, or one that fails to import here
            log.debug("moe-fsm: no %s oracle to wrap (%s)", family, err)
            continue
        original = getattr(module, function, None)
        if callable(original) and not getattr(original, "__moe_fsm_wrapped__", False):
            wrapper = _wrap(family, original, f"{module_name}.{function}")
            _rebind(original, wrapper)
            _installed.wrapped.append(f"{module_name}.{function}")
        for name, cls in list(vars(module).items()):
            if _is_oracle_class(cls, module_name) and "select_backend" in vars(cls) \
                    and not getattr(vars(cls)["select_backend"], "__moe_fsm_wrapped__", False):
                method = vars(cls)["select_backend"]
                setattr(cls, "select_backend", _wrap(family, method, f"{module_name}.{name}.select_backend",
                                                     bound=True))
                _installed.wrapped.append(f"{module_name}.{name}.select_backend")
    log.info("moe-fsm: tracing MoE backend selection into %s (%s)", path, ", ".join(_installed.wrapped) or "nothing")
    return _installed


def uninstall() -> None:
    """Undo :func:`install` (tests): every wrapper back to the function it wraps."""
    global _installed
    for name, module in list(sys.modules.items()):
        if not name.startswith("vllm") or module is None:
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, types.FunctionType) and value.__dict__.get("__moe_fsm_wrapped__"):
                setattr(module, attr, value.__wrapped__)
            elif isinstance(value, type):
                method = vars(value).get("select_backend")
                if isinstance(method, types.FunctionType) and method.__dict__.get("__moe_fsm_wrapped__"):
                    setattr(value, "select_backend", method.__wrapped__)
    _installed = None


def _is_oracle_class(cls, module_name: str) -> bool:
    if not isinstance(cls, type) or cls.__module__ != module_name:
        return False
    return any(base.__name__ == "MoEKernelOracle" for base in cls.__mro__[1:])


def _rebind(original: Callable, wrapper: Callable) -> None:
    """Replace the function in every vLLM module holding it (callers import it by name)."""
    for name, module in list(sys.modules.items()):
        if not name.startswith("vllm") or module is None:
            continue
        for attr, value in list(vars(module).items()):
            if value is original:
                setattr(module, attr, wrapper)


def _vllm_version() -> str | None:
    try:
        import vllm

        version = getattr(vllm, "__version__", None)
        if version:
            return str(version)
    except Exception:  # noqa: BLE001
        pass
    from moe_fsm import profiles

    return profiles.installed_vllm()


# ---------------------------------------------------------------------------------------------------------
# The wrapper: vLLM first, untouched; then the record, whose failures are only logged
# ---------------------------------------------------------------------------------------------------------

def _wrap(family: str, original: Callable, where: str, bound: bool = False) -> Callable:
    signature = inspect.signature(original)

    def wrapper(*args, **kwargs):
        if getattr(_active, "depth", 0):
            return original(*args, **kwargs)
        _active.depth = 1
        try:
            try:
                result = original(*args, **kwargs)
            except BaseException as err:
                _safely_record(family, where, signature, args, kwargs, None, err)
                raise
            _safely_record(family, where, signature, args, kwargs, result, None)
            return result
        finally:
            _active.depth = 0

    wrapper.__moe_fsm_wrapped__ = True
    wrapper.__wrapped__ = original
    wrapper.__name__ = getattr(original, "__name__", "select")
    wrapper.__qualname__ = getattr(original, "__qualname__", wrapper.__name__)
    wrapper.__doc__ = getattr(original, "__doc__", None)
    wrapper.__module__ = getattr(original, "__module__", None)
    return wrapper


def _safely_record(family, where, signature, args, kwargs, result, error) -> None:
    if _installed is None or isinstance(error, (KeyboardInterrupt, SystemExit)):
        return
    try:
        bound = signature.bind_partial(*args, **kwargs)
        record(family, where, dict(bound.arguments), result, error)
    except Exception:  # noqa: BLE001 - never vLLM's problem
        log.exception("moe-fsm: could not trace a %s MoE backend selection; vLLM proceeds unchanged", family)


def record(family: str, where: str, arguments: dict, result, error) -> dict:
    """One layer's record (also written to the trace directory): vLLM's answer, moe-fsm's, and the comparison."""
    from moe_fsm import profiles

    installed = _installed
    layer = installed.next_layer()
    config = arguments.get("moe_config", arguments.get("config"))
    theirs = vllm_answer(result, error)
    choice = profiles.choose_for_vllm(installed.vllm_version)
    choice = profiles.ProfileChoice(choice.name, choice.reason.replace(
        "is installed beside moe-fsm", "runs this process (moe-fsm's vLLM plugin)"))
    stem = f"{os.getpid()}-layer{layer:03d}-{family}"
    doc: dict[str, Any] = {
        "moe_fsm_vllm_record": 1,
        "layer": layer,
        "family": family,
        "oracle": where,
        "vllm_version": installed.vllm_version,
        "profile": choice.to_json(),
        "vllm": theirs,
    }
    if family not in TRANSLATED:
        doc["moe_fsm"] = None
        doc["agreement"] = {"status": "not_compared",
                            "because": f"moe-fsm's vLLM plugin does not translate {family} layers yet"}
        _write(installed.trace_dir / f"{stem}.json", doc)
        return doc
    try:
        spec = translate(family, config, arguments)
    except Exception as err:  # noqa: BLE001
        doc["moe_fsm"] = None
        doc["agreement"] = {"status": "not_compared", "because": f"the inputs could not be translated: {err}"}
        _write(installed.trace_dir / f"{stem}.json", doc)
        return doc
    spec["profile"] = choice.to_json()
    doc["inputs"] = spec
    ours, trace = moe_fsm_answer(spec, layer_name=f"vllm layer {layer} ({family})")
    doc["moe_fsm"] = ours
    doc["agreement"] = compare(theirs, ours, trace)
    if trace is not None:
        trace_path = installed.trace_dir / f"{stem}.trace.json"
        from moe_fsm.trace import document as trace_doc

        trace_doc.write_atomic(trace_path, trace_doc.dumps(trace))
        doc["trace"] = trace_path.name
    _write(installed.trace_dir / f"{stem}.json", doc)
    if doc["agreement"]["status"] == "disagree":
        log.warning("moe-fsm: layer %d (%s): %s (profile %s; record %s)", layer, family,
                    doc["agreement"]["summary"], choice.name, installed.trace_dir / f"{stem}.json")
    return doc


def _write(path: Path, doc: dict) -> None:
    from moe_fsm.trace import document as trace_doc

    trace_doc.write_atomic(path, json.dumps(doc, indent=1, sort_keys=True, default=str) + "\n")


# ---------------------------------------------------------------------------------------------------------
# vLLM's answer
# ---------------------------------------------------------------------------------------------------------

def vllm_answer(result, error) -> dict:
    if error is not None:
        kind = "NotImplementedError" if isinstance(error, NotImplementedError) else (
            "ValueError" if isinstance(error, ValueError) else type(error).__name__)
        return {"outcome": "failed", "error": kind, "message": str(error)}
    backend, kernel = (result if isinstance(result, tuple) else (result, None))[:2]
    name = getattr(backend, "name", str(backend))
    experts = None
    if kernel is not None:
        experts = kernel.__name__ if isinstance(kernel, type) else type(kernel).__name__
        if experts == "CPUExpertsInt4":  # two vLLM classes share the name; moe-fsm qualifies them by module
            experts = f"{kernel.__module__.rsplit('.', 1)[-1]}.{experts}"
    if name == "NONE":
        return {"outcome": "fallback_none", "backend": "NONE", "kernel": None}
    return {"outcome": "selected", "backend": name, "kernel": experts}


# ---------------------------------------------------------------------------------------------------------
# Translation: vLLM's FusedMoEConfig, quant keys, env and platform -> a moe-fsm input spec
# ---------------------------------------------------------------------------------------------------------

def translate(family: str, config, arguments: dict) -> dict:
    """The moe-fsm input spec (the ``moe-fsm select --input`` form) of one oracle call."""
    layer: dict[str, Any] = {
        "quant": family,
        "num_experts": int(config.num_experts),
        "top_k": int(config.experts_per_token),
        "hidden_size": int(config.hidden_dim),
        "intermediate_size": int(config.intermediate_size),
        "activation": getattr(config.activation, "value", str(config.activation)),
        "dtype": str(config.in_dtype).removeprefix("torch."),
        "lora": bool(getattr(config, "is_lora_enabled", False)),
    }
    limit = getattr(config, "swiglu_limit", None)
    if limit is not None:
        layer["swiglu_limit"] = float(limit)
    if getattr(config, "has_bias", False):
        layer["bias"] = True
    if family == "fp8":
        layer.update(_fp8_scheme(arguments.get("weight_key"), arguments.get("activation_key")))
        if arguments.get("allow_vllm_cutlass"):
            layer["allow_vllm_cutlass"] = True
    elif family == "nvfp4":
        if arguments.get("activation_key") is None:
            layer["weight_only"] = True
    elif family == "mxfp4":
        act = _mxfp4_activation(arguments.get("activation_key"))
        if act is not None:
            layer["act_quant"] = act
    return {"layer": layer, "parallel": _parallel(config.moe_parallel_config),
            "backend": str(getattr(config, "moe_backend", "auto") or "auto"), "env": _env(),
            "platform": platform_facts()}


def _qu():
    return importlib.import_module("vllm.model_executor.layers.quantization.utils.quant_utils")


def _fp8_scheme(weight_key, activation_key) -> dict:
    qu = _qu()
    weights = {qu.kFp8Static128BlockSym: "block", qu.kFp8StaticChannelSym: "channel", qu.kFp8StaticTensorSym: "tensor"}
    acts = {qu.kFp8Dynamic128Sym: ("group", False), qu.kFp8DynamicTokenSym: ("token", False),
            qu.kFp8StaticTokenSym: ("token", True), qu.kFp8DynamicTensorSym: ("tensor", False),
            qu.kFp8StaticTensorSym: ("tensor", True)}
    if weight_key not in weights or activation_key not in acts:
        raise ValueError(f"FP8 quant keys ({weight_key}, {activation_key}) have no moe-fsm form")
    granularity, static = acts[activation_key]
    return {"weight_scale": weights[weight_key], "act_scale": granularity, "static_act": static}


def _mxfp4_activation(key) -> str | None:
    if key is None:
        return None
    qu = _qu()
    table = {qu.kMxfp4Dynamic: "mxfp4", qu.kMxfp8Dynamic: "mxfp8", qu.kFp8StaticTensorSym: "fp8-tensor",
             qu.kFp8Dynamic128Sym: "fp8-group"}
    if key not in table:
        raise ValueError(f"MXFP4 activation key {key} has no moe-fsm form")
    return table[key]


def _parallel(p) -> dict:
    """vLLM's FusedMoEParallelConfig (TP flattened across DP; with EP, ep = tp x dp) -> the user's sizes."""
    dp = max(1, int(p.dp_size))
    if p.use_ep:
        out = {"tp_size": max(1, int(p.ep_size) // dp), "dp_size": dp, "ep_size": int(p.ep_size)}
    else:
        out = {"tp_size": max(1, int(p.tp_size) // dp), "dp_size": dp}
    all2all = getattr(p, "all2all_backend", None)
    if all2all:
        out["all2all"] = str(all2all)
    if getattr(p, "use_batched_activation_format", False):
        out["batched_activation_format"] = True
    return out


def _env() -> dict:
    """The variables some moe-fsm profile reads, as this process has them."""
    from moe_fsm import profiles

    return {name: os.environ[name] for name in profiles.known_env_vars() if name in os.environ}


# vLLM's own library probes (module, function) -> the moe-fsm library their answer stands for.
_PROBES = (
    ("vllm.utils.flashinfer", "has_flashinfer", "flashinfer"),
    ("vllm.utils.flashinfer", "has_flashinfer_cutlass_fused_moe", "flashinfer.cutlass_fused_moe"),
    ("vllm.utils.flashinfer", "has_flashinfer_trtllm_fused_moe", "flashinfer.trtllm_fused_moe"),
    ("vllm.utils.flashinfer", "has_flashinfer_cutedsl_grouped_gemm_nt_masked", "flashinfer.cutedsl_moe"),
    ("vllm.utils.flashinfer", "has_flashinfer_b12x_moe", "flashinfer.b12x_moe"),
    ("vllm.utils.deep_gemm", "has_deep_gemm", "deep_gemm"),
    ("vllm.utils.import_utils", "has_triton_kernels", "triton_kernels"),
    ("vllm.utils.import_utils", "has_humming", "humming"),
    ("vllm.utils.import_utils", "has_hpc", "hpc"),
)


def platform_facts() -> dict:
    """vLLM's current platform, as moe-fsm's platform facts (the trace's platform form).

    Read from vLLM's own answers (``current_platform``, its library probes), so the record describes the
    machine as the oracle saw it.
    """
    from vllm.platforms import current_platform as cp

    vendor = ("cuda" if cp.is_cuda() else "rocm" if cp.is_rocm() else "xpu" if cp.is_xpu() else
              "cpu" if cp.is_cpu() else "tpu" if cp.is_tpu() else "oot")
    facts: dict[str, Any] = {"vendor": vendor, "capability": None, "gcn_arch": None,
                             "device_name": _call(lambda: cp.get_device_name()) or vendor}
    if vendor in ("cuda", "rocm"):
        cap = _call(lambda: cp.get_device_capability())
        if cap is not None:
            facts["capability"] = [int(cap[0]), int(cap[1])] if isinstance(cap, tuple) else [cap.major, cap.minor]
    if vendor == "rocm":
        facts["gcn_arch"] = _call(lambda: importlib.import_module("vllm.platforms.rocm")._GCN_ARCH) or None
    if vendor == "cpu":
        arch = _call(lambda: cp.get_cpu_architecture())
        name = getattr(arch, "name", "").lower()
        if name in ("x86", "arm", "powerpc"):
            facts["cpu_arch"] = name
        import torch

        if _call(lambda: bool(torch.cpu._is_amx_tile_supported())):
            facts["cpu_amx"] = True
    libraries = set()
    if vendor in ("cuda", "rocm", "xpu"):
        libraries.add("triton")
    for module, function, library in _PROBES:
        if _call(lambda: bool(getattr(importlib.import_module(module), function)())):
            libraries.add(library)
    if _call(lambda: bool(importlib.import_module("vllm._aiter_ops").IS_AITER_FOUND)):
        libraries.add("aiter")
    if vendor == "cuda" and _call(lambda: importlib.import_module("vllm._custom_ops").cutlass_group_gemm_supported(
            facts["capability"][0] * 10 + facts["capability"][1])):
        libraries.add("vllm._custom_ops")
    facts["libraries"] = sorted(libraries)
    return facts


def _call(fn):
    try:
        return fn()
    except Exception:  # noqa: BLE001 - a probe vLLM's release lacks, or one that cannot answer here
        return None


# ---------------------------------------------------------------------------------------------------------
# moe-fsm's answer, and the comparison
# ---------------------------------------------------------------------------------------------------------

def _spec_parser():
    from moe_fsm.decision import inputs_from_spec  # the spec parser of the core (the `select --input` form)

    return inputs_from_spec


def moe_fsm_answer(spec: dict, layer_name: str) -> tuple[dict, dict | None]:
    from moe_fsm.decision import decide
    from moe_fsm.errors import EnvVarError, InputError, NoBackendError, SelectionError

    try:
        inputs = _spec_parser()(spec)
        decision = decide(inputs, layer_name=layer_name)
    except EnvVarError as err:
        return {"outcome": "failed", "error": "ValueError", "message": str(err), "env_error": True}, None
    except SelectionError as err:
        kind = "NotImplementedError" if isinstance(err, NoBackendError) else "ValueError"
        return ({"outcome": "failed", "error": kind, "message": err.message, "path": err.trace["path"]}, err.trace)
    except InputError as err:
        return {"outcome": "invalid", "message": str(err)}, None
    out = {"outcome": decision.status if decision.backend != "NONE" else "fallback_none", "backend": decision.backend,
           "kernel": decision.kernel, "via": decision.via, "path": decision.trace["path"]}
    if decision.backend == "NONE":
        out["outcome"] = "fallback_none"
    return out, decision.trace


def compare(theirs: dict, ours: dict, trace: dict | None) -> dict:
    keys = ("outcome", "backend", "kernel", "error")
    if all(theirs.get(k) == ours.get(k) for k in keys):
        return {"status": "agree"}
    if ours.get("outcome") == "invalid":
        return {"status": "not_compared", "because": f"moe-fsm refused the translated inputs: {ours['message']}"}
    step, verdict = _where_they_part(theirs, trace)
    said = _said(theirs)
    summary = f"vLLM chose {said}, moe-fsm {_said(ours)}"
    if step:
        summary += f"; the paths part at moe-fsm's step {step}"
    if verdict:
        summary += f" ({verdict})"
    return {"status": "disagree", "first_differing_step": step, "moe_fsm_on_vllm_backend": verdict,
            "summary": summary}


def _said(answer: dict) -> str:
    if answer.get("outcome") == "failed":
        return f"{answer.get('error')}: {answer.get('message', '')[:160]}"
    return f"{answer.get('backend')} ({answer.get('kernel')})"


def _where_they_part(theirs: dict, trace: dict | None) -> tuple[str | None, str | None]:
    """The step of moe-fsm's path where vLLM's backend was turned down (or passed over), and moe-fsm's verdict."""
    if trace is None:
        return None, None
    state, wanted = "start", theirs.get("backend")
    for event in trace.get("events", ()):
        if event.get("event") == "transition":
            state = event.get("dest", state)
        elif event.get("event") == "candidate" and wanted and event.get("backend") == wanted:
            if event.get("kernel"):
                if event["kernel"] != theirs.get("kernel"):
                    return state, f"moe-fsm's verdict on {wanted}: experts {event['kernel']}"
                continue
            return state, f"moe-fsm's verdict on {wanted}: {event.get('reason') or 'not supported'}"
        elif event.get("event") == "pruned" and wanted in event.get("backends", ()):
            return state, f"moe-fsm pruned {wanted}: {event.get('because')}"
    path = trace.get("path") or []
    last = [p for p in path if p not in ("start", "selected", "failed", "fallback_none")]
    return (last[-1] if last else (path[-1] if path else None)), None


__all__ = ["ENV_VAR", "Installed", "install", "record", "register", "translate", "uninstall"]
