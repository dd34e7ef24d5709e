"""Parity of the sglang-0.5.23 profile with SGLang 0.5.23's own MoE runner resolution (maintainer script, not CI).

Generates scenarios (tools/sglang_parity_grid.py), decides each under moe-fsm's sglang-0.5.23 profile here, and
asks SGLang's own code for its answer in an isolated venv (tools/sglang_parity_worker.py: SGLang's argparse,
the MoE hooks of its server-argument pipeline, its FusedMoE constructor and quantization methods, on a faked
machine), one worker process per faked machine. Compares the layer's runner (``get_moe_runner_backend``), the
runner and all-to-all backend the layer was built under, ``ep_size``, and where a refusal happens (argparse,
server arguments, the layer). Differences listed in tools/sglang_parity_declared.json are counted apart; any
other is a disagreement (exit 1). docs/sglang-parity.md says how to set the venv up and what is faked.

    python tools/sglang_parity.py --python /work/venvs/sglangparity/bin/python --source /path/to/sglang-src
    python tools/sglang_parity.py ... --json out.json --write-golden traces/sglang-0.5.23/scenarios/parity.toml
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tools"))

from moe_fsm.decision import decide, inputs_from_spec  # noqa: E402
from moe_fsm.errors import InputError, SelectionError  # noqa: E402
from moe_fsm.inputs.quant import Granularity  # noqa: E402
from moe_fsm.profiles.sglang_0_5_23.layer import method_name  # noqa: E402
from moe_fsm.profiles.sglang_0_5_23.pipeline import checkpoint_method  # noqa: E402
from sglang_parity_grid import grid  # noqa: E402

PROFILE = "sglang-0.5.23"
VERSION = "0.5.23"
IMPORT_ENV = ("SGLANG_USE_AITER", "SGLANG_INT4_WEIGHT", "SGLANG_ENABLE_JIT_DEEPGEMM")  # read when modules import
DECLARED = json.loads((ROOT / "tools" / "sglang_parity_declared.json").read_text())
SERVER_STATES = {"lora_layer", "mega_moe", "model_override", "quant_constraint", "runner_quant_check",
                 "a2a_constraint", "speculative_default"}


# -- moe-fsm's side -------------------------------------------------------------------------------------------

class _Run:
    """What method_name and checkpoint_method read of a decision: its inputs' context and resolved arguments."""

    def __init__(self, ctx, resolved):
        self.ctx, self.resolved = ctx, resolved


def ours(item: dict) -> dict:
    spec = {"layer": item["layer"], "parallel": item["parallel"], "backend": item["backend"], "env": item["env"],
            "platform": item["platform"], "policy": PROFILE}
    try:
        inputs = inputs_from_spec(spec)
    except InputError as err:
        return {"outcome": "input_error", "message": str(err)}
    try:
        decision = decide(inputs, trace=True)
        document = decision.trace
    except InputError as err:  # an env value the profile's parser refuses
        return {"outcome": "input_error", "message": str(err), "inputs": inputs}
    except SelectionError as err:
        document = err.trace
    outcome = document["outcome"]
    answer = {"outcome": outcome["status"], "inputs": inputs, "path": document["path"],
              "resolved": outcome.get("resolved", {})}
    if outcome["status"] == "failed":
        answer.update(error=outcome["error"]["type"], message=outcome["error"]["message"],
                      state=document["path"][-2])
    else:
        answer.update(backend=outcome["backend"], kernel=outcome["kernel"])
    return answer


# -- what the worker is told ----------------------------------------------------------------------------------

def machine_of(inputs) -> dict:
    p = inputs.platform
    machine = {"vendor": p.vendor.value, "capability": list(p.capability) if p.capability else None,
               "gcn_arch": p.gcn_arch, "libraries": sorted(lib.value for lib in p.libraries), "cpu_amx": p.cpu_amx}
    env = dict(inputs.env.raw)
    machine["import_env"] = {name: env[name] for name in IMPORT_ENV if name in env}
    return machine


def worker_scenario(inputs) -> dict:
    layer, parallel = inputs.layer, inputs.parallel
    quant, facts = layer.quant, layer.model
    granularity = {Granularity.BLOCK_128x128: "block", Granularity.CHANNEL: "channel", Granularity.TENSOR: "tensor",
                   Granularity.GROUP_1x128: "group", Granularity.TOKEN: "token"}
    ctx = type("Ctx", (), {"layer": layer})()
    run = _Run(ctx, {"quantization": None if facts is None or facts.quantization in (None, "unquant")
                     else facts.quantization})
    declared = checkpoint_method(run)
    run.resolved["quant_method"] = declared
    layer_facts = {"family": layer.family.value, "num_experts": layer.num_experts, "top_k": layer.top_k,
                   "hidden_size": layer.hidden_size, "intermediate_size": layer.intermediate_size,
                   "activation": layer.activation.value, "swiglu_limit": layer.swiglu_limit, "bias": layer.bias}
    if quant.weight is not None and quant.family.value == "fp8":
        layer_facts.update(fp8_weight=granularity[quant.weight.granularity],
                           fp8_act=granularity[quant.activation.granularity], static_act=quant.activation.static)
    if quant.family.value == "nvfp4":
        layer_facts["weight_only"] = quant.activation is None
    if quant.family.value == "int_wna16":
        layer_facts.update(bits=quant.weight_bits, group_size=quant.group_size, zero_point=quant.zero_point,
                           act_order=quant.act_order)
    return {"backend": inputs.request.default,
            "parallel": {"tp_size": parallel.tp_size, "ep_size": parallel.ep_size, "dp_size": parallel.dp_size,
                         "a2a_backend": parallel.a2a_backend, "deepep_mode": parallel.deepep_mode},
            "model": {"architecture": facts.architecture if facts else None,
                      "quantization": facts.quantization if facts else None, "draft": bool(facts and facts.draft)},
            "layer": layer_facts, "declared": declared, "method": method_name(run), "env": dict(inputs.env.raw)}


# -- SGLang's side --------------------------------------------------------------------------------------------

def sglang_source(path: str | None) -> Path:
    """SGLang's unpacked source: --source, else the cache (pip download sglang==0.5.23 --no-deps, unpacked)."""
    candidates = [Path(path)] if path else [Path("/work/cache/sglang/src"),
                                            Path.home() / ".cache" / "moe-fsm" / f"sglang-{VERSION}"]
    for candidate in candidates:
        if (candidate / "sglang" / "srt" / "server_args.py").is_file():
            return candidate
    target = candidates[-1]
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", f"sglang=={VERSION}", "--no-deps", "-d", tmp],
                       check=True)
        wheel = next(Path(tmp).glob("sglang-*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(target, [n for n in archive.namelist() if n.startswith("sglang/")])
    return target


def sglang_answers(python: str, source: Path, machine: dict, scenarios: list[dict]) -> list[dict]:
    with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
        env = {**os.environ, "PYTHONPATH": str(source)}
        for name in IMPORT_ENV:
            env.pop(name, None)
        done = subprocess.run([python, "-W", "ignore", str(ROOT / "tools" / "sglang_parity_worker.py"),
                               json.dumps(machine), out.name], input=json.dumps(scenarios), text=True, env=env,
                              capture_output=True)
        if done.returncode != 0:
            raise SystemExit(f"the SGLang worker failed for {machine}:\n{done.stderr[-4000:]}")
        return json.load(out)


# -- comparison -----------------------------------------------------------------------------------------------

def sglang_stage_of(state: str) -> str:
    if state == "explicit_runner":
        return "argparse"
    return "server" if state in SERVER_STATES else "layer"


def compare(theirs: dict, mine: dict) -> tuple[str, str]:
    """(agree | declared:<name> | disagree, why)."""
    if mine["outcome"] == "input_error":
        if not theirs["ok"] and theirs["error"] == "SystemExit":
            return "agree", "both refuse the input"
        return "declared:strict-env-parsing", mine["message"]
    if not theirs["ok"]:
        if mine["outcome"] != "failed":
            return "disagree", f"SGLang refuses ({theirs['stage']}: {theirs['error']}: {theirs['message'][:160]}), " \
                               f"moe-fsm selects {mine['backend']}"
        if sglang_stage_of(mine["state"]) != theirs["stage"]:
            if re.search(DECLARED["not-modelled"]["pattern"], mine["message"]):
                return "declared:not-modelled", mine["message"]
            return "disagree", f"both refuse, SGLang in {theirs['stage']} ({theirs['message'][:160]}), moe-fsm in " \
                               f"{mine['state']} ({mine['message'][:160]})"
        return "agree", "both refuse"
    if mine["outcome"] == "failed":
        for name in ("not-modelled", "fails-at-first-forward"):
            if re.search(DECLARED[name]["pattern"], mine["message"]):
                return f"declared:{name}", mine["message"]
        return "disagree", f"SGLang builds {theirs['layer_runner']}, moe-fsm refuses in {mine['state']}: " \
                           f"{mine['message'][:200]}"
    resolved = mine["resolved"]
    for name in ("layer_runner", "moe_runner_backend", "moe_a2a_backend", "ep_size"):
        if resolved.get(name) != theirs[name]:
            return "disagree", f"{name}: SGLang {theirs[name]!r}, moe-fsm {resolved.get(name)!r}"
    return "agree", f"{theirs['layer_runner']}"


# -- golden scenarios -----------------------------------------------------------------------------------------

def write_golden(rows: list[dict], path: Path) -> int:
    """Per family, one scenario for each distinct (SGLang answer, what runs, the state that decided, vendor) among
    agreeing rows, in grid order, as [[scenario]] tables whose expectation is SGLang's answer."""
    seen, chosen = set(), []
    for row in rows:
        if row["verdict"] != "agree" or row["ours"]["outcome"] == "input_error":
            continue
        mine, theirs = row["ours"], row["theirs"]
        answer = theirs.get("layer_runner") if theirs["ok"] else (theirs["stage"], theirs["error"])
        key = (row["family"], json.dumps(answer), mine.get("backend"), mine["path"][-2],
               _vendor(row["item"]["platform"]))
        if key not in seen:
            seen.add(key)
            chosen.append(row)
    names: set[str] = set()
    lines = [f"# Written by tools/sglang_parity.py --write-golden from SGLang {VERSION}'s own answers: per family, "
             "one scenario for every",
             "# distinct (answer, path) the grid reached; expect is what SGLang's code returned or refused.", ""]
    for row in chosen:
        item, mine, theirs = row["item"], row["ours"], row["theirs"]
        expect = f"selected:{mine['backend']}" if theirs["ok"] else f"failed:{mine['error']}"
        parts = (item["name"], _platform_name(item["platform"]), item["backend"], item["parallel"].get("a2a_backend"),
                 item["layer"].get("architecture"), mine.get("backend") or mine.get("state"))
        base = re.sub(r"[^a-z0-9.]+", "-", "-".join(str(x) for x in parts if x).lower()).strip("-")
        name, n = base, 2
        while name in names:
            name, n = f"{base}-{n}", n + 1
        names.add(name)
        lines += ["[[scenario]]", f"name = {json.dumps(name)}",
                  f"about = {json.dumps(_about(theirs))}",
                  f"platform = {_toml(item['platform'])}", f"layer = {_toml(item['layer'])}",
                  f"parallel = {_toml(item['parallel'])}", f"backend = {json.dumps(item['backend'])}"]
        if item["env"]:
            lines.append(f"env = {_toml(item['env'])}")
        lines.append(f"expect = {json.dumps(expect)}")
        if not theirs["ok"] and theirs["message"][:40] and theirs["message"][:40] in mine["message"]:
            lines.append(f"expect_message = {json.dumps(theirs['message'][:40])}")
        lines.append("")
    path.write_text("\n".join(lines))
    return len(chosen)


def _about(theirs: dict) -> str:
    if theirs["ok"]:
        return f"SGLang: {theirs['method']}, get_moe_runner_backend() = {theirs['layer_runner']}"
    return f"SGLang refuses ({theirs['stage']}): {theirs['error']}"


def _vendor(platform) -> str:
    name = _platform_name(platform)
    return "cuda" if name.startswith("sm") else name.split("-")[0]


def _platform_name(platform) -> str:
    return platform if isinstance(platform, str) else "-".join([platform["preset"], *platform["add_libraries"]])


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items() if v is not None) + " }"
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return json.dumps(str(value))


# -- main -----------------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default="/work/venvs/sglangparity/bin/python",
                        help="the isolated venv's python, where SGLang's dependencies are installed")
    parser.add_argument("--source", help=f"SGLang {VERSION}'s unpacked source (default: the cache, downloaded once)")
    parser.add_argument("--family", help="only this layer family")
    parser.add_argument("--random", type=int, default=1200, help="seeded random scenarios added to the grid")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write every row here")
    parser.add_argument("--write-golden", help="write golden scenarios (agreeing rows) to this TOML file")
    parser.add_argument("--rows", help="with --write-golden: take the rows of an earlier run's --json file instead "
                                       "of running the grid")
    args = parser.parse_args(argv)
    if args.rows:
        if not args.write_golden:
            raise SystemExit("--rows is read to write golden scenarios: give --write-golden FILE")
        count = write_golden(json.loads(Path(args.rows).read_text()), Path(args.write_golden))
        print(f"wrote {count} golden scenarios to {args.write_golden}")
        return 0

    started = time.time()
    source = sglang_source(args.source)
    rows, groups = [], collections.defaultdict(list)
    for item in grid(args.seed, args.random):
        if args.family and item["layer"]["quant"] != args.family:
            continue
        mine = ours(item)
        inputs = mine.get("inputs")
        if inputs is None:
            raise SystemExit(f"the grid made a scenario moe-fsm cannot read: {item}: {mine['message']}")
        row = {"item": item, "family": inputs.layer.family.value, "ours": mine}
        rows.append(row)
        groups[json.dumps(machine_of(inputs), sort_keys=True)].append(row)
    for machine, members in groups.items():
        answers = sglang_answers(args.python, source, json.loads(machine),
                                 [worker_scenario(row["ours"]["inputs"]) for row in members])
        for row, theirs in zip(members, answers):
            row["theirs"] = theirs
            row["verdict"], row["why"] = compare(theirs, row["ours"])

    counts = collections.defaultdict(collections.Counter)
    for row in rows:
        counts[row["family"]][row["verdict"].split(":")[0]] += 1
    print(f"SGLang {VERSION} (source {source}) vs moe-fsm profile {PROFILE}: {len(rows)} scenarios, "
          f"{len(groups)} faked machines, {time.time() - started:.0f} s")
    total = collections.Counter()
    for family in sorted(counts):
        c = counts[family]
        total.update(c)
        print(f"  {family:<12} agree {c['agree']:5}   declared difference {c['declared']:4}   "
              f"disagree {c['disagree']:4}")
    print(f"  {'total':<12} agree {total['agree']:5}   declared difference {total['declared']:4}   "
          f"disagree {total['disagree']:4}")
    declared = collections.Counter(row["verdict"] for row in rows if row["verdict"].startswith("declared:"))
    for name, count in sorted(declared.items()):
        print(f"  {name} ({count} scenarios): {DECLARED[name.split(':', 1)[1]]['why']}")
    for row in [r for r in rows if r["verdict"] == "disagree"][:40]:
        print(f"DISAGREE {row['family']} {json.dumps(row['item'], sort_keys=True)}\n    {row['why']}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump([{k: v for k, v in row.items() if k != "ours"} | {"ours": {
                k: v for k, v in row["ours"].items() if k != "inputs"}} for row in rows], out, indent=1)
    if args.write_golden:
        count = write_golden(rows, Path(args.write_golden))
        print(f"wrote {count} golden scenarios to {args.write_golden}")
    return 1 if total["disagree"] else 0


if __name__ == "__main__":
    sys.exit(main())
