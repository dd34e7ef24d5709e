#!/usr/bin/env python3
"""Parity of moe-fsm's ``vllm-0.33`` profile with vLLM 0.33.0's own oracle functions.

A maintainer script, not part of CI. It runs vLLM's REAL selection functions
(``select_unquantized_moe_backend``, ``select_fp8_moe_backend``,
``select_nvfp4_moe_backend``, ... and the experts classes' ``is_supported_config``
they call) on a generated grid of scenarios, with only the machine facts faked,
and compares each answer with moe-fsm's decision under the ``vllm-0.33`` profile.

What is faked (machine facts only; ``tools/vllm_parity_fakes.py``):
  * the platform object: ``vllm.platforms.current_platform`` keeps its identity
    but its class is swapped per scenario for one that answers vendor,
    compute capability, device name and the FP8 facts of the scenario's platform;
  * ``vllm.platforms.rocm`` (it cannot import without a ROCm torch): a stand-in
    module whose ``on_gfx*`` / ``get_cdna_version`` answer from the scenario's arch;
  * which libraries import: vLLM's ``has_*`` probes (``has_flashinfer_*``,
    ``has_deep_gemm``, ``has_humming``, AITER's ``IS_AITER_FOUND``, ...) answer
    from the scenario's library set, wherever a module imported them;
  * the CPU: x86 without AMX (vLLM's CPU experts ask ``torch.cpu``).
Nothing of vLLM's decision logic is replaced. Compiled extensions (``vllm._C``
and friends) are absent on a CPU box; vLLM imports them under try/except and
the oracles never call them.

Environment: needs torch and a few of vLLM's pure-python dependencies; run it
from an isolated venv (see docs/vllm-parity.md):

    python3 -m venv --system-site-packages /work/venvs/vllmparity
    /work/venvs/vllmparity/bin/pip install --no-deps <the packages listed in docs/vllm-parity.md>
    /work/venvs/vllmparity/bin/python tools/vllm_parity.py            # compare
    /work/venvs/vllmparity/bin/python tools/vllm_parity.py --vllm-only --json out.json

The vLLM source is taken from ``--cache`` (default: /work/cache/vllm/src when it
exists, else ~/.cache/moe-fsm/vllm-0.33.0); when absent the wheel is fetched
with ``pip download vllm==0.33.0 --no-deps`` and unpacked there.

Adding a family: one ``FamilyTable`` row in ``FAMILIES`` (which oracle function,
how to build its arguments from a scenario, how to read its result) plus a
scenario generator in ``tools/parity_grid.py``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import zipfile
from collections import Counter
from pathlib import Path

from parity_table import FamilyTable

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(HERE))

VLLM_VERSION = "0.33.0"  # --vllm-version sets these three
PROFILE = "vllm-0.33"
DEFAULT_CACHES = (Path("/work/cache/vllm/src"), Path.home() / ".cache" / "moe-fsm" / f"vllm-{VLLM_VERSION}")


def use_version(version: str) -> None:
    """Compare with vLLM ``version``'s oracles, under the moe-fsm profile written for that release."""
    global VLLM_VERSION, PROFILE, DEFAULT_CACHES
    from moe_fsm import profiles

    wanted = profiles.version_tuple(version)
    matches = [p for p in profiles.profiles().values()
               if p.vllm_version is not None and wanted[:len(p.vllm_version)] == p.vllm_version]
    if len(wanted) < 2 or not matches:
        known = sorted(".".join(map(str, p.vllm_version)) for p in profiles.profiles().values() if p.vllm_version)
        raise SystemExit(f"--vllm-version {version!r}: moe-fsm has no profile for it (profiles exist for {known})")
    VLLM_VERSION, PROFILE = version, matches[0].name
    caches = [Path.home() / ".cache" / "moe-fsm" / f"vllm-{version}"]
    DEFAULT_CACHES = ((Path("/work/cache/vllm/src"), *caches) if version == "0.33.0" else tuple(caches))


# ---------------------------------------------------------------------------
# The vLLM source
# ---------------------------------------------------------------------------

def ensure_vllm_source(cache: Path | None) -> Path:
    """The directory holding vLLM ``VLLM_VERSION``'s ``vllm`` package; downloaded and unpacked when absent."""
    candidates = [cache] if cache else list(DEFAULT_CACHES)
    for path in candidates:
        if (path / "vllm" / "model_executor" / "layers" / "fused_moe" / "oracle").is_dir():
            return path
    target = candidates[-1] if cache is None else cache
    target.mkdir(parents=True, exist_ok=True)
    wheels = sorted(target.glob(f"vllm-{VLLM_VERSION}-*.whl"))
    if not wheels:
        print(f"downloading vllm=={VLLM_VERSION} (wheel only, no dependencies) into {target}", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "download", f"vllm=={VLLM_VERSION}", "--no-deps",
                        "-d", str(target)], check=True)
        wheels = sorted(target.glob(f"vllm-{VLLM_VERSION}-*.whl"))
    with zipfile.ZipFile(wheels[0]) as wheel:
        members = [m for m in wheel.namelist() if m.startswith("vllm/") and not m.endswith(".so")]
        wheel.extractall(target, members)
    return target


# ---------------------------------------------------------------------------
# One table row per family: which oracle, its arguments, its result
# ---------------------------------------------------------------------------

def _quant_keys(vllm, inputs):
    return vllm.quant_key(inputs.layer.quant.weight), vllm.quant_key(inputs.layer.quant.activation)


FAMILIES: dict[str, FamilyTable] = {t.family: t for t in (
    FamilyTable("unquantized", "vllm.model_executor.layers.fused_moe.oracle.unquantized",
                "select_unquantized_moe_backend", lambda vllm, inputs, config: ()),
    FamilyTable("fp8", "vllm.model_executor.layers.fused_moe.oracle.fp8", "select_fp8_moe_backend",
                lambda vllm, inputs, config: (*_quant_keys(vllm, inputs), inputs.layer.allow_vllm_cutlass)),
    FamilyTable("nvfp4", "vllm.model_executor.layers.fused_moe.oracle.nvfp4", "select_nvfp4_moe_backend",
                lambda vllm, inputs, config: _quant_keys(vllm, inputs)),
)}


# ---------------------------------------------------------------------------
# Answers: the same shape from both sides
# ---------------------------------------------------------------------------

def vllm_answer(vllm, scenario: dict) -> dict:
    from moe_fsm.errors import InputError

    try:
        inputs = moe_fsm_inputs(scenario)
    except InputError as err:
        return {"outcome": "invalid", "message": str(err)}
    table = FAMILIES[inputs.layer.quant.family.value]
    with vllm.facts(inputs, scenario.get("env", {})):
        try:
            config = vllm.moe_config(inputs)
            oracle = getattr(vllm.module(table.module), table.function)
            value = oracle(config, *table.arguments(vllm, inputs, config))
        except (ValueError, NotImplementedError) as err:
            return {"outcome": "failed", "error": _error_kind(err), "message": str(err)}
    backend, kernel = table.result(value)
    if backend == "NONE":
        return {"outcome": "fallback_none", "backend": "NONE"}
    return {"outcome": "selected", "backend": backend, "kernel": kernel}


def _error_kind(err: BaseException) -> str:
    return "NotImplementedError" if isinstance(err, NotImplementedError) else "ValueError"


def moe_fsm_inputs(scenario: dict):
    from dataclasses import replace

    from moe_fsm import profiles
    from moe_fsm.decision import inputs_from_spec

    spec = {k: scenario[k] for k in ("layer", "parallel", "backend", "env", "platform") if k in scenario}
    spec.setdefault("env", {})
    return replace(inputs_from_spec(spec), profile=profiles.ProfileChoice(PROFILE, "parity harness"))


def moe_fsm_answer(scenario: dict) -> dict:
    from moe_fsm.decision import decide
    from moe_fsm.errors import EnvVarError, InputError, NoBackendError, SelectionError

    try:
        decision = decide(moe_fsm_inputs(scenario))
    except EnvVarError as err:
        return {"outcome": "failed", "error": "ValueError", "message": str(err), "env_error": True}
    except SelectionError as err:
        kind = "NotImplementedError" if isinstance(err, NoBackendError) else "ValueError"
        return {"outcome": "failed", "error": kind, "message": str(err), "path": err.trace["path"]}
    except InputError as err:
        return {"outcome": "invalid", "message": str(err)}
    path = decision.trace["path"]
    if decision.backend == "NONE":
        return {"outcome": "fallback_none", "backend": "NONE", "path": path}
    return {"outcome": "selected", "backend": decision.backend, "kernel": decision.kernel, "path": path}


def same(a: dict, b: dict) -> bool:
    keys = ("outcome", "backend", "kernel", "error")
    return all(a.get(k) == b.get(k) for k in keys)


# ---------------------------------------------------------------------------
# Declared differences: few, each with a reason a user would accept
# ---------------------------------------------------------------------------

def load_declared() -> list[dict]:
    path = HERE / "vllm_parity_declared.json"
    return json.loads(path.read_text())["declared"] if path.exists() else []


def declared_reason(scenario: dict, theirs: dict, ours: dict, declared: list[dict]) -> str | None:
    for entry in declared:
        if _matches(entry.get("when", {}), scenario, theirs, ours):
            return entry["id"]
    return None


def _matches(when: dict, scenario: dict, theirs: dict, ours: dict) -> bool:
    for key, wanted in when.items():
        if key == "ours_env_error":
            if bool(ours.get("env_error")) != wanted:
                return False
        elif key == "env_value_in":
            if not any(v in wanted for v in scenario.get("env", {}).values()):
                return False
        elif key == "theirs_outcome":
            if theirs.get("outcome") != wanted:
                return False
        elif key == "ours_outcome":
            if ours.get("outcome") != wanted:
                return False
        elif key == "ours_message_contains":
            if wanted not in ours.get("message", ""):
                return False
        elif key == "theirs_message_contains":
            if wanted not in theirs.get("message", ""):
                return False
        else:
            raise ValueError(f"declared difference condition {key!r} is unknown")
    return True


# ---------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------

def golden_file_scenarios(path: Path) -> list[dict]:
    """A golden scenario file's rows as grid scenarios (with their name and expectation kept for the report)."""
    import tomllib

    rows = tomllib.loads(path.read_text())["scenario"]
    out = []
    for row in rows:
        scenario = {k: row[k] for k in ("platform", "layer", "parallel", "backend", "env") if k in row}
        scenario.setdefault("parallel", {})
        scenario.setdefault("backend", "auto")
        scenario.setdefault("env", {})
        scenario["layer"] = {"quant": "unquantized", **scenario["layer"]} if "quant" not in scenario["layer"] else scenario["layer"]
        out.append(scenario)
    return out


def describe(scenario: dict) -> str:
    return json.dumps({k: scenario[k] for k in ("platform", "layer", "parallel", "backend", "env") if k in scenario},
                      sort_keys=True)


def main(argv: list[str] | None = None) -> int:
    import parity_families  # the MX and integer families (tools/parity_families/)

    FAMILIES.update({t.family: t for t in parity_families.tables()})
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("0.33.0", "X.Y.Z"))
    parser.add_argument("--vllm-version", default=VLLM_VERSION, metavar="X.Y.Z",
                        help=f"the vLLM release whose oracles run (default {VLLM_VERSION}); moe-fsm decides under "
                             "the profile written for it (0.31.0 -> vllm-0.31, ...)")
    parser.add_argument("--cache", type=Path,
                        help="directory holding (or to receive) that vLLM's source (default: "
                             "~/.cache/moe-fsm/vllm-X.Y.Z; for 0.33.0 also /work/cache/vllm/src)")
    parser.add_argument("--family", action="append", choices=sorted(FAMILIES), help="only these families")
    parser.add_argument("--limit", type=int, help="only the first N scenarios (smoke runs)")
    parser.add_argument("--scenarios", type=Path, action="append", metavar="TOML",
                        help="instead of the grid, these golden scenario files' scenarios (checks hand-written "
                             "expectations against vLLM's own answers)")
    parser.add_argument("--vllm-only", action="store_true", help="only vLLM's answers (no moe-fsm)")
    parser.add_argument("--json", type=Path, help="write every scenario with both answers to this file")
    parser.add_argument("--show", type=int, default=50, help="print at most N disagreements (default 50)")
    parser.add_argument("--config-path", action="store_true",
                        help="compare vLLM's reading of checkpoint quantization configs (tests/data/configs/ and "
                             "variants) and the oracle after it with moe-fsm plan (parity_families/config_path.py)")
    parser.add_argument("--fixture", action="append", help="with --config-path: only these fixtures")
    parser.add_argument("--write-golden", type=Path, metavar="TOML",
                        help="write golden scenarios whose expectations are vLLM's answers (see golden_scenarios)")
    args = parser.parse_args(argv)
    use_version(args.vllm_version)
    parity_families.use_profile(PROFILE)

    import parity_grid

    source = ensure_vllm_source(args.cache)
    sys.path.insert(0, str(source))

    vllm = parity_families.Faked(families=[FAMILIES[f].module for f in FAMILIES])
    if args.config_path:
        return config_path_main(vllm, args, source)
    chosen = args.family or sorted(FAMILIES)
    scenarios = parity_grid.grid([f for f in chosen if f in parity_grid.LAYERS]) + parity_families.grid(
        [f for f in chosen if f in parity_families.FAMILIES])
    if args.scenarios:
        scenarios = [s for path in args.scenarios for s in golden_file_scenarios(path)
                     if s["layer"].get("quant", "unquantized") in chosen]
    if args.limit:
        scenarios = scenarios[: args.limit]
    declared = load_declared()

    rows, counts, by_family = [], Counter(), {}
    shown = 0
    for scenario in scenarios:
        theirs = vllm_answer(vllm, scenario)
        row = {"scenario": scenario, "vllm": theirs}
        if not args.vllm_only:
            ours = moe_fsm_answer(scenario)
            row["moe_fsm"] = ours
            if same(theirs, ours):
                verdict = "agree"
            else:
                reason = declared_reason(scenario, theirs, ours, declared)
                verdict = "declared" if reason else "disagree"
                if reason:
                    row["declared"] = reason
            row["verdict"] = verdict
            counts[verdict] += 1
            fam = scenario["layer"].get("quant", "unquantized")
            by_family.setdefault(fam, Counter())[verdict] += 1
            if verdict == "disagree" and shown < args.show:
                shown += 1
                print(f"DISAGREE {describe(scenario)}\n  vllm:    {json.dumps(theirs)}\n  moe-fsm: {json.dumps(ours)}")
        else:
            counts[theirs["outcome"]] += 1
        rows.append(row)

    if args.json:
        args.json.write_text(json.dumps(rows, indent=1, sort_keys=True))
    if args.write_golden:
        import golden_writer

        written = golden_writer.write(args.write_golden, rows, VLLM_VERSION, PROFILE)
        print(f"wrote {written} golden scenarios (expectations: vLLM {VLLM_VERSION}'s answers) to {args.write_golden}")
    print(f"\nvLLM {VLLM_VERSION} (source {source}) vs moe-fsm profile {PROFILE}: {len(scenarios)} scenarios")
    if args.vllm_only:
        print("vLLM outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
        return 0
    for fam, c in sorted(by_family.items()):
        print(f"  {fam:12s} agree {c['agree']:5d}   declared difference {c['declared']:4d}   disagree {c['disagree']:4d}")
    print(f"  {'total':12s} agree {counts['agree']:5d}   declared difference {counts['declared']:4d}   "
          f"disagree {counts['disagree']:4d}")
    used = Counter(r["declared"] for r in rows if r.get("declared"))
    for entry in declared:
        print(f"  declared {entry['id']} ({used.get(entry['id'], 0)} scenarios): {entry['reason']}")
    return 1 if counts["disagree"] else 0


def config_path_main(vllm, args, source: Path) -> int:
    """--config-path: vLLM's own config reading and MoE method per layer against moe-fsm plan (one release)."""
    from parity_families import config_path

    declared = load_declared()
    rows, counts, by_fixture, scenarios = config_path.run(
        vllm, PROFILE, lambda scenario, theirs, ours: declared_reason(scenario, theirs, ours, declared),
        limit=args.limit, show=args.show, only=args.fixture)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1, sort_keys=True))
    print(f"\nvLLM {VLLM_VERSION} config path (source {source}) vs moe-fsm plan under {PROFILE}: {scenarios} scenarios, "
          f"{len(rows)} layers compared")
    for fixture, c in sorted(by_fixture.items()):
        print(f"  {fixture:34s} agree {c['agree']:5d}   declared difference {c['declared']:4d}   disagree {c['disagree']:4d}")
    print(f"  {'total':34s} agree {counts['agree']:5d}   declared difference {counts['declared']:4d}   "
          f"disagree {counts['disagree']:4d}")
    used = Counter(r["declared"] for r in rows if r.get("declared"))
    for entry in declared:
        if used.get(entry["id"]):
            print(f"  declared {entry['id']} ({used[entry['id']]} layers): {entry['reason']}")
    return 1 if counts["disagree"] else 0


if __name__ == "__main__":
    sys.exit(main())
