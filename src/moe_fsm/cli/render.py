"""Text renderings of a decision trace, shared by ``select`` and ``explain``.

Everything here reads the trace document only (not live objects), so a trace
from another machine renders the same way.
"""

from __future__ import annotations

from typing import Iterable

from moe_fsm.inputs.env import known_env_vars

# Guards of traces recorded before guard events named their step.
_OLD_GUARD_STATE = {
    "lora_enabled": "lora_shortcut",
    "explicit_request": "explicit_user_choice",
    "flashinfer_env": "flashinfer_preference",
    "env_override_set": "env_override",
    "force_marlin": "forced_marlin",
    "auto_scan": "auto_scan",
}

STATE_TEXT = {
    "lora_shortcut": "LoRA shortcut",
    "flashinfer_preference": "FlashInfer preference",
    "deep_gemm_override": "DeepGEMM env override",
    "aiter_override": "AITER env override",
    "forced_marlin": "forced Marlin",
    "fallback_none": "fallback (NONE)",
}


def guard_state(event: dict) -> str:
    # Guards newer than profiles always record their step; a trace without one is shown by the guard's name.
    return event.get("step") or _OLD_GUARD_STATE.get(event["guard"], event["guard"])


def state_text(state: str) -> str:
    """A state's name for a person: 'deep_gemm_override' -> 'deep gemm override'."""
    return STATE_TEXT.get(state, state.replace("_", " "))


# -- inputs --------------------------------------------------------------------------


def quant_text(quant: dict) -> str:
    if quant["family"] == "unquantized":
        return "unquantized"

    def key(k):
        if k is None:
            return "16-bit"
        text = f"{k['dtype']} {'static' if k['static'] else 'dynamic'} {k['granularity']}"
        if k.get("symmetric") is False:
            text += " asymmetric"
        return text + (f" ({k['scale_dtype']} scales)" if k.get("scale_dtype") else "")

    if quant["family"] == "nvfp4":
        return "NVFP4 " + ("W4A16 (16-bit activations)" if quant["activation"] is None else "W4A4")
    text = f"{quant['family'].upper()} (weights {key(quant['weight'])}, activations {key(quant['activation'])})"
    facts = []
    if quant.get("group_size") is not None:
        facts.append("per channel" if quant["group_size"] == -1 else f"group size {quant['group_size']}")
    if quant.get("zero_point"):
        facts.append("zero points")
    if quant.get("checkpoint"):
        facts.append(f"{quant['checkpoint']} checkpoint" + (", act-order" if quant.get("act_order") else ""))
    return text + (f"; {', '.join(facts)}" if facts else "")


def layer_text(layer: dict) -> str:
    parts = [
        quant_text(layer["quant"]),
        f"{layer['num_experts']} experts, top-{layer['top_k']}",
        f"hidden {layer['hidden_size']}, intermediate {layer['intermediate_size']}",
        f"{layer['activation']}, {layer['dtype']}",
    ]
    options = []
    if layer.get("swiglu_limit") is not None:
        options.append(f"swiglu_limit={layer['swiglu_limit']:g}")
    if layer.get("lora"):
        options.append("LoRA")
    if layer.get("router_weight_on_input"):
        options.append("router weight on input")
    if layer.get("allow_vllm_cutlass"):
        options.append("allow_vllm_cutlass")
    if layer.get("bias"):
        options.append("expert biases")
    if options:
        parts.append(", ".join(options))
    model = layer.get("model")
    if model:
        facts = [f"{name} {model[name]}" for name in ("architecture", "quant_method") if model[name] is not None]
        facts += [f"--quantization {model['quantization']}"] if model["quantization"] is not None else []
        facts += [f"built with the {model['layer_method']} method"] if model.get("layer_method") else []
        facts += ["speculative draft"] if model["draft"] else []
        parts.append("model: " + (", ".join(facts) or "nothing known"))
    return "; ".join(parts)


def parallel_text(parallel: dict) -> str:
    text = f"tp={parallel['tp_size']} dp={parallel['dp_size']} ep={parallel['ep_size']}"
    text += ", batched activation format" if parallel["batched_activation_format"] else ", standard activation format"
    if parallel["dp_size"] > 1 and parallel["ep_size"] > 1:
        text += f", all2all={parallel['all2all']}"
    elif parallel["all2all"] != "allgather_reducescatter":
        text += f", all2all={parallel['all2all']} (unused without both DP and EP)"
    if "a2a_backend" in parallel:
        text += f", --moe-a2a-backend {parallel['a2a_backend']}"
    if "deepep_mode" in parallel:
        text += f", --deepep-mode {parallel['deepep_mode']}"
    return text


def platform_text(platform: dict) -> str:
    vendor = platform["vendor"]
    if vendor == "cuda":
        head = f"CUDA {platform['capability'][0]}.{platform['capability'][1]} ({platform['device_name']})"
    elif vendor == "rocm":
        head = f"ROCm {platform['gcn_arch']} ({platform['device_name']})"
    else:
        head = f"{vendor} ({platform['device_name']})"
    if platform.get("cpu_arch"):
        head += f", {platform['cpu_arch']}" + (" with AMX tiles" if platform.get("cpu_amx") else " without AMX tiles")
    libs = ", ".join(platform["libraries"]) or "none"
    text = f"{head}; libraries: {libs}"
    if platform.get("probe_override"):
        text += f" [not probed: MOE_FSM_PLATFORM={platform['probe_override']}]"
    return text


def request_text(request, family: str) -> str:
    if isinstance(request, str):
        return request if request == "auto" else f"{request} (for every family)"
    own = request.get(family)
    default = request.get("default", "auto")
    mapping = ", ".join(f"{k}={v}" for k, v in request.items())
    if own is not None:
        return f"{own} for {family} (mapping: {mapping})"
    return f"{default} for {family}: the mapping ({mapping}) does not name {family}"


def env_text(env: dict) -> str:
    if not env:
        return "none of moe-fsm's variables set"
    return ", ".join(f"{k}={v}" for k, v in sorted(env.items()))


def inputs_lines(document: dict, indent: str = "  ") -> list[str]:
    inputs = document["inputs"]
    lines = [
        f"{indent}layer:    {layer_text(inputs['layer'])}",
        f"{indent}parallel: {parallel_text(inputs['parallel'])}",
        f"{indent}platform: {platform_text(inputs['platform'])}",
        f"{indent}request:  {request_text(inputs['request'], document['family'])}",
        f"{indent}env:      {env_text(inputs['env'])}",
    ]
    if "profile" in inputs:
        lines.append(f"{indent}policy:   {inputs['profile']['name']} ({inputs['profile']['reason']})")
    table = inputs.get("speed_table")
    if table is not None:
        lines.append(f"{indent}speed:    table {table['source']} (measured on {table['device']}, "
                     f"{table['measured']['date']}; sha256 {table['sha256'][:12]})")
    if document.get("layer_name"):
        lines.insert(0, f"{indent}name:     {document['layer_name']}")
    return lines


# -- events --------------------------------------------------------------------------


def reading_text(reading: dict) -> str:
    if reading["set"]:
        return f"{reading['name']}={reading['raw']}"
    default = reading["value"]
    shown = (1 if default else 0) if isinstance(default, bool) and _is_flag(reading["name"]) else default
    return f"{reading['name']} unset (default {shown})"


def _is_flag(name: str) -> bool:
    var = known_env_vars().get(name)
    return var is not None and var.accepted == "0 or 1"


def guard_text(event: dict) -> str:
    guard, inputs = event["guard"], event["inputs"]
    if guard == "when":
        return "; ".join(f"{c['condition']}: {'yes' if c['holds'] else 'no, ' + c['reason']}" for c in inputs["when"])
    if guard == "lora_enabled":
        if not inputs["lora_backend"]:
            return "the family has no LoRA shortcut"
        return f"LoRA {'on' if inputs['lora'] else 'off'} (LoRA forces {inputs['lora_backend']})"
    if guard == "explicit_request":
        if inputs["requested"] == "auto":
            return f"{inputs['source']} is auto"
        if inputs["requested"] in inputs.get("passthrough", ()):
            return f"{inputs['source']} asks for {inputs['requested']!r}, which this family treats as auto"
        return f"{inputs['source']} asks for {inputs['requested']!r}"
    if guard == "auto_scan":
        return "no earlier step decided"
    if guard == "server_args":
        return "the server arguments as given"
    if guard == "layer_runner":
        return f"the layer's quantization method ({inputs['method']}) builds its runner"
    if guard == "speed_table":
        return f"{inputs['reason']} ({inputs['shape']} on {inputs['device']})"
    if not inputs:
        return "the family has no such step"
    readings = "; ".join(reading_text(r) for r in inputs.get("env", ()))
    return f"{readings} [{_test_text(guard, inputs['test'])}: {'yes' if event['result'] else 'no'}]"


def _test_text(guard: str, test: str) -> str:
    return {"is set": "is it set", "reads 1": "does it read 1", "any is set": "is any set",
            "reads true": "does it read true"}.get(test, test)


def candidate_lines(event: dict, detail: bool = False, indent: str = "    ") -> list[str]:
    if event["supported"]:
        return [f"{indent}ok    {event['backend']} -> {event['kernel']}"]
    lines = [f"{indent}no    {event['backend']}: {event['reason']}"]
    if detail:
        for kernel in event["kernels"]:
            if len(event["kernels"]) > 1 or len(kernel["failed"]) > 1:
                lines.append(f"{indent}        {kernel['kernel']}:")
                lines.extend(f"{indent}          - {f}" for f in kernel["failed"])
    return lines


def event_lines(document: dict, detail: bool = False) -> list[str]:
    """The decision, event by event, grouped under the state it happened in."""
    lines: list[str] = ["  [start]"]
    for event in document["events"]:
        lines.extend(lines_of(event, detail))
    return lines


def lines_of(event: dict, detail: bool = False) -> list[str]:
    """One event as the lines ``select`` prints for it."""
    kind = event["event"]
    if kind == "guard":
        verb = "enter" if event["result"] else "skip "
        return [f"    {verb} {guard_state(event):<22} {guard_text(event)}"]
    if kind == "transition":
        concluded = event["trigger"] == "conclude" or event["dest"] in ("selected", "fallback_none", "failed")
        return [f"  [{event['dest']}]" + ("  (conclude)" if concluded else "")]
    if kind == "candidate":
        return candidate_lines(event, detail)
    if kind == "mapped":
        return [f"    mapped {event['requested']!r} -> {event['backend']}"]
    if kind == "rewritten":
        return [f"    rewrote {event['backend']} -> {event['to']} ({event['because']})"]
    if kind == "pruned":
        env = f" [{reading_text(event['env'])}]" if event.get("env") else ""
        return [f"    pruned {', '.join(event['backends'])}: {event['because']}{env}"]
    if kind == "scan":
        return [f"    scan order: {', '.join(event['candidates']) or '(empty)'}"]
    if kind == "reordered":
        where = event["to"].replace(":", " ", 1) if ":" in event["to"] else f"to the {event['to']}"
        return [f"    moved {', '.join(event['backends'])} {where}: {event['because']}"]
    if kind == "unchecked":
        return [f"    chose {event['backend']} -> {event['kernel']} unchecked: {event['because']}"]
    if kind == "fallback":
        return [f"    fallback {event['backend']}: {event['because']}"]
    if kind == "note":
        return [f"    note: {event['text']}"]
    if kind == "flashinfer_family":
        return [f"    {reading_text(event['env'])} names the FlashInfer {event['family']} family"]
    if kind == "prepare_finalize":
        return [f"    prepare/finalize {event['name']}: {event['reason']}"]
    if kind == "resolved":
        return [f"    {event['name']} = {event['value']!r} ({event['because']})"]
    if kind == "rule":
        return rule_lines(event, detail)
    if kind == "measured":
        return measured_lines(event, detail)
    # an event this renderer does not know: show it raw rather than drop it
    return [f"    {kind}: " + ", ".join(f"{k}={v!r}" for k, v in event.items() if k != "event")]


def measured_lines(event: dict, detail: bool = False, indent: str = "    ") -> list[str]:
    """The measured scan's figures: one row per candidate (median µs per token count, geometric mean, verdict), the
    base profile's choice and the one made. Without ``detail``, candidates the base profile's rules refuse and
    that have no figure are left out (their refusal is on its own line)."""
    tokens = event["tokens"]
    lines = [f"{indent}measured: table {event['table']} ({event['device']}, {event['date']}; "
             f"sha256 {event['sha256'][:12]}), shape {event['shape']}"]
    rows = [r for r in event["figures"] if detail or r["supported"] or r["us"]]
    width = max([len(r["backend"]) for r in rows] + [7])
    heads = [f"{t} tok" for t in tokens] + ["geomean"]
    lines.append(f"{indent}  {'backend':<{width}}  " + "  ".join(f"{h:>9}" for h in heads) + "  (µs)")
    for row in rows:
        cells = [f"{row['us'][str(t)]:>9.1f}" if str(t) in row["us"] else f"{'-':>9}" for t in tokens]
        cells.append(f"{row['geomean_us']:>9.1f}" if row["geomean_us"] is not None else f"{'-':>9}")
        mark = "chosen" if row["backend"] == event["chosen"] else ("eligible" if row["eligible"] else "no")
        lines.append(f"{indent}  {row['backend']:<{width}}  " + "  ".join(cells) + f"  {mark}: {row['reason']}")
    lines.append(f"{indent}chose {event['chosen']} (the base profile chooses {event['base']}): {event['because']}")
    return lines


def rule_lines(event: dict, detail: bool = False) -> list[str]:
    """A pipeline rule: the ones that fired, and with ``detail`` the others with the condition that failed."""
    if event["fired"]:
        return [f"    rule  {event['rule']}"]
    if not detail:
        return []
    failed = next((c for c in event["when"] if not c["holds"]), None)
    why = f": {failed['condition']}: no, {failed['reason']}" if failed else ""
    return [f"    no    {event['rule']}{why}"]


def decision_text(document: dict) -> str:
    """The outcome in a few words: 'TRITON (TritonExperts)', 'NONE', 'NoBackendError'."""
    outcome = document["outcome"]
    if outcome["status"] == "failed":
        return f"{outcome['error']['type']} ({outcome['error']['builtin']})"
    return outcome["backend"] + (f" ({outcome['kernel']})" if outcome.get("kernel") else "")


def outcome_lines(document: dict) -> list[str]:
    outcome = document["outcome"]
    status = outcome["status"]
    if status == "failed":
        err = outcome["error"]
        return [f"FAILED: {err['type']} (a {err['builtin']}): {err['message']}"]
    kernel = outcome["kernel"] or "none (the platform's own MoE path)"
    head = "SELECTED" if status == "selected" else "FALLBACK"
    lines = [
        f"{head}: {outcome['backend']}  (experts kernel {kernel}, via {state_text(outcome['via'])}, "
        f"{outcome['activation_format']} activation format)",
        f"  prepare/finalize: {outcome['prepare_finalize']['name']}: {outcome['prepare_finalize']['reason']}",
    ]
    if "resolved" in outcome:
        lines.append("  resolved: " + ", ".join(f"{k}={v!r}" for k, v in outcome["resolved"].items()))
    build = document.get("build")
    if build is not None:
        lines.append(f"  here: {build_text(build)}")
    return lines


def build_text(build: dict) -> str:
    """What moe-fsm can run of the decision on this machine (the decision itself is vLLM's)."""
    experts = {"native": f"builds {build['experts']}", "substitute": f"builds {build['experts']} instead",
               "unavailable": "cannot build the experts"}[build["how"]]
    text = f"moe-fsm {experts} ({build['because']})"
    if not build["prepare_finalize_buildable"]:
        text += f"; the prepare/finalize cannot be built here: {build['prepare_finalize_because']}"
    return text


def path_text(document: dict) -> str:
    return " -> ".join(document["path"])


def indent(lines: Iterable[str], prefix: str = "  ") -> list[str]:
    return [prefix + line if line else line for line in lines]
