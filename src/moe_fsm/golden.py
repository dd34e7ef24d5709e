"""Golden decision traces: per policy profile, a scenario matrix and its recorded canonical traces.

``traces/<profile>/scenarios/*.toml`` list named scenarios (``[[scenario]]``
tables with the input spec of :mod:`moe_fsm.inputs.spec`, an ``about`` line and
an ``expect`` written from that profile's source -- the seed functions, vLLM
0.33.0's oracles -- not from our output); several files let several people add
families without conflicts. ``traces/<profile>/golden/<name>.json`` holds each
scenario's canonical trace (no volatile part), decided under that profile. :func:`check` decides every scenario again and reports each
difference as a unified diff; :func:`update` rewrites the golden files.
Golden *plans* pin ``moe-fsm plan`` the same way: ``traces/<profile>/plans/*.toml`` list ``[[plan]]``
tables (a checkpoint config under tests/data/configs/, a platform preset, optionally a parallel layout,
backend request and env), and ``traces/<profile>/plans/golden/<name>.json`` holds each plan's canonical
document: every group of layers with its scheme, vLLM's MoE method, what the quantization_config says and
the outcome. :func:`check` and :func:`update` cover both.
Scenarios never read the process environment or probe the machine: env and
platform are part of the scenario. Nor do they see third-party plugins: they are
decided with the built-in backends plus moe-fsm's own entry points
(:func:`registry`), so installing a plugin does not change a golden trace.
"""

from __future__ import annotations

import difflib
import os
import re
import stat
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from functools import lru_cache
from importlib.metadata import entry_points

from moe_fsm import profiles
from moe_fsm.backends.registry import ENTRY_POINT_GROUP, Registry
from moe_fsm.decision import DecisionInputs, decide, inputs_from_spec
from moe_fsm.errors import InputError, SelectionError
from moe_fsm.inputs.speed import read_speed_table
from moe_fsm.trace import document as trace_doc

SCENARIO_SUBDIR = "scenarios"
GOLDEN_SUBDIR = "golden"
PLAN_SUBDIR = "plans"  # traces/<profile>/plans/*.toml, and their golden documents in plans/golden/
PLAN_KEYS = ("name", "about", "config", "platform", "parallel", "backend", "env", "expect_statuses")
PLAN_STATUSES = ("selected", "fallback_none", "failed", "refused", "not_mapped")
SPEC_KEYS = ("layer", "parallel", "backend", "env", "platform", "speed_table")
SCENARIO_KEYS = ("name", "about", "expect", "expect_message", "expect_kernel", "expect_via", "expect_runs", *SPEC_KEYS)
_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]*$")
_EXPECT = re.compile(r"^(selected|fallback_none):[A-Za-z0-9_]+$|^failed:(BackendUnsupportedError|NoBackendError)$")


@dataclass(frozen=True)
class Scenario:
    name: str
    about: str
    spec: dict = field(hash=False)
    profile: str = profiles.SEEDS
    expect: str | None = None  # "selected:TRITON", "fallback_none:NONE", "failed:NoBackendError"
    expect_message: str | None = None  # a substring of the error message
    expect_kernel: str | None = None
    expect_via: str | None = None
    expect_runs: str | None = None  # the kernel moe-fsm builds for it here (build.experts)

    def inputs(self) -> DecisionInputs:
        spec = dict(self.spec)
        spec.setdefault("env", {})  # never the process environment
        spec.setdefault("speed_table", False)  # nor the user's measured speed table
        spec["policy"] = self.profile  # so the inputs keep what this profile reads (a speed table)
        if "platform" not in spec:
            raise InputError(f"scenario {self.name!r} names no platform (scenarios never probe the machine)")
        try:
            return replace(inputs_from_spec(spec), profile=self.choice())
        except InputError as err:
            raise InputError(f"scenario {self.name!r}: {err}") from None

    def choice(self) -> profiles.ProfileChoice:
        return profiles.ProfileChoice(self.profile, f"golden scenario of traces/{self.profile}")

    @property
    def key(self) -> str:
        return f"{self.profile}/{self.name}"


@lru_cache(maxsize=None)
def registry(profile: str = profiles.SEEDS) -> Registry:
    """A profile's built-ins plus the extension backends moe-fsm itself registers (its own entry points only)."""
    reg = Registry.builtin_only(profile)
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        dist = getattr(ep, "dist", None)
        if dist is not None and dist.metadata["Name"].lower().replace("_", "-") == "moe-fsm":
            ep.load()(reg)
    return reg


def traces_dir(path: str | Path | None = None) -> Path:
    return Path(path) if path is not None else Path("traces")


def profile_dirs(directory: str | Path | None = None) -> list[str]:
    """The profiles with golden scenarios under the traces directory (``<dir>/<profile>/scenarios/``)."""
    root = traces_dir(directory)
    found = sorted(p.parent.name for p in root.glob(f"*/{SCENARIO_SUBDIR}") if p.is_dir())
    for name in found:
        profiles.get(name)  # a directory for an unknown profile is an error, not a silent skip
    return found


def load_scenarios(directory: str | Path | None = None, profile: str | None = None) -> list[Scenario]:
    """The scenarios of one profile, or of every profile with a directory (``profile=None``)."""
    if not traces_dir(directory).is_dir():
        raise InputError(
            f"traces directory {traces_dir(directory)} does not exist; run from the moe-fsm repository's root "
            "or name the directory that holds <profile>/scenarios/ with --dir DIR"
        )
    if profile is None:
        names = profile_dirs(directory)
        if not names:
            raise InputError(f"{traces_dir(directory)} has no <profile>/{SCENARIO_SUBDIR}/ directory")
        return [s for name in names for s in load_scenarios(directory, name)]
    folder = traces_dir(directory) / profile / SCENARIO_SUBDIR
    files = sorted(folder.glob("*.toml"))
    if not files:
        raise InputError(f"{folder} has no scenario files (*.toml)")
    scenarios, seen = [], set()
    for path in files:
        scenarios.extend(_load_file(path, profile, seen))
    return scenarios


def _named_tables(path: Path, kind: str, what: str) -> list[tuple[dict, str, str]]:
    """(table, its name, where it stands) for each ``[[kind]]`` table of the TOML file ``path``; InputError for a file
    without them, a ``kind`` that is not a list of tables, or a name that is missing or malformed."""
    data = trace_doc.parse_toml(trace_doc.read_text(path, what), str(path))
    tables = data.get(kind)
    if not isinstance(tables, list) or not tables:
        raise InputError(f"{path} has no [[{kind}]] tables")
    named = []
    for index, table in enumerate(tables):
        if not isinstance(table, dict):
            raise InputError(f"{path}: {kind} #{index + 1} must be a [[{kind}]] table, got {type(table).__name__}")
        name = table.get("name")
        where = f"{path}: {kind} #{index + 1}" + (f" ({name})" if name else "")
        if not isinstance(name, str) or not _NAME.match(name):
            raise InputError(f"{where}: name must match {_NAME.pattern}")
        named.append((table, name, where))
    return named


def _load_file(path: Path, profile: str, seen: set) -> list[Scenario]:
    scenarios = []
    for table, name, where in _named_tables(path, "scenario", "scenario file"):
        if name in seen:
            raise InputError(f"{where}: duplicate name in traces/{profile}")
        seen.add(name)
        unknown = sorted(set(table) - set(SCENARIO_KEYS))
        if unknown:
            raise InputError(f"{where}: unknown key(s) {unknown}; accepted: {list(SCENARIO_KEYS)}")
        expect = table.get("expect")
        if expect is not None and not _EXPECT.match(expect):
            raise InputError(f"{where}: expect {expect!r} must be selected:BACKEND, fallback_none:NONE or failed:ERRORTYPE")
        scenarios.append(Scenario(
            name=name,
            about=table.get("about", ""),
            spec=_with_speed_table({k: table[k] for k in SPEC_KEYS if k in table}, path, where),
            expect=expect,
            expect_message=table.get("expect_message"),
            expect_kernel=table.get("expect_kernel"),
            expect_via=table.get("expect_via"),
            expect_runs=table.get("expect_runs"),
            profile=profile,
        ))
    return scenarios


def _with_speed_table(spec: dict, path: Path, where: str) -> dict:
    """A scenario's ``speed_table`` names a file relative to the repository's root (the directory holding the traces
    directory), as a golden plan's config does; the trace records it by that name, so goldens do not depend on
    where the repository is."""
    name = spec.get("speed_table")
    if name is None:
        return spec
    if not isinstance(name, str):
        raise InputError(f"{where}: speed_table must be a file path relative to the repository's root")
    root = path.resolve().parents[3]  # <root>/traces/<profile>/scenarios/<file>.toml
    return {**spec, "speed_table": read_speed_table(root / name, source=name)}


def decide_scenario(scenario: Scenario) -> dict:
    """The scenario's canonical trace (the decision, or the error's trace)."""
    try:
        document = decide(scenario.inputs(), registry=registry(scenario.profile), layer_name=scenario.name).trace
    except SelectionError as err:
        document = err.trace
    return trace_doc.canonical(document)


def render(document: dict) -> str:
    return trace_doc.dumps(document, include_volatile=False)


def golden_path(directory: str | Path | None, scenario: Scenario) -> Path:
    return traces_dir(directory) / scenario.profile / GOLDEN_SUBDIR / f"{scenario.name}.json"


def expectation_failure(scenario: Scenario, document: dict) -> str | None:
    """None when the trace meets the scenario's written expectation, else what differs."""
    outcome = document["outcome"]
    status = outcome["status"]
    got = f"{status}:{outcome['error']['type']}" if status == "failed" else f"{status}:{outcome['backend']}"
    problems = []
    if scenario.expect and got != scenario.expect:
        problems.append(f"expected {scenario.expect}, got {got}")
    if scenario.expect_message:
        message = outcome["error"]["message"] if status == "failed" else ""
        if scenario.expect_message not in message:
            problems.append(f"expected the error message to contain {scenario.expect_message!r}, got {message!r}")
    if scenario.expect_kernel and outcome.get("kernel") != scenario.expect_kernel:
        problems.append(f"expected experts kernel {scenario.expect_kernel}, got {outcome.get('kernel')}")
    if scenario.expect_runs and (document.get("build") or {}).get("experts") != scenario.expect_runs:
        problems.append(f"expected moe-fsm to build {scenario.expect_runs}, got {(document.get('build') or {}).get('experts')}")
    if scenario.expect_via and outcome.get("via") != scenario.expect_via:
        problems.append(f"expected it decided in {scenario.expect_via}, got {outcome.get('via')}")
    if problems:
        return f"{scenario.name}: " + "; ".join(problems) + (f" ({scenario.about})" if scenario.about else "")
    return None


def diff_against_golden(scenario: Scenario, directory: str | Path | None = None, document: dict | None = None) -> str | None:
    """None when the scenario's trace equals its golden file, else a readable unified diff."""
    new = render(document if document is not None else decide_scenario(scenario))
    return _diff_text(golden_path(directory, scenario), new, scenario.key)


def _diff_text(path: Path, new: str, key: str) -> str | None:
    if not os.path.lexists(path):
        return f"{path} does not exist (run moe-fsm golden --update)"
    old = trace_doc.read_text(path, "golden trace")
    if old == new:
        return None
    diff = difflib.unified_diff(old.splitlines(keepends=True), new.splitlines(keepends=True),
                                fromfile=f"{path} (golden)", tofile=f"{key} (decided now)")
    return "".join(diff)


@dataclass
class CheckReport:
    checked: int = 0
    diffs: dict[str, str] = field(default_factory=dict)
    expectation_failures: list[str] = field(default_factory=list)
    stale: list[Path] = field(default_factory=list)  # golden files with no scenario

    @property
    def ok(self) -> bool:
        return not (self.diffs or self.expectation_failures or self.stale)


def _stale(directory: str | Path | None, scenarios: list[Scenario]) -> list[Path]:
    keys = {s.key for s in scenarios}
    stale = []
    for profile in sorted({s.profile for s in scenarios}):
        folder = traces_dir(directory) / profile / GOLDEN_SUBDIR
        if folder.is_dir():
            stale.extend(p for p in folder.glob("*.json")  # regular files only: a folder named *.json is not ours
                         if f"{profile}/{p.stem}" not in keys and stat.S_ISREG(p.lstat().st_mode))
    return sorted(stale)


def check(directory: str | Path | None = None, only: list[str] | None = None, profile: str | None = None) -> CheckReport:
    all_plans = load_plans(directory, profile)
    scenarios, plans = _select(load_scenarios(directory, profile), only, all_plans)
    report = CheckReport()
    for plan in plans:
        document = decide_plan(plan, directory)
        report.checked += 1
        diff = _diff_text(plan_golden_path(directory, plan), render(document), plan.key)
        if diff is not None:
            report.diffs[plan.key] = diff
        failure = plan_expectation_failure(plan, document)
        if failure:
            report.expectation_failures.append(failure)
    if not only:
        report.stale = _stale_plans(directory, all_plans, profile)
    for scenario in scenarios:
        document = decide_scenario(scenario)
        report.checked += 1
        diff = diff_against_golden(scenario, directory, document)
        if diff is not None:
            report.diffs[scenario.key] = diff
        failure = expectation_failure(scenario, document)
        if failure:
            report.expectation_failures.append(failure)
    if not only:
        report.stale = sorted(report.stale + _stale(directory, scenarios))
    return report


@dataclass
class UpdateReport:
    written: list[Path] = field(default_factory=list)
    unchanged: int = 0
    removed: list[Path] = field(default_factory=list)
    expectation_failures: list[str] = field(default_factory=list)


def update(directory: str | Path | None = None, only: list[str] | None = None, profile: str | None = None) -> UpdateReport:
    """Rewrite golden files that differ (and remove those of deleted scenarios)."""
    all_scenarios, all_plans = load_scenarios(directory, profile), load_plans(directory, profile)
    scenarios, plans = _select(all_scenarios, only, all_plans)
    report = UpdateReport()
    for plan in plans:
        document = decide_plan(plan, directory)
        failure = plan_expectation_failure(plan, document)
        if failure:
            report.expectation_failures.append(failure)
        _write_if_changed(plan_golden_path(directory, plan), render(document), report)
    for scenario in scenarios:
        document = decide_scenario(scenario)
        failure = expectation_failure(scenario, document)
        if failure:
            report.expectation_failures.append(failure)
        _write_if_changed(golden_path(directory, scenario), render(document), report)
    if not only:
        for path in sorted(_stale(directory, all_scenarios) + _stale_plans(directory, all_plans, profile)):
            path.unlink()
            report.removed.append(path)
    return report


def _write_if_changed(path: Path, text: str, report: UpdateReport) -> None:
    if os.path.lexists(path) and trace_doc.read_text(path, "golden trace") == text:
        report.unchanged += 1
        return
    trace_doc.write_atomic(path, text)
    report.written.append(path)


def _select(scenarios: list[Scenario], only: list[str] | None, plans: list | None = None):
    """``only`` names scenarios (and golden plans) as NAME (in any profile) or PROFILE/NAME (PROFILE/plans/NAME).

    Without ``plans``: the chosen scenarios; with them: (chosen scenarios, chosen plans)."""
    if not only:
        return scenarios if plans is None else (scenarios, plans)
    chosen, chosen_plans = [], []
    for wanted in only:
        matches = [s for s in scenarios if wanted in (s.name, s.key)]
        plan_matches = [p for p in plans or () if wanted in (p.name, p.key)]
        if not matches and not plan_matches:
            raise InputError(f"no scenario named {wanted!r}")
        chosen.extend(m for m in matches if m not in chosen)
        chosen_plans.extend(m for m in plan_matches if m not in chosen_plans)
    return chosen if plans is None else (chosen, chosen_plans)


def summarize(document: dict) -> dict[str, Any]:
    """One line's worth of a trace, for listings."""
    outcome = document["outcome"]
    if outcome["status"] == "failed":
        return {"status": "failed", "result": outcome["error"]["type"]}
    return {"status": outcome["status"], "result": outcome["backend"], "kernel": outcome["kernel"]}


# -- golden plans: `moe-fsm plan` on the checkpoint configs of tests/data/configs/ ---------------------------------------


@dataclass(frozen=True)
class PlanScenario:
    """One golden plan: a checkpoint config planned on a platform (and parallel layout, request, env) under a profile."""

    name: str
    about: str
    config: str  # relative to the directory holding the traces directory (the repository's root)
    platform: str
    profile: str
    parallel: dict = field(default_factory=dict, hash=False)
    backend: str = "auto"
    env: dict = field(default_factory=dict, hash=False)
    expect_statuses: tuple[str, ...] = ()  # the layer statuses the plan may have (empty: any)

    @property
    def key(self) -> str:
        return f"{self.profile}/{PLAN_SUBDIR}/{self.name}"


def load_plans(directory: str | Path | None = None, profile: str | None = None) -> list[PlanScenario]:
    """The golden plans of one profile, or of every profile with a ``plans/`` directory (``profile=None``)."""
    root = traces_dir(directory)
    names = [profile] if profile is not None else sorted(p.parent.name for p in root.glob(f"*/{PLAN_SUBDIR}") if p.is_dir())
    plans, seen = [], set()
    for name in names:
        profiles.get(name)
        for path in sorted((root / name / PLAN_SUBDIR).glob("*.toml")):
            plans.extend(_load_plan_file(path, name, seen))
    return plans


def _load_plan_file(path: Path, profile: str, seen: set) -> list[PlanScenario]:
    plans = []
    for table, name, where in _named_tables(path, "plan", "plan file"):
        if (profile, name) in seen:
            raise InputError(f"{where}: duplicate name in traces/{profile}/{PLAN_SUBDIR}")
        seen.add((profile, name))
        unknown = sorted(set(table) - set(PLAN_KEYS))
        if unknown:
            raise InputError(f"{where}: unknown key(s) {unknown}; accepted: {list(PLAN_KEYS)}")
        for key in ("config", "platform"):
            if not isinstance(table.get(key), str):
                raise InputError(f"{where}: {key} must be a string (a config path, a platform preset)")
        statuses = table.get("expect_statuses", [])
        if not isinstance(statuses, list) or any(s not in PLAN_STATUSES for s in statuses):
            raise InputError(f"{where}: expect_statuses must be a list of {list(PLAN_STATUSES)}")
        plans.append(PlanScenario(name=name, about=table.get("about", ""), config=table["config"],
                                  platform=table["platform"], profile=profile, parallel=table.get("parallel", {}),
                                  backend=table.get("backend", "auto"), env=table.get("env", {}),
                                  expect_statuses=tuple(statuses)))
    return plans


def plan_golden_path(directory: str | Path | None, plan: PlanScenario) -> Path:
    return traces_dir(directory) / plan.profile / PLAN_SUBDIR / GOLDEN_SUBDIR / f"{plan.name}.json"


def decide_plan(plan: PlanScenario, directory: str | Path | None = None) -> dict:
    """The plan's canonical document: the model's MoE facts and every group of layers with what decided it."""
    import tempfile

    from moe_fsm.inputs.parallel import ParallelConfig
    from moe_fsm.inputs.platform import preset
    from moe_fsm.plan.config_rules import config_rules
    from moe_fsm.plan.plan import layer_ranges, plan_model

    config = traces_dir(directory).resolve().parent / plan.config
    with tempfile.TemporaryDirectory(prefix="moe-fsm-golden-plan-") as traces:
        result = plan_model(config, platform=preset(plan.platform), parallel=ParallelConfig.from_json(plan.parallel),
                            backend=plan.backend, env=plan.env, trace_dir=traces,
                            policy=profiles.ProfileChoice(plan.profile, f"golden plan of traces/{plan.profile}"))
    model, g = result.model, result.model.geometry
    method_key = config_rules(profiles.get(plan.profile).config_rules).method_key  # whose MoE method class it names
    groups = []
    for (scheme, outcome), rows in result.groups():
        first = rows[0]
        groups.append({
            "layers": layer_ranges([r.index for r in rows]),
            "count": len(rows),
            "status": first.status,
            "scheme": scheme,
            method_key: getattr(first.quant, "method", None) or None,
            "config_says": getattr(first.quant, "source", None) or first.quant.reason,
            "outcome": outcome,
        })
    return {
        "plan": plan.name,
        "about": plan.about,
        "config": plan.config,
        "profile": plan.profile,
        "platform": plan.platform,
        "parallel": result.decider.parallel.to_json(),
        "request": result.decider.request.to_json(),
        "env": dict(result.decider.env.raw),
        "model": {"architecture": model.architecture, "model_type": model.model_type, "layers": model.num_layers,
                  "moe_layers": layer_ranges(list(model.moe_layers)), "experts": g.num_experts, "top_k": g.top_k,
                  "hidden_size": g.hidden_size, "intermediate_size": g.intermediate_size,
                  "activation": g.activation.value, "bias": g.bias, "router_weight_on_input": g.router_weight_on_input},
        "quant_method": result.quant_method,
        "ok": result.ok,
        "groups": groups,
    }


def plan_expectation_failure(plan: PlanScenario, document: dict) -> str | None:
    if not plan.expect_statuses:
        return None
    unexpected = sorted({g["status"] for g in document["groups"]} - set(plan.expect_statuses))
    if unexpected:
        return (f"{plan.key}: layers with status {unexpected}, expected only {list(plan.expect_statuses)}"
                + (f" ({plan.about})" if plan.about else ""))
    return None


def _stale_plans(directory: str | Path | None, plans: list[PlanScenario], profile: str | None) -> list[Path]:
    keys = {(p.profile, p.name) for p in plans}
    root = traces_dir(directory)
    folders = [root / profile / PLAN_SUBDIR / GOLDEN_SUBDIR] if profile else sorted(root.glob(f"*/{PLAN_SUBDIR}/{GOLDEN_SUBDIR}"))
    stale = []
    for folder in folders:
        if folder.is_dir():
            owner = folder.parent.parent.name
            stale.extend(p for p in folder.glob("*.json") if (owner, p.stem) not in keys and stat.S_ISREG(p.lstat().st_mode))
    return sorted(stale)
