"""Golden scenarios for a release profile, with expectations taken from vLLM's own answers.

Used by ``tools/vllm_parity.py --write-golden``: from the parity grid it keeps,
per family, one scenario for every distinct answer vLLM gives (backend, experts
class, error type) on every platform, in grid order (which visits every backend
name, every env variable and every layer and parallel variant), and writes them
as ``[[scenario]]`` tables whose ``expect`` / ``expect_kernel`` / ``expect_message``
are what vLLM's oracle function returned or raised. Scenarios where the two
sides differ by a declared difference are left out (their expectation would be
vLLM's, not the profile's).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

ERRORS = {"ValueError": "BackendUnsupportedError", "NotImplementedError": "NoBackendError"}
PER_FAMILY_MIN = 60


def _expect(answer: dict) -> str:
    if answer["outcome"] == "failed":
        return f"failed:{ERRORS[answer['error']]}"
    return f"{answer['outcome']}:{answer['backend']}"


def _message(theirs: dict, ours: dict) -> str | None:
    """vLLM's message up to its reason, when moe-fsm's says the same words."""
    text = theirs.get("message", "")
    head = re.split(r" since |\\. Expected one of|\\. Rejected", text)[0].rstrip(".")
    return head if head and head in ours.get("message", "") else None


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in sorted(value.items())) + " }"
    return json.dumps(str(value))


def _name(scenario: dict, answer: dict, seen: set) -> str:
    family = {"unquantized": "unq"}.get(scenario["layer"]["quant"], scenario["layer"]["quant"])
    result = answer.get("backend") or answer.get("error")
    platform = scenario["platform"]
    if not isinstance(platform, str):
        base = platform.get("preset") or "sm" + "".join(map(str, platform.get("capability") or ())) or platform["vendor"]
        platform = "-".join([base, *platform.get("add_libraries", ())])
    base = re.sub(r"[^a-z0-9.-]+", "-", f"{family}-{platform}-{scenario['backend']}-{result}".lower())
    name, n = base, 2
    while name in seen:
        name, n = f"{base}-{n}", n + 1
    seen.add(name)
    return name


def choose(rows: list[dict]) -> list[dict]:
    """Per family: every path through the machine with every vLLM answer, then every answer per platform."""
    chosen, keys = [], set()
    by_family: dict[str, int] = {}
    usable = [r for r in rows if r.get("verdict") == "agree" and r["vllm"]["outcome"] != "invalid"
              and not r["moe_fsm"].get("env_error")]

    def answer(row):
        v = row["vllm"]
        return (row["scenario"]["layer"]["quant"], v["outcome"], v.get("backend"), v.get("kernel"), v.get("error"))

    passes = (
        lambda row: answer(row) + tuple(row["moe_fsm"].get("path", ())),
        lambda row: answer(row) + (json.dumps(row["scenario"]["platform"], sort_keys=True),),
        lambda row: answer(row) + tuple(sorted(row["scenario"]["env"].items())),
    )
    for number, key_of in enumerate(passes):
        for row in usable:
            key = (number, key_of(row))
            family = row["scenario"]["layer"]["quant"]
            if key in keys or (number == 2 and by_family.get(family, 0) >= PER_FAMILY_MIN):
                continue
            keys.add(key)
            if row in chosen:
                continue
            by_family[family] = by_family.get(family, 0) + 1
            chosen.append(row)
    return chosen


def write(path: Path, rows: list[dict], version: str, profile: str = "vllm-0.33") -> int:
    chosen = choose(rows)
    seen: set = set()
    lines = [
        f"# Golden scenarios of the {profile} profile: expectations are vLLM {version}'s own answers.",
        "#",
        "# Written by tools/vllm_parity.py --write-golden (tools/golden_writer.py): each scenario ran vLLM's",
        "# select_*_moe_backend on these machine facts, and `expect` / `expect_kernel` / `expect_message` are what",
        "# it returned or raised (ValueError -> BackendUnsupportedError, NotImplementedError -> NoBackendError).",
        f"# Regenerate the traces with: moe-fsm golden --update --profile {profile}",
        "",
    ]
    for row in chosen:
        s, v = row["scenario"], row["vllm"]
        lines.append("[[scenario]]")
        lines.append(f"name = {_toml_value(_name(s, v, seen))}")
        lines.append(f"about = {_toml_value('vLLM ' + version + ': ' + (v.get('message') or v.get('kernel') or v.get('backend') or '')[:160])}")
        lines.append(f"platform = {_toml_value(s['platform'])}")
        lines.append(f"layer = {_toml_value(s['layer'])}")
        if s["parallel"]:
            lines.append(f"parallel = {_toml_value(s['parallel'])}")
        lines.append(f"backend = {_toml_value(s['backend'])}")
        if s["env"]:
            lines.append(f"env = {_toml_value(s['env'])}")
        lines.append(f"expect = {_toml_value(_expect(v))}")
        if v.get("kernel"):
            lines.append(f"expect_kernel = {_toml_value(v['kernel'])}")
        message = _message(v, row.get("moe_fsm", {})) if v["outcome"] == "failed" else None
        if message:
            lines.append(f"expect_message = {_toml_value(message)}")
        lines.append("")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    return len(chosen)
