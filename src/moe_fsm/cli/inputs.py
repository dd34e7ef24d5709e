"""The commands' inputs: the layer / parallel / request / env / platform flags and ``--input FILE``.

Flags and files are written in the spec language of :mod:`moe_fsm.inputs.spec`
(its docstring lists the sections); flags given on the command line override
the file. A decision trace is a valid ``--input`` as well: its recorded inputs
are used, so ``select --input TRACE.json --backend triton`` asks "what if" of a
past decision.
"""

from __future__ import annotations

import argparse

import math
import os
import re
from pathlib import Path
from typing import Any

from moe_fsm.decision import DecisionInputs, inputs_from_spec
from moe_fsm.errors import InputError
from moe_fsm.inputs.env import known_env_vars
from moe_fsm.inputs.layer import Activation
from moe_fsm.inputs.parallel import A2A_BACKENDS, DEEPEP_MODES, AllToAllKind
from moe_fsm.inputs.platform import PRESETS
from moe_fsm.inputs.quant import (
    FP8_ACTIVATION_SCALES, FP8_WEIGHT_SCALES, FLOAT_DTYPES, MXFP4_ACTIVATIONS, WNA16_CHECKPOINTS, QuantFamily,
)
from moe_fsm.inputs.spec import SECTIONS, merge_layer, merge_parallel
from moe_fsm.trace import document as trace_doc


# -- argparse ------------------------------------------------------------------------


def add_input_arguments(parser) -> None:
    """The layer / parallel / request / env / platform flags (all default to None: unset)."""
    src = parser.add_argument_group("inputs from a file")
    src.add_argument("--input", metavar="FILE",
                     help="JSON or TOML with layer/parallel/backend/env/platform sections, or a decision trace "
                          "(its recorded inputs); flags override the file")

    layer = parser.add_argument_group("the layer")
    layer.add_argument("--quant", choices=[f.value for f in QuantFamily], help="quantization family (default unquantized)")
    layer.add_argument("--weight-scale", choices=sorted(FP8_WEIGHT_SCALES),
                       help="FP8 weight scale granularity (default block)")
    layer.add_argument("--act-scale", choices=sorted({g for g, _ in FP8_ACTIVATION_SCALES}),
                       help="FP8 activation scale granularity (default: group for block weights, token for channel, "
                            "tensor for tensor)")
    layer.add_argument("--static-act", action="store_true", default=None,
                       help="FP8 activation scales are static (calibrated), not computed per batch")
    layer.add_argument("--weight-only", action="store_true", default=None,
                       help="NVFP4 weights with 16-bit activations (W4A16)")
    layer.add_argument("--act-quant", choices=list(MXFP4_ACTIVATIONS),
                       help="MXFP4 activation quantization (default none: 16-bit activations, as gpt-oss ships)")
    layer.add_argument("--asym-act", action="store_true", default=None,
                       help="INT8 W8A8 activations are asymmetric (with a zero point)")
    layer.add_argument("--bits", type=int, choices=(4, 8), help="int_wna16 weight bits (default 4)")
    layer.add_argument("--group-size", type=_group_size, metavar="G",
                       help="columns per weight scale for int_wna16/w4a8/w4a8_int8 (default 128; -1: per channel)")
    layer.add_argument("--zero-point", action="store_true", default=None,
                       help="int_wna16 weights are asymmetric, with zero points")
    layer.add_argument("--checkpoint", choices=list(WNA16_CHECKPOINTS),
                       help="int_wna16 checkpoint format (default gptq)")
    layer.add_argument("--act-order", action="store_true", default=None,
                       help="int_wna16 checkpoint uses activation ordering (GPTQ desc_act)")
    layer.add_argument("--bias", action="store_true", default=None, help="the experts add biases (gpt-oss)")
    layer.add_argument("--experts", type=_positive_int, metavar="E", help="number of experts (default 8)")
    layer.add_argument("--top-k", type=_positive_int, metavar="K", help="experts per token (default 2)")
    layer.add_argument("--hidden", type=_positive_int, metavar="H", help="hidden size (default 1024)")
    layer.add_argument("--intermediate", type=_positive_int, metavar="N", help="intermediate size per expert (default 512)")
    layer.add_argument("--activation", choices=[a.value for a in Activation], help="gated activation (default silu)")
    layer.add_argument("--swiglu-limit", type=_positive_float, metavar="LIMIT", help="the model's SwiGLU clamp")
    layer.add_argument("--lora", action="store_true", default=None, help="LoRA adapters on the experts")
    layer.add_argument("--router-weight-on-input", action="store_true", default=None,
                       help="apply the router weight to the expert input (needs --top-k 1)")
    layer.add_argument("--dtype", choices=list(FLOAT_DTYPES), help="activation dtype (default bfloat16)")
    layer.add_argument("--allow-vllm-cutlass", action="store_true", default=None,
                       help="the checkpoint allows vLLM's own CUTLASS FP8 kernels (compressed-tensors)")
    model = parser.add_argument_group("the model and server, as an engine reads them beyond the layer (SGLang)")
    model.add_argument("--architecture", metavar="NAME",
                       help="config.json's architectures[0] (SGLang's model overrides read it), e.g. GptOssForCausalLM")
    model.add_argument("--quant-method", metavar="NAME",
                       help="the checkpoint's quantization_config.quant_method (default: the layer scheme's usual one)")
    model.add_argument("--quantization", metavar="NAME",
                       help="the server's --quantization flag (SGLang; default: not given)")
    model.add_argument("--draft", action="store_true", default=None,
                       help="the layer belongs to the speculative draft model")

    par = parser.add_argument_group("the parallel config")
    par.add_argument("--tp", type=_positive_int, metavar="N", help="tensor-parallel size (default 1)")
    par.add_argument("--dp", type=_positive_int, metavar="N", help="data-parallel size (default 1)")
    par.add_argument("--ep", type=_positive_int, metavar="N", help="expert-parallel size (default 1)")
    par.add_argument("--batched", action="store_true", default=None,
                     help="experts take the batched activation format [E_local, T, K]")
    par.add_argument("--all2all", choices=[k.value for k in AllToAllKind],
                     help="how tokens travel with DP and EP both on (default allgather_reducescatter)")
    par.add_argument("--a2a-backend", choices=list(A2A_BACKENDS), help="SGLang's --moe-a2a-backend (default none)")
    par.add_argument("--deepep-mode", choices=list(DEEPEP_MODES), help="SGLang's --deepep-mode (default auto)")

    ctx = parser.add_argument_group("request, environment and platform")
    ctx.add_argument("--backend", metavar="SPEC",
                     help="'auto' (default), one backend name, or per family: 'nvfp4=flashinfer_b12x,fp8=triton'")
    ctx.add_argument("--env", action="append", metavar="K=V",
                     help="an environment variable the selection reads (repeatable); with any --env, the process "
                          "environment is ignored")
    ctx.add_argument("--no-env", action="store_true", help="ignore the process environment (as if no variable were set)")
    ctx.add_argument("--platform", metavar="NAME",
                     help=f"'probe' (this machine, the default) or a preset: {', '.join(PRESETS)}")
    ctx.add_argument("--policy", metavar="PROFILE", action=Once,
                     help=POLICY_HELP)
    ctx.add_argument("--speed-table", metavar="PATH", action=Once, help=SPEED_TABLE_HELP)


POLICY_HELP = ("whose rules decide: a policy profile (seeds, vllm-0.33, ...; see moe-fsm diagram --list; an unknown name "
               "is refused), 'default' (the installed vLLM's profile, the nearest older one with a note, else seeds) or "
               "'nearest:vllm-X.Y' (the profile of that vLLM version, else the nearest older one)")


SPEED_TABLE_HELP = ("a measured speed table (moe-fsm measure) for a profile that orders by it (fastest-vllm-0.33); "
                    "default: this device's table in $MOE_FSM_SPEED_TABLE_DIR or ~/.config/moe_fsm/speed, if any; "
                    "other profiles ignore it")


class Once(argparse.Action):
    """A flag that may be given once: a second value is refused instead of silently replacing the first."""

    def __call__(self, parser, namespace, values, option_string=None):
        earlier = getattr(namespace, self.dest, None)
        if earlier is not None and earlier is not self.default:
            parser.error(f"{option_string} given twice ({earlier!r}, then {values!r}): give it once")
        setattr(namespace, self.dest, values)


FP8_GRANULARITIES = ("tensor", "channel", "block")


def add_kernel_shape_flags(parser, *, dtype_help: str, fp8_help: str) -> None:
    """The layer-shape flags of the commands that time kernels on a GPU (``tune``, ``measure``): E, N, K, top-k,
    the dtype and FP8 weights. Unset by default: each command says which other source of layers it takes instead and
    checks the sizes with the rest of its input."""
    parser.add_argument("--experts", type=int, help="number of experts E")
    parser.add_argument("--intermediate", type=int, help="intermediate size N (w1 is [E, 2N, K])")
    parser.add_argument("--hidden", type=int, help="hidden size K")
    parser.add_argument("--top-k", type=int, help="experts per token")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"), help=dtype_help)
    parser.add_argument("--fp8", default=None, choices=FP8_GRANULARITIES, help=fp8_help)


def _positive_int(text: str) -> int:
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def _group_size(text: str) -> int:
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1 and value != -1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive group size or -1 (per channel)")
    return value


def _positive_float(text: str) -> float:
    import argparse

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{value} is not a positive finite number")
    return value


def inputs_from_args(args) -> DecisionInputs:
    """Build the decision inputs from parsed flags (and --input); InputError on anything malformed."""
    spec: dict[str, Any] = load_input_file(args.input) if args.input else {}

    layer_flags = {
        "quant": args.quant, "weight_scale": args.weight_scale, "act_scale": args.act_scale,
        "static_act": args.static_act, "weight_only": args.weight_only, "num_experts": args.experts,
        "top_k": args.top_k, "hidden_size": args.hidden, "intermediate_size": args.intermediate,
        "activation": args.activation, "swiglu_limit": args.swiglu_limit, "lora": args.lora,
        "router_weight_on_input": args.router_weight_on_input, "dtype": args.dtype,
        "allow_vllm_cutlass": args.allow_vllm_cutlass, "act_quant": args.act_quant, "asym_act": args.asym_act,
        "bits": args.bits, "group_size": args.group_size, "zero_point": args.zero_point,
        "checkpoint": args.checkpoint, "act_order": args.act_order, "bias": args.bias,
        "architecture": args.architecture, "quant_method": args.quant_method, "quantization": args.quantization,
        "draft": args.draft,
    }
    parallel_flags = {
        "tp_size": args.tp, "dp_size": args.dp, "ep_size": args.ep,
        "batched_activation_format": args.batched, "all2all": args.all2all, "a2a_backend": args.a2a_backend,
        "deepep_mode": args.deepep_mode,
    }
    layer = merge_layer(spec.get("layer"), {k: v for k, v in layer_flags.items() if v is not None})
    parallel = merge_parallel(spec.get("parallel"), {k: v for k, v in parallel_flags.items() if v is not None})
    spec["layer"], spec["parallel"] = layer, parallel

    if args.backend is not None:
        spec["backend"] = args.backend
        spec.pop("request", None)
    if args.platform is not None:
        spec["platform"] = args.platform
    if args.policy is not None:
        spec["policy"] = args.policy
        spec.pop("profile", None)
    if args.speed_table is not None:
        spec["speed_table"] = args.speed_table

    if args.env:
        env = dict(spec.get("env") or {})
        env.update(parse_env_flags(args.env))
        spec["env"] = env
    elif "env" not in spec and not args.no_env:
        spec["env"] = None  # the process environment
    try:
        return inputs_from_spec(spec)
    except InputError as err:
        raise InputError(flag_words(str(err))) from None


# ParallelConfig's fields and the flags that set them.
PARALLEL_FLAGS = {"tp_size": "--tp", "dp_size": "--dp", "ep_size": "--ep", "batched_activation_format": "--batched",
                  "all2all": "--all2all", "a2a_backend": "--a2a-backend", "deepep_mode": "--deepep-mode"}


def flag_words(message: str) -> str:
    """A parallel-config message in the command's words: each field name it mentions becomes its flag."""
    return re.sub(r"\b(" + "|".join(PARALLEL_FLAGS) + r")\b", lambda m: PARALLEL_FLAGS[m.group(1)], message)


def parse_env_flags(flags: list[str]) -> dict[str, str]:
    env = {}
    for flag in flags:
        name, sep, value = flag.partition("=")
        name = name.strip()
        if not sep or not name:
            raise InputError(f"--env {flag!r} must look like NAME=VALUE, e.g. --env VLLM_USE_FLASHINFER_MOE_FP8=1")
        env[name] = value
    return env


# -- files ---------------------------------------------------------------------------


def load_input_file(path: str | os.PathLike) -> dict:
    """Read a JSON/TOML spec or a decision trace into a spec mapping."""
    path = Path(path)
    text = trace_doc.read_text(path, "input file")
    if path.suffix.lower() == ".toml":
        data = trace_doc.parse_toml(text, f"input file {path}")
    else:
        data = trace_doc.parse_json(text, f"input file {path}", not_json_hint="; TOML files need a .toml suffix")
    if not isinstance(data, dict):
        raise InputError(f"input file {path} must hold an object with sections {list(SECTIONS)}")
    if data.get("schema") == trace_doc.SCHEMA_ID:
        if not isinstance(data.get("inputs"), dict):
            raise InputError(f"decision trace {path} has no 'inputs' object")
        return dict(data["inputs"])
    unknown = sorted(set(data) - set(SECTIONS))
    if unknown:
        raise InputError(f"input file {path} has unknown section(s) {unknown}; accepted: {list(SECTIONS)}")
    return dict(data)


def env_var_names() -> list[str]:
    return sorted(known_env_vars())
