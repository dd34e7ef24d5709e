"""`moe-fsm diff`: one layer, or every layer of a `run` preset, under two policy profiles side by side."""

from __future__ import annotations

import json
import sys
from dataclasses import replace

from moe_fsm.cli.exit_codes import EXIT_DIFFERS, EXIT_OK
from moe_fsm import diff, profiles
from moe_fsm.cli import render
from moe_fsm.cli.inputs import Once, add_input_arguments, inputs_from_args
from moe_fsm.errors import InputError


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "diff",
        conflict_handler="resolve",  # --policy below replaces the single-profile one of the input flags
        help="decide a layer (or every layer of a preset) under two policy profiles and show where they part",
        description="What changes for a model when vLLM is upgraded: the same inputs decided under two policy "
                    "profiles, side by side, with the first step where the paths part and the events that say "
                    "why. Exit 0 when every decision is the same, 1 when some differ, 2 on bad input.",
    )
    parser.add_argument("--from", dest="before", metavar="PROFILE", action=Once,
                        help=f"the profile to compare from (default {profiles.SEEDS}); a name, 'default' or 'nearest:vllm-X.Y'")
    parser.add_argument("--to", dest="after", metavar="PROFILE", action=Once,
                        help="the profile to compare to (default: the newest vLLM release profile); a name, 'default' or "
                             "'nearest:vllm-X.Y'")
    parser.add_argument("--preset", metavar="NAME",
                        help="every MoE layer of a `moe-fsm run` preset instead of one layer (layer flags are ignored)")
    parser.add_argument("--config", metavar="PATH",
                        help="every MoE layer of a checkpoint's config.json (or its directory), as `moe-fsm plan` "
                             "reads them, instead of one layer (layer flags are ignored)")
    parser.add_argument("--json", action="store_true", help="print the comparison as JSON")
    add_input_arguments(parser)
    parser.add_argument("--policy", dest="policies", action="append", metavar="PROFILE",
                        help="given twice, the same as --from FIRST --to SECOND (moe-fsm diff --policy vllm-0.32 "
                             "--policy vllm-0.33 --preset NAME)")
    parser.set_defaults(func=run, policy=None)


def run(args) -> int:
    if args.policies:
        if len(args.policies) != 2:
            raise InputError(f"--policy is given twice to diff (from, then to), got {len(args.policies)}: "
                             f"{args.policies}; or use --from / --to")
        if args.before is not None or args.after is not None:
            raise InputError("give the two profiles as --policy FROM --policy TO or as --from / --to, not both")
        args.before, args.after = args.policies
    # each side a profile name, 'default' or nearest:vllm-X.Y; a name that is no profile is refused with the list
    before = profiles.choose(args.before or profiles.SEEDS).name
    after = args.after or diff.newest_release()
    if after is None:
        raise InputError(f"--to is needed: the only profiles are {profiles.names()}")
    after = profiles.choose(after).name
    base = inputs_from_args(args)
    if args.preset and args.config:
        raise InputError("give --preset or --config, not both")
    unmapped: list[str] = []
    if args.config:
        layers, unmapped, title = _config_layers(args.config, base, before, after)
    elif args.preset:
        from moe_fsm.engine.presets import preset

        model = preset(args.preset)
        layers = [(spec.name, replace(base, layer=spec.layer), None) for spec in model.layers]
        title = model.describe()
    else:
        layers = [(None, base, None)]
        title = None
    groups: dict = {}
    for name, inputs, after_inputs in layers:
        groups.setdefault((inputs, after_inputs), []).append(name)
    results = [(names, diff.diff_layer(inputs, before, after, args.speed_table, after_inputs))
               for (inputs, after_inputs), names in groups.items()]
    if args.json:
        sys.stdout.write(json.dumps([_json(names, d) for names, d in results], indent=2, sort_keys=True) + "\n")
    elif not results:  # no layer both profiles' config rules could read: each side's reason, per layer
        print("\n".join([f"moe-fsm diff: {before} -> {after}  ({title}): no layer is read by both", *unmapped]))
    else:
        print("\n".join(_text(before, after, title, results) + unmapped))
    return EXIT_OK if all(d.identical for _, d in results) and not unmapped else EXIT_DIFFERS


def _config_layers(path, base, before: str, after: str):
    """Each MoE layer of a config.json with the base inputs (the platform, parallel layout, env and request), read
    as `moe-fsm plan` reads it under each profile (each by its own engine's config rules): (name, the first side's
    inputs, the second side's where they differ, else None); a layer either side cannot map is listed with each
    side's reason."""
    from moe_fsm.plan.decider import LayerDecider
    from moe_fsm.plan.plan import checkpoint_layers, layer_of, layer_ranges
    from moe_fsm.plan.quant_fields import Mapped, Refused

    def read(profile: str):
        decider = LayerDecider(parallel=base.parallel, request=base.request, env=base.env, platform=base.platform,
                               policy=profile)
        return checkpoint_layers(path, decider)

    def said(profile: str, quant) -> str:
        if isinstance(quant, Mapped):
            return f"{profile}: reads {quant.source}"
        if isinstance(quant, Refused):
            return f"{profile}: REFUSED by {quant.by} ({quant.error}): {quant.reason}"
        return f"{profile}: NOT MAPPED: {quant.reason}"

    model, _, quants_before = read(before)
    _, _, quants_after = read(after)
    layers, apart = [], {}
    for index, quant_a, quant_b in zip(model.moe_layers, quants_before, quants_after):
        if isinstance(quant_a, Mapped) and isinstance(quant_b, Mapped):
            a, b = replace(base, layer=layer_of(model, quant_a)), replace(base, layer=layer_of(model, quant_b))
            layers.append((model.experts_module(index), a, None if b == a else b))
        else:
            apart.setdefault((said(before, quant_a), said(after, quant_b)), []).append(index)
    unmapped = [f"layers {layer_ranges(indices)}: not compared: {a}; {b}" for (a, b), indices in apart.items()]
    return layers, unmapped, f"{model.architecture} from {model.path}"


def _json(names, d: diff.LayerDiff) -> dict:
    part = d.divergence
    return {
        "layers": [n for n in names if n is not None],
        "same_decision": d.same_decision,
        "same_kernel": d.same_kernel,
        "from": {"profile": d.before.profile, "path": d.before.document["path"], "outcome": d.before.outcome,
                 "unread_env": list(d.unread_env[0])},
        "to": {"profile": d.after.profile, "path": d.after.document["path"], "outcome": d.after.outcome,
               "unread_env": list(d.unread_env[1])},
        "parts_at": None if part is None else {"segment": part.segment, "states": list(part.state),
                                               "from_events": part.events[0], "to_events": part.events[1]},
    }


def _text(before: str, after: str, title: str | None, results) -> list[str]:
    out = [f"moe-fsm diff: {before} -> {after}" + (f"  ({title})" if title else "")]
    first = results[0][1].before.document
    skip = ("policy:",) if title is None else ("policy:", "layer:")
    out.extend(line for line in render.inputs_lines(first) if not line.lstrip().startswith(skip))
    for names, d in results:
        out.append("")
        if title is not None:
            out.append(f"{_layer_range(names)}: {render.layer_text(d.before.document['inputs']['layer'])}")
        width = max(len(before), len(after), 24)
        rows = [
            ("decision", render.decision_text(d.before.document), render.decision_text(d.after.document)),
            ("via", d.before.outcome.get("via", "-"), d.after.outcome.get("via", "-")),
            ("path", render.path_text(d.before.document), render.path_text(d.after.document)),
        ]
        errors = [side.outcome["error"]["message"] if side.outcome["status"] == "failed" else "-"
                  for side in (d.before, d.after)]
        if errors != ["-", "-"]:
            rows.append(("error", *errors))
        if any(d.unread_env):
            rows.append(("env it ignores", ", ".join(d.unread_env[0]) or "-", ", ".join(d.unread_env[1]) or "-"))
        left = max(width, *(len(r[1]) for r in rows))
        out.append(f"  {'':<15} {before:<{left}}  {after}")
        out.extend(f"  {label:<15} {a:<{left}}  {b}" for label, a, b in rows)
        out.extend(_divergence_lines(d, before, after))
    same = sum(len(names) for names, d in results if d.same_decision)
    other_class = sum(len(names) for names, d in results if d.same_decision and not d.same_kernel)
    total = sum(len(names) for names, _ in results)
    if title is not None:
        out.append("")
        out.append(f"{total - same} of {total} layers decide differently under {after} than under {before}"
                   + (f"; {other_class} more run the same runner with a different kernel class" if other_class else ""))
    return out


def _divergence_lines(d: diff.LayerDiff, before: str, after: str) -> list[str]:
    part = d.divergence
    if not d.same_decision:
        verdict = "DIFFERENT decision"
    elif d.same_kernel:
        verdict = "same decision"
    else:  # the runner and prepare/finalize agree; the two sides name its class differently
        verdict = f"same runner, different kernel class ({d.before.kernel} / {d.after.kernel})"
    if part is None:
        return [f"  {verdict}; the paths do not part"]
    state_a, state_b = part.state
    where = (f"in {state_a}" if state_a == state_b else f"at {state_a} ({before}) / {state_b} ({after})")
    lines = [f"  {verdict}; the paths part {where}:"]
    for profile, events in ((before, part.events[0]), (after, part.events[1])):
        lines.append(f"    {profile}:")
        shown = [line for event in events for line in render.lines_of(event)]
        lines.extend("    " + line for line in shown or ["    (nothing: the decision had ended)"])
    return lines


def _layer_range(names: list[str]) -> str:
    indices = []
    for name in names:
        digits = [int(part) for part in name.split(".") if part.isdigit()]
        indices.append(digits[0] if digits else None)
    if None in indices or not indices:
        return f"{len(names)} layer(s)"
    return f"layers {_ranges(sorted(indices))} ({len(names)})"


def _ranges(indices: list[int]) -> str:
    spans, start, prev = [], indices[0], indices[0]
    for i in indices[1:] + [None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        spans.append(f"{start}" if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ",".join(spans)
