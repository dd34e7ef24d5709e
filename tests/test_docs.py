"""The docs show real things: the trace example is a golden file, snippets come from golden traces,
and the plugin example registers a working backend (the state diagram: tests/test_cli.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
GOLDEN = ROOT / "traces" / "seeds" / "golden"
BLOCK = re.compile(r"(?:<!-- golden: (?P<golden>[\w.-]+) -->\n)?```(?P<lang>\w+)\n(?P<body>.*?)```", re.DOTALL)


def _blocks(name: str, lang: str):
    text = (DOCS / name).read_text()
    return [(m.group("golden"), m.group("body")) for m in BLOCK.finditer(text) if m.group("lang") == lang]


def _golden_parts():
    events, outcomes = [], []
    for path in GOLDEN.glob("*.json"):
        document = json.loads(path.read_text())
        events.extend(document["events"])
        outcomes.append(document["outcome"])
        if document.get("build"):
            outcomes.append(document["build"])
    return events, outcomes


def test_traces_md_example_is_a_golden_file_and_valid():
    schema = pytest.importorskip("moe_fsm.trace.schema")
    pytest.importorskip("jsonschema")
    full = [(name, body) for name, body in _blocks("traces.md", "json") if name]
    assert full, "docs/traces.md has no <!-- golden: NAME --> example"
    for name, body in full:
        assert body == (GOLDEN / f"{name}.json").read_text(), f"the example of {name} differs from its golden file"
        assert schema.errors(json.loads(body)) == []


def test_traces_md_snippets_come_from_golden_traces():
    events, outcomes = _golden_parts()
    for name, body in _blocks("traces.md", "json"):
        if name:
            continue
        data = json.loads(body)
        for item in data if isinstance(data, list) else [data]:
            if "pid" in item:  # the volatile example
                assert set(item) == {"started_at", "duration_us", "host", "pid", "moe_fsm_version", "python"}
                continue
            assert item in events or item in outcomes, f"snippet not found in any golden trace: {item}"


def test_architecture_plugin_example_registers_a_working_backend():
    from moe_fsm.backends.registry import Registry
    from moe_fsm.decision import decide, make_inputs
    from moe_fsm.inputs.layer import MoELayer
    from moe_fsm.inputs.platform import preset
    from moe_fsm.inputs.quant import QuantScheme

    (_, code), = _blocks("architecture.md", "python")
    namespace: dict = {}
    exec(compile(code, "docs/architecture.md", "exec"), namespace)
    registry = Registry.builtin_only()
    namespace["register"](registry)
    layer = MoELayer(quant=QuantScheme.fp8())
    assert decide(make_inputs(layer, None, "auto", {}, preset("oot")), registry=registry).backend == "MY_BACKEND"
    assert decide(make_inputs(layer, None, "my_backend", {}, preset("oot")), registry=registry).backend == "MY_BACKEND"



COMMAND_PAGES = ("README.md", "docs/guide-commands.md")
TIME_COLUMN = re.compile(r"\b\d+\.\d{2}\b")  # run's "time ms" column: the only figure that changes between runs


def _shown_commands(page: str):
    """Each `$ moe-fsm ...` of a page's text blocks, with the lines shown under it ('...' elides output)."""
    text = (ROOT / page).read_text()
    for block in re.findall(r"```text\n(.*?)```", text, re.DOTALL):
        for chunk in re.split(r"^(?=\$ )", block.replace(" \\\n", " "), flags=re.M):
            if chunk.startswith("$ moe-fsm "):
                command, *shown = chunk.rstrip("\n").split("\n")
                yield command[len("$ moe-fsm "):], [line for line in shown if line.strip() != "..."]


def _normalized(line: str) -> str:
    return " ".join(TIME_COLUMN.sub("#", line).split())


@pytest.mark.parametrize("page", COMMAND_PAGES)
def test_command_examples_print_what_they_show(page, tmp_path, monkeypatch, capsys):
    """Every command a page shows runs, in the page's order and one directory, and prints every line shown under it."""
    import shlex

    from moe_fsm.cli.main import main

    (tmp_path / "tests").symlink_to(ROOT / "tests")  # the examples name the repository's fixtures by relative path
    monkeypatch.chdir(tmp_path)
    commands = list(_shown_commands(page))
    assert {c.split()[0] for c, _ in commands} >= {"select", "explain", "replay", "diff", "plan", "run"}
    for command, shown in commands:
        code = main(shlex.split(command))
        out = capsys.readouterr().out
        assert code in (0, 1, 3), f"{page}: `moe-fsm {command}` exited {code}"
        printed = {_normalized(line) for line in out.splitlines()}
        for line in shown:
            assert _normalized(line) in printed, f"{page}: `moe-fsm {command}` does not print {line!r}"


def test_pages_name_files_that_exist():
    """Links between the pages, and the docs/, bench/ and tools/ files they name, point at files of the tree."""
    pages = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
    missing = []
    for page in pages:
        text = page.read_text()
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if "://" not in target and not (page.parent / target).exists():
                missing.append(f"{page.relative_to(ROOT)}: link {target}")
        for path in re.findall(r"`((?:docs|bench|tools)/[\w./-]+\.(?:md|py|sh|json|png))`", text):
            if not (ROOT / path).exists():
                missing.append(f"{page.relative_to(ROOT)}: {path}")
    assert not missing, missing
