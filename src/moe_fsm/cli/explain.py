"""`moe-fsm explain TRACE.json`: the story of a decision, for a person.

What was asked, the states visited and why, why each candidate was rejected,
what was chosen (or the error), and what to change to get a different backend:
every backend of the layer's family is asked again on the recorded inputs, and
those that would run are listed with the exact ``--backend`` that selects them.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, replace
from pathlib import Path

from moe_fsm.cli.exit_codes import EXIT_OK
from moe_fsm.backends.registry import Registry, default_registry
from moe_fsm.backends.requirements import EnvEnabled
from moe_fsm.backends.verdict import BackendVerdict, SupportContext
from moe_fsm.cli import render
from moe_fsm.cli.text import printable
from moe_fsm.decision import DecisionInputs, decide
from moe_fsm.errors import InputError, SelectionError
from moe_fsm.fsm.policy import FamilyPolicy
from moe_fsm.inputs.env import EnvSnapshot
from moe_fsm.inputs.quant import QuantFamily
from moe_fsm.inputs.request import BackendRequest
from moe_fsm.inputs.formats import ActivationFormat
from moe_fsm.profiles import get as get_profile
from moe_fsm.trace import document as trace_doc
from moe_fsm.trace import schema


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "explain",
        help="tell the story of a decision trace and what to change to get a different backend",
        description="Read a decision trace written by select (or by an engine) and explain it: the request, the "
                    "states visited and why, each rejected candidate, the outcome, and every backend of the family "
                    "that would run on the recorded inputs with the --backend that selects it.",
    )
    add_trace_arguments(parser)
    parser.set_defaults(func=run)


def add_trace_arguments(parser) -> None:
    """The TRACE argument of explain and replay: a trace, or a plan/run manifest with --layer (or every decision)."""
    parser.add_argument("trace", metavar="TRACE.json|MANIFEST",
                        help="a decision trace, or a plan.manifest / run.manifest (which maps each layer to its trace)")
    parser.add_argument("--layer", metavar="N|MODULE",
                        help="with a manifest: the layer whose decision to take, by module name or by N, its decoder "
                             "layer number (the N of model.layers.N, as plan's and run's tables and the trace file names "
                             "layerNNN-... number it, in every manifest); without it, every distinct decision of the "
                             "manifest in turn")
    parser.add_argument("--rank", type=int, default=0, metavar="R",
                        help="with a run.manifest of a multi-process run: whose traces (default 0)")


def run(args) -> int:
    chunks = []
    for source, document, layers in trace_documents(args.trace, args.layer, args.rank):
        lines = explain_lines(document, source)
        if layers is not None:
            lines[1:1] = shared_lines(source, layers)
        chunks.append("\n".join(lines))
    print(printable(("\n\n" + "=" * 100 + "\n\n").join(chunks)))
    return EXIT_OK


def shared_lines(source: str, layers) -> list[str]:
    """Which layers of the manifest share this decision (and its trace file)."""
    from moe_fsm.plan.plan import layer_ranges

    indices = sorted(e.index for e in layers)
    return [f"(trace {source}, shared by {len(layers)} layer(s): {layer_ranges(indices)})"]


def trace_documents(path: str, layer: str | None = None, rank: int = 0) -> list[tuple[str, dict, list | None]]:
    """``[(trace file, validated document, the manifest layers sharing it or None)]`` for a trace or a manifest.

    A trace gives itself; a manifest with ``layer`` the trace of that layer, its ``layer_name`` set to that
    layer (as a per-layer trace of it would read); a manifest alone every distinct trace, in layer order.
    """
    from moe_fsm.trace import manifest

    document = trace_doc.parse_json(trace_doc.read_text(path, "trace file"), f"trace file {path}")
    if not manifest.is_manifest(document):
        if layer is not None:
            raise InputError(f"--layer picks a layer of a plan.manifest or run.manifest; {path} is not one")
        return [(str(path), load_trace(path), None)]
    entries = manifest.layer_entries(document, Path(path), rank)
    if layer is not None:
        entry = manifest.pick(entries, layer, Path(path))
        shared = [e for e in entries if e.trace == entry.trace]
        loaded = load_trace(entry.trace)
        return [(str(entry.trace), {**loaded, "layer_name": entry.name}, shared)]
    groups = manifest.distinct(entries)
    if not groups:
        raise InputError(f"manifest {path} maps no layer to a trace")
    return [(str(trace), load_trace(trace), shared) for trace, shared in groups]


def load_trace(path: str) -> dict:
    """Load and validate a trace (schema, then names against the recorded profile); InputError otherwise."""
    document = trace_doc.load(path)
    schema.validate(document, source=str(path))
    inputs = DecisionInputs.from_json(document["inputs"])
    check_outcome_names(document, inputs, str(path))
    return document


def check_outcome_names(document: dict, inputs: DecisionInputs, source: str) -> None:
    """A selected backend and kernel must be ones the recorded profile has: a trace edited by hand is refused."""
    outcome = document["outcome"]
    if outcome["status"] == "failed":
        return
    registry = default_registry(inputs.profile.name)
    family = inputs.layer.family
    known = registry.backends.get(family, {})
    if outcome["status"] == "selected" and outcome["backend"] not in known:
        raise InputError(
            f"{source}: outcome names backend {outcome['backend']!r}, which profile {inputs.profile.name!r} does not "
            f"have for {family.value} layers (it has {sorted(known)}); the trace was edited or comes from a plugin "
            "that is not installed here"
        )
    if outcome.get("kernel") is not None and outcome["kernel"] not in registry.kernels:
        raise InputError(f"{source}: outcome names kernel {outcome['kernel']!r}, which profile "
                         f"{inputs.profile.name!r} does not have")


def explain_lines(document: dict, trace_path: str | None = None) -> list[str]:
    family = document["family"]
    lines = [f"Decision for a {family} MoE layer" + (f" ({document['layer_name']})" if document.get("layer_name") else ""), ""]

    lines.append("What was asked")
    lines.extend(render.inputs_lines(document))
    lines.append("")

    lines.append("How the decision went")
    lines.append(f"  path: {render.path_text(document)}")
    lines.extend(_story(document))
    lines.append("")
    lines.extend(_measured_section(document))

    rejected = [e for e in document["events"] if e["event"] == "candidate" and not e["supported"]]
    if rejected:
        lines.append("Why candidates were rejected")
        for event in rejected:
            lines.append(f"  {event['backend']}: {event['reason']}")
            for kernel in event["kernels"]:
                others = [f for f in kernel["failed"] if f != event["reason"]]
                if len(event["kernels"]) > 1:
                    lines.append(f"    {kernel['kernel']}: " + "; ".join(kernel["failed"]))
                elif others:
                    lines.append("    also: " + "; ".join(others))
        lines.append("")

    lines.append("Outcome")
    lines.extend(render.indent(render.outcome_lines(document)))
    hint = _wrong_family_hint(document)
    if hint:
        lines.append(f"  {hint}")
    lines.append("")

    lines.append("To get a different backend")
    lines.extend(alternatives_lines(document, trace_path))
    return lines


def _measured_section(document: dict) -> list[str]:
    """A profile that orders by measured speed: the figures it used, or why it decided as its base profile."""
    measured = next((e for e in document["events"] if e["event"] == "measured"), None)
    if measured is not None:
        return ["Measured speed", *render.measured_lines(measured, indent="  "), ""]
    guard = next((e for e in document["events"] if e["event"] == "guard" and e["guard"] == "speed_table"), None)
    if guard is None:
        return []
    return ["Measured speed", f"  not used: {guard['inputs']['reason']} ({guard['inputs']['shape']} on "
            f"{guard['inputs']['device']}); decided as the base profile", ""]


def _wrong_family_hint(document: dict) -> str | None:
    """The PR #43334 situation: one --backend name for a model whose families do not all have it."""
    if document["outcome"]["status"] != "failed" or any(e["event"] == "mapped" for e in document["events"]):
        return None
    request = next((e["inputs"] for e in document["events"]
                    if e["event"] == "guard" and e["guard"] == "explicit_request" and e["result"]), None)
    if request is None:
        return None
    name, family = request["requested"], document["family"]
    profile = DecisionInputs.from_json(document["inputs"]).profile.name
    registry = default_registry(profile)
    owners = [f.value for f, policy in get_profile(profile).policies.items()
              if f.value != family and (name in policy.user_names or name in registry.extension_names[f])]
    if not owners:
        return None
    mapping = ",".join(f"{owner}={name}" for owner in owners)
    return (f"hint: {name!r} is a backend of {' and '.join(owners)}, not of {family}. In a mixed-precision model give "
            f"it to its own family only: --backend {mapping} (the {family} layers then choose on auto, or add "
            f"{family}=NAME).")


def _story(document: dict) -> list[str]:
    """Each state entered, why, and what happened in it."""
    out = []
    for event in document["events"]:
        kind = event["event"]
        if kind == "guard":
            state = render.guard_state(event)
            label = render.state_text(state)
            if event["result"]:
                out.append(f"  - entered {label} ({state}): {render.guard_text(event)}")
            else:
                out.append(f"  - skipped {label}: {render.guard_text(event)}")
        elif kind == "transition" and event["trigger"] == "conclude":
            out.append(f"  - concluded: {event['dest']}")
        elif kind == "candidate":
            if event["supported"]:
                out.append(f"      {event['backend']} supports the layer (experts kernel {event['kernel']})")
            else:
                out.append(f"      {event['backend']} rejected: {event['reason']}")
        elif kind in ("mapped", "rewritten", "pruned", "scan", "fallback", "note", "flashinfer_family", "prepare_finalize"):
            out.extend("  " + line for line in _event_text(event))
    return out


def _event_text(event: dict) -> list[str]:
    kind = event["event"]
    if kind == "mapped":
        return [f"    {event['requested']!r} is the {event['backend']} backend"]
    if kind == "rewritten":
        return [f"    {event['backend']} becomes {event['to']}: {event['because']}"]
    if kind == "pruned":
        env = f" ({render.reading_text(event['env'])})" if event.get("env") else ""
        return [f"    left out {', '.join(event['backends'])}: {event['because']}{env}"]
    if kind == "scan":
        return [f"    tried in order: {', '.join(event['candidates']) or 'nothing left to try'}"]
    if kind == "fallback":
        return [f"    fallback NONE: {event['because']}"]
    if kind == "note":
        return [f"    note: {event['text']}"]
    if kind == "flashinfer_family":
        return [f"    {render.reading_text(event['env'])} picks the FlashInfer {event['family']} family"]
    return [f"    prepare/finalize: {event['name']} ({event['reason']})"]


# -- alternatives --------------------------------------------------------------------


@dataclass(frozen=True)
class Alternative:
    backend: str
    user_name: str | None  # what --backend accepts for it (None: reachable only through auto)
    verdict: BackendVerdict
    would_select: str | None  # the backend an explicit request for user_name ends in (None: it fails)
    error: str | None  # the error of that request
    env_fix: dict[str, str] | None  # env settings that would make it run, when only env blocks it
    pruned_by: str | None  # why the recorded auto scan left it out


def alternatives(document: dict, registry: Registry | None = None) -> list[Alternative]:
    """Every backend of the family, asked again on the trace's inputs."""
    inputs = DecisionInputs.from_json(document["inputs"])
    profile = get_profile(inputs.profile.name)
    registry = registry or default_registry(profile.name)
    family = inputs.layer.family
    policy = profile.policies.get(family)
    if policy is None:  # the profile has no policy for the family: nothing to ask
        return []
    fmt = ActivationFormat.BATCHED if inputs.parallel.batched_activation_format else ActivationFormat.STANDARD
    ctx = SupportContext(inputs.layer, inputs.parallel, inputs.platform, profile.env.reader(inputs.env), fmt)
    pruned = {}
    for event in document["events"]:
        if event["event"] == "pruned":
            for backend in event["backends"]:
                pruned.setdefault(backend, event["because"])
    out = []
    for backend in registry.backends[family]:
        verdict = registry.verdict(family, backend, ctx)
        user = _user_name(policy, registry, backend, fmt)
        would, error, env_fix = None, None, None
        if user is not None:
            would, error = _try(inputs, family.value, user, registry)
            if would != backend and not verdict.supported:
                env_fix = _env_fix(registry, family, backend, ctx, inputs, user)
        out.append(Alternative(backend, user, verdict, would, error, env_fix, pruned.get(backend)))
    return out


def _user_name(policy: FamilyPolicy, registry: Registry, backend: str, fmt: ActivationFormat) -> str | None:
    names = dict(policy.user_names)
    names.update(registry.extension_names[policy.family])
    for user, name in names.items():
        if name == backend:
            return user
    # A batched variant is asked for by its standard name: the machine rewrites it in the batched format.
    for base, batched in policy.batched_variants.items():
        if batched == backend and fmt is ActivationFormat.BATCHED:
            for user, name in names.items():
                if name == base:
                    return user
    return None


def _try(inputs: DecisionInputs, family: str, user: str, registry: Registry, env: EnvSnapshot | None = None):
    changed = replace(inputs, request=BackendRequest.parse({family: user}), env=env or inputs.env)
    try:
        decision = decide(changed, registry=registry, trace=False)
    except SelectionError as err:
        return None, err.message
    return decision.backend, None


def _env_fix(registry, family, backend, ctx, inputs, user) -> dict[str, str] | None:
    """When every failing check of some kernel is an env switch, the switches that would enable it (verified)."""
    spec = registry.spec(family, backend)
    for kernel in spec.kernels:
        verdict = registry.kernel_verdict(kernel, ctx, spec.extra)
        failing = [c for c in verdict.checks if not c.passed]
        if failing and all(isinstance(c.requirement, EnvEnabled) for c in failing):
            fix = {n: "1" for c in failing for n in c.requirement.names}
            env = EnvSnapshot.from_mapping({**inputs.env.to_json(), **fix})
            would, _ = _try(inputs, family.value, user, registry, env)
            if would == backend:
                return fix
    return None


def alternatives_lines(document: dict, trace_path: str | None = None, registry: Registry | None = None) -> list[str]:
    family = document["family"]
    chosen = document["outcome"].get("backend")
    alts = alternatives(document, registry)
    base = f"moe-fsm select --input {shlex.quote(trace_path)}" if trace_path else "moe-fsm select ..."
    runs = [a for a in alts if a.user_name and a.would_select == a.backend]
    lines = []
    if runs:
        lines.append(f"  These {family} backends would run this layer; ask for one with --backend "
                     f"(in a mixed-precision model, --backend {family}=NAME leaves the other families on auto):")
        for a in runs:
            mark = "  (this decision's choice)" if a.backend == chosen else ""
            lines.append(f"    {a.backend:<28} --backend {a.user_name}{mark}")
            if a.pruned_by and a.backend != chosen:
                lines.append(f"      with auto it was left out: {a.pruned_by}")
        example = next((a for a in runs if a.backend != chosen), runs[0])
        lines.append(f"    e.g. {base} --backend {family}={example.user_name}")
    elif QuantFamily(family) not in get_profile(DecisionInputs.from_json(document["inputs"]).profile.name).policies:
        lines.append(f"  This profile has no {family} policy, so no {family} backend can be asked for.")
    else:
        lines.append(f"  No {family} backend that --backend can name would run this layer on this platform.")

    auto_only = [a for a in alts if a.user_name is None and a.verdict.supported]
    for a in auto_only:
        mark = " (this decision's choice)" if a.backend == chosen else ""
        lines.append(f"    {a.backend:<28} supported, but only auto selects it (no --backend name){mark}")

    redirected = [a for a in alts if a.user_name and a.would_select not in (None, a.backend)]
    if redirected:
        why = get_profile(DecisionInputs.from_json(document["inputs"]).profile.name).redirect_hint
        lines.append("  Requests that end in another backend:")
        for a in redirected:
            lines.append(f"    --backend {a.user_name}: selects {a.would_select} instead ({why})")

    blocked = [a for a in alts if a.user_name and a.would_select is None]
    if blocked:
        lines.append("  These would not run; what stands in the way:")
        for a in blocked:
            if a.verdict.supported:
                why = a.error  # supported kernel, but the explicit path refuses it (clamp, allow_vllm_cutlass, P/F)
            else:
                why = "; ".join(_failures(a.verdict))
            lines.append(f"    {a.backend:<28} (--backend {a.user_name}): {why}")
            if a.env_fix:
                env_flags = " ".join(f"--env {k}={v}" for k, v in a.env_fix.items())
                lines.append(f"      it runs with {env_flags}: {base} --backend {family}={a.user_name} {env_flags}")

    unreachable = [a for a in alts if a.user_name is None and not a.verdict.supported]
    if unreachable:
        lines.append("  Not requestable by name and not supported here:")
        for a in unreachable:
            lines.append(f"    {a.backend:<28} {a.verdict.reason}")
    return lines


def _failures(verdict: BackendVerdict) -> list[str]:
    """Every distinct failing requirement across the backend's kernels."""
    seen = []
    for kv in verdict.kernel_verdicts:
        for failure in kv.failures:
            if failure not in seen:
                seen.append(failure)
    return seen or [verdict.reason or "unsupported"]
