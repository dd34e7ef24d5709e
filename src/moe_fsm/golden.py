"""Golden decision traces: per policy profile, a scenario matrix and its recorded canonical traces.

``traces/<profile>/scenarios/*.toml`` list named scenarios (``[[scenario]]``
tables with the input spec of :mod:`moe_fsm.inputs.spec`, an ``about`` line and
an ``expect`` written from that profile's source -- the seed functions, vLLM
0.33.0's oracles -- not from our output); several files let several people add
families without conflicts. ``traces/<profile>/golden/<name>.json`` holds each
scenario's canonical trace (no volatile part), decided under that profile. :func:`check` decides every scenario again and reports each
difference as a unified diff; :func:`update` rewrites the golden files.
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
from moe_fsm.trace import document as trace_doc

SCENARIO_SUBDIR = "scenarios"
GOLDEN_SUBDIR = "golden"
SPEC_KEYS = ("layer", "parallel", "backend", "env", "platform")
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


def _load_file(path: Path, profile: str, seen: set) -> list[Scenario]:
    data = trace_doc.parse_toml(trace_doc.read_text(path, "scenario file"), str(path))
    tables = data.get("scenario")
    if not isinstance(tables, list) or not tables:
        raise InputError(f"{path} has no [[scenario]] tables")
    scenarios = []
    for index, table in enumerate(tables):
        name = table.get("name")
        where = f"{path}: scenario #{index + 1}" + (f" ({name})" if name else "")
        if not isinstance(name, str) or not _NAME.match(name):
            raise InputError(f"{where}: name must match {_NAME.pattern}")
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
            spec={k: table[k] for k in SPEC_KEYS if k in table},
            expect=expect,
            expect_message=table.get("expect_message"),
            expect_kernel=table.get("expect_kernel"),
            expect_via=table.get("expect_via"),
            expect_runs=table.get("expect_runs"),
            profile=profile,
        ))
    return scenarios


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
    path = golden_path(directory, scenario)
    new = render(document if document is not None else decide_scenario(scenario))
    if not os.path.lexists(path):
        return f"{path} does not exist (run moe-fsm golden --update)"
    old = trace_doc.read_text(path, "golden trace")
    if old == new:
        return None
    diff = difflib.unified_diff(old.splitlines(keepends=True), new.splitlines(keepends=True),
                                fromfile=f"{path} (golden)", tofile=f"{scenario.key} (decided now)")
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
    scenarios = _select(load_scenarios(directory, profile), only)
    report = CheckReport()
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
        report.stale = _stale(directory, scenarios)
    return report


@dataclass
class UpdateReport:
    written: list[Path] = field(default_factory=list)
    unchanged: int = 0
    removed: list[Path] = field(default_factory=list)
    expectation_failures: list[str] = field(default_factory=list)


def update(directory: str | Path | None = None, only: list[str] | None = None, profile: str | None = None) -> UpdateReport:
    """Rewrite golden files that differ (and remove those of deleted scenarios)."""
    all_scenarios = load_scenarios(directory, profile)
    scenarios = _select(all_scenarios, only)
    report = UpdateReport()
    for scenario in scenarios:
        document = decide_scenario(scenario)
        failure = expectation_failure(scenario, document)
        if failure:
            report.expectation_failures.append(failure)
        path = golden_path(directory, scenario)
        text = render(document)
        if os.path.lexists(path) and trace_doc.read_text(path, "golden trace") == text:
            report.unchanged += 1
            continue
        trace_doc.write_atomic(path, text)
        report.written.append(path)
    if not only:
        for path in _stale(directory, all_scenarios):
            path.unlink()
            report.removed.append(path)
    return report


def _select(scenarios: list[Scenario], only: list[str] | None) -> list[Scenario]:
    """``only`` names scenarios as NAME (in any profile) or PROFILE/NAME."""
    if not only:
        return scenarios
    chosen = []
    for wanted in only:
        matches = [s for s in scenarios if wanted in (s.name, s.key)]
        if not matches:
            raise InputError(f"no scenario named {wanted!r}")
        chosen.extend(m for m in matches if m not in chosen)
    return chosen


def summarize(document: dict) -> dict[str, Any]:
    """One line's worth of a trace, for listings."""
    outcome = document["outcome"]
    if outcome["status"] == "failed":
        return {"status": "failed", "result": outcome["error"]["type"]}
    return {"status": outcome["status"], "result": outcome["backend"], "kernel": outcome["kernel"]}
