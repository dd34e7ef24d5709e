"""`moe-fsm plan CONFIG`: which backend every MoE layer of a checkpoint gets, from its config.json alone.

No weights, no network, no torch: the config's shapes and quantization_config
give each MoE layer's spec, the per-layer decider decides it for the chosen platform,
parallel layout and backend request, and the table groups layers by decision.
Exit 0 when every MoE layer has a decision, 1 when some layer could not be
mapped or its selection failed (each is a row with its reason and, for a failed
selection, its trace), 2 on bad input.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from moe_fsm.cli.exit_codes import EXIT_DIFFERS, EXIT_OK
from moe_fsm.cli import render
from moe_fsm.cli.inputs import POLICY_HELP, SPEED_TABLE_HELP, Once, flag_words, parse_env_flags
from moe_fsm.cli.text import one_line, printable
from moe_fsm.errors import InputError
from moe_fsm.inputs.parallel import AllToAllKind, ParallelConfig
from moe_fsm.inputs.platform import PRESETS

DEFAULT_TRACE_ROOT = Path("moe-fsm-traces")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="decide every MoE layer of a checkpoint from its config.json (no weights needed)",
        description="Read a model's config.json (a file, or the directory holding it) including its "
                    "quantization_config, derive every MoE layer's spec, decide each for the platform, parallel "
                    "layout and backend request, and print a per-layer table grouped by decision; one trace per distinct "
                    "decision and plan.manifest (layer -> trace) in the trace directory. "
                    "Exit 0 when every layer has a decision, 1 when some layer could not be mapped or failed.",
    )
    parser.add_argument("config", metavar="CONFIG", help="config.json, or a checkpoint directory holding one")
    parser.add_argument("--platform", default="probe", metavar="NAME",
                        help=f"'probe' (this machine, the default) or a preset: {', '.join(PRESETS)}")
    parser.add_argument("--tp", type=int, default=1, metavar="N", help="tensor-parallel size (default 1)")
    parser.add_argument("--dp", type=int, default=1, metavar="N", help="data-parallel size (default 1)")
    parser.add_argument("--ep", type=int, default=1, metavar="N", help="expert-parallel size (default 1)")
    parser.add_argument("--batched", action="store_true", help="experts take the batched activation format")
    parser.add_argument("--all2all", default=AllToAllKind.ALLGATHER_REDUCESCATTER.value,
                        choices=[k.value for k in AllToAllKind], help="how tokens travel with DP and EP both on")
    parser.add_argument("--backend", default="auto", metavar="SPEC",
                        help="'auto' (default), one backend name, or per family: 'nvfp4=flashinfer_b12x,fp8=triton'")
    parser.add_argument("--env", action="append", metavar="K=V",
                        help="an environment variable the selection reads (repeatable); with any --env, the process "
                             "environment is ignored")
    parser.add_argument("--no-env", action="store_true", help="ignore the process environment")
    parser.add_argument("--policy", metavar="PROFILE", action=Once, help=POLICY_HELP)
    parser.add_argument("--speed-table", metavar="PATH", action=Once, help=SPEED_TABLE_HELP)
    parser.add_argument("--trace-dir", type=Path, metavar="DIR",
                        help=f"where the traces (one per distinct decision) and plan.manifest go (default {DEFAULT_TRACE_ROOT}/plan-<config dir>/)")
    parser.add_argument("--json", action="store_true",
                        help="print the plan as one JSON object: the config, platform, parallel layout, backend request, "
                             "policy profile and vLLM's quantization method, and 'layers', one object per MoE layer")
    parser.set_defaults(func=run)


def run(args) -> int:
    from moe_fsm.decision import probed_platform
    from moe_fsm.inputs.platform import preset
    from moe_fsm.plan.plan import plan_model

    platform = probed_platform() if args.platform == "probe" else preset(args.platform)
    try:
        parallel = ParallelConfig(tp_size=args.tp, dp_size=args.dp, ep_size=args.ep,
                                  batched_activation_format=args.batched, all2all=args.all2all)
    except InputError as err:  # the library names its fields; the command names its flags
        raise InputError(flag_words(str(err))) from None
    env = parse_env_flags(args.env) if args.env else ({} if args.no_env else None)
    config = Path(args.config)
    trace_dir = args.trace_dir or DEFAULT_TRACE_ROOT / f"plan-{(config if config.is_dir() else config.parent).resolve().name}"
    plan = plan_model(config, platform=platform, parallel=parallel, backend=args.backend, env=env, trace_dir=trace_dir,
                      policy=args.policy, speed_table=args.speed_table)
    if args.json:
        sys.stdout.write(json.dumps(plan_json(plan), indent=2) + "\n")
    else:
        print(printable("\n".join(plan_lines(plan))))
    return EXIT_OK if plan.ok else EXIT_DIFFERS


def plan_lines(plan) -> list[str]:
    """The plan as text; every string from the config (names, quant_method, what the quantization_config says)
    is shown escaped (``one_line``), never obeyed by the terminal nor allowed to start a line or shift a column."""
    from moe_fsm.plan.plan import layer_ranges

    m, g, decider = plan.model, plan.model.geometry, plan.decider
    quant = (m.quantization or {}).get("quant_method", "none")
    shared = f", {g.shared_experts} shared expert(s) (dense, not decided here)" if g.shared_experts else ""
    lines = [
        f"moe-fsm plan: {one_line(m.architecture)} ({one_line(m.model_type)}) from {one_line(str(m.path))}",
        f"  {m.num_layers} layers, {len(m.moe_layers)} MoE ({layer_ranges(list(m.moe_layers))}): {g.num_experts} experts "
        f"top-{g.top_k}, hidden {g.hidden_size}, expert intermediate {g.intermediate_size}, {g.activation.value}"
        f"{f' (limit {g.swiglu_limit})' if g.swiglu_limit else ''}, {g.dtype}"
        f"{', expert biases' if g.bias else ''}{', router weight applied to the input' if g.router_weight_on_input else ''}"
        f"{shared}",
        f"  quantization_config: {one_line(str(quant))}",
        f"  platform: {render.platform_text(decider.platform.to_json())}",
        f"  parallel: {render.parallel_text(decider.parallel.to_json())}",
        f"  policy profile: {decider.profile.name} ({decider.profile.reason})",
        f"  backend request: {decider.request.to_json()}; env: {render.env_text(dict(decider.env.raw))}",
        "",
    ]
    groups = plan.groups()
    lines.append(f"{len(plan.layers)} MoE layer(s), {len(groups)} distinct outcome(s):")
    for number, ((scheme, outcome), rows) in enumerate(groups, 1):
        lines.append(f"  [{number}] {len(rows)} x layers {layer_ranges([r.index for r in rows])}: "
                     f"{one_line(scheme)} -> {one_line(outcome)}")
    lines.append("")
    header = ("group", "layer", "module", "backend", "kernel", "quantization_config says", "trace")
    table = []
    for number, (_, rows) in enumerate(groups, 1):
        for r in rows:
            d = r.decision
            backend = d.backend if d else ("FAILED" if r.error else "REFUSED" if r.status == "refused" else "NOT MAPPED")
            kernel = (d.kernel or "platform MoE") if d else "-"
            cells = (f"[{number}]", str(r.index), r.name, backend, kernel,
                     getattr(r.quant, "source", None) or r.quant.reason, r.trace_path.name if r.trace_path else "-")
            table.append(tuple(one_line(cell) for cell in cells))
    lines += _table(header, table)
    lines.append("")
    written = len({r.trace_path for r in plan.layers if r.trace_path})
    if not written:  # no layer reached a selection: no trace, no plan.manifest, nothing for explain to read
        lines.append("traces: none written (no layer was decided, so there is no plan.manifest)")
        return lines
    manifest = shlex.quote(str(decider.trace_dir / "plan.manifest"))  # a command the operator can paste as it stands
    lines.append(f"traces: {one_line(str(decider.trace_dir))}/ ({written} JSON file(s), one per distinct decision; "
                 f"plan.manifest maps each layer to its file: `moe-fsm explain {one_line(manifest)} --layer N` tells "
                 "layer N's story)")
    return lines


def plan_json(plan) -> dict:
    return {
        "config": str(plan.model.path),
        "architecture": plan.model.architecture,
        "platform": plan.decider.platform.to_json(),
        "parallel": plan.decider.parallel.to_json(),
        "request": plan.decider.request.to_json(),
        "profile": plan.decider.profile.to_json(),
        "quant_method": plan.quant_method,
        "layers": [
            {
                "index": r.index,
                "module": r.name,
                "layer": r.layer.to_json() if r.layer else None,
                "status": r.status,
                "vllm_method": getattr(r.quant, "method", None) or None,
                "config_says": getattr(r.quant, "source", None),
                "backend": r.decision.backend if r.decision else None,
                "kernel": r.decision.kernel if r.decision else None,
                "via": r.decision.via if r.decision else None,
                "prepare_finalize": r.decision.prepare_finalize.name if r.decision else None,
                "reason": r.error or (None if r.decision else r.quant.reason),
                "trace": str(r.trace_path) if r.trace_path else None,
            }
            for r in plan.layers
        ],
    }


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max([len(h), *(len(row[i]) for row in rows)]) for i, h in enumerate(header)]
    fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return [fmt(header), fmt(tuple("-" * w for w in widths)), *(fmt(row) for row in rows)]

