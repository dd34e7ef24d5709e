"""`moe-fsm golden`: check or regenerate the golden decision traces."""

from __future__ import annotations

from moe_fsm.cli.exit_codes import EXIT_DIFFERS, EXIT_OK
from moe_fsm import golden


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "golden",
        help="check (default) or regenerate the golden traces of the scenario matrix",
        description="Decide every scenario of DIR/<profile>/scenarios/*.toml under that policy profile and compare "
                    "with DIR/<profile>/golden/<name>.json, and plan every checkpoint of DIR/<profile>/plans/*.toml "
                    "and compare with DIR/<profile>/plans/golden/<name>.json, for every profile with a directory. --check "
                    "(the default) exits 1 with a unified diff per changed decision, per unmet expectation and per "
                    "stale golden file; --update rewrites the golden files that differ and removes stale ones.",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="compare with the golden files (the default)")
    mode.add_argument("--update", action="store_true", help="rewrite the golden files from the current decisions")
    parser.add_argument("--dir", default="traces", metavar="DIR", help="the traces directory (default: traces)")
    parser.add_argument("--profile", metavar="NAME", help="only this policy profile's scenarios (default: every profile)")
    parser.add_argument("--list", action="store_true", help="list the scenarios and their outcomes, then exit")
    parser.add_argument("names", nargs="*", metavar="NAME", help="only these scenarios")
    parser.set_defaults(func=run)


def run(args) -> int:
    if args.list:
        scenarios, plans = golden._select(golden.load_scenarios(args.dir, args.profile), args.names,
                                          golden.load_plans(args.dir, args.profile))
        for scenario in scenarios:
            summary = golden.summarize(golden.decide_scenario(scenario))
            print(f"{scenario.key:<62} {summary['status']:<14} {summary['result']}")
        for plan in plans:
            document = golden.decide_plan(plan, args.dir)
            statuses = sorted({group["status"] for group in document["groups"]})
            print(f"{plan.key:<62} {'plan':<14} {len(document['groups'])} group(s): {', '.join(statuses)}")
        return EXIT_OK
    if args.update:
        report = golden.update(args.dir, args.names, args.profile)
        for path in report.written:
            print(f"wrote   {path}")
        for path in report.removed:
            print(f"removed {path} (no such scenario)")
        print(f"{len(report.written)} written, {report.unchanged} unchanged, {len(report.removed)} removed")
        for failure in report.expectation_failures:
            print(f"EXPECTATION NOT MET: {failure}")
        return EXIT_DIFFERS if report.expectation_failures else EXIT_OK

    report = golden.check(args.dir, args.names, args.profile)
    for name, diff in report.diffs.items():
        print(f"--- {name}: the decision trace changed")
        print(diff.rstrip("\n"))
    for failure in report.expectation_failures:
        print(f"EXPECTATION NOT MET: {failure}")
    for path in report.stale:
        print(f"stale golden file {path}: no scenario has that name (moe-fsm golden --update removes it)")
    if report.ok:
        print(f"golden: {report.checked} scenarios match their golden traces "
              f"({', '.join(golden.profile_dirs(args.dir)) if not args.profile else args.profile})")
        return EXIT_OK
    print(f"golden: {len(report.diffs)} of {report.checked} traces differ, "
          f"{len(report.expectation_failures)} expectations not met, {len(report.stale)} stale files; "
          f"if the change is intended: moe-fsm golden --update --dir {args.dir}")
    return EXIT_DIFFERS
