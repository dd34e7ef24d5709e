"""The newcomer's path: a short README with the set-up, the library's examples, packaging, a tree without session names.

The README's set-up commands install torch's CPU build first, as .ci/run does; the README stays short (the
reference lives in docs/); the library examples of docs/integrations.md run as shown; what pyproject declares
exists and what the code needs is declared; no file is named after an issue.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
README_MAX_LINES = 150
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
CPU_INDEX = "--extra-index-url https://download.pytorch.org/whl/cpu"


def _blocks(lang: str, section: str | None = None, page: str = README) -> list[str]:
    text = page
    if section is not None:
        text = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(rf"```{lang}\n(.*?)```", text, re.DOTALL)


def test_setup_commands_install_the_cpu_torch_build_before_the_package():
    setup = _blocks("bash")[:2]
    assert len(setup) == 2
    for command in setup:
        first, *rest = command.strip().split(" && ")
        assert first == f"pip install torch==2.13.0 {CPU_INDEX}", command
        assert rest[0].startswith("pip install -e ")
    assert setup[1].strip().endswith("&& python3 -m pytest -q")
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python3 -m venv" in ci and "--system-site-packages" not in ci, \
        "CI installs into a fresh virtual environment, so packages installed by hand on its machine stay out"
    assert ci.index("python3 -m venv") < ci.index("torch==2.13.0") < ci.index("-e '.[test]'")
    assert "\npython3 -m pytest -q\n" in ci, "CI runs the README's test command, exactly"
    assert "\nMOE_FSM_PLATFORM=cpu-x86 python3 -m pytest" in ci, "CI runs the suite again as an x86 CPU without AMX"


def test_readme_is_short():
    """The README says what moe-fsm is, the two set-up commands and one example a verb; the reference is in docs/."""
    lines = README.count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines, at most {README_MAX_LINES}: move the detail to docs/"


def test_library_examples_run_as_shown(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    page = (ROOT / "docs" / "integrations.md").read_text()
    examples = _blocks("python", section="As a library", page=page)
    assert len(examples) == 3
    for code in examples:
        exec(compile(code, "docs/integrations.md", "exec"), {})
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == ["CPU TorchExperts", "torch.Size([4, 256])"]
    assert out[2] == "FLASHINFER_B12X"
    assert out[3] == "FlashInferB12xExperts decided; runs as moe-fsm torch experts (stand-in)"
    assert "which moe-fsm models for selection but cannot run" in out[4]
    assert (tmp_path / "traces" / "layer0.json").exists()
    # the engine: four identical layers, one decision and one trace; layer_traces lists (layer, trace) in load order
    assert out[5:] == ["CPU True", "model.layers.1.mlp.experts traces/engine/layer000-model.layers.0.mlp.experts.json"]
    assert [p.name for p in (tmp_path / "traces" / "engine").glob("*.json")] == ["layer000-model.layers.0.mlp.experts.json"]


def _tracked_files() -> list[str]:
    """The repository's files: git's list where this is a checkout, else every file outside caches and environments."""
    try:
        done = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    except OSError:
        done = None
    if done is not None and done.returncode == 0 and done.stdout:
        return done.stdout.splitlines()
    skip = {".git", ".venv", "__pycache__", ".pytest_cache", ".hypothesis", "build", "dist"}
    return [str(p.relative_to(ROOT)) for p in ROOT.rglob("*")
            if p.is_file() and not any(part in skip or part.endswith(".egg-info") for part in p.relative_to(ROOT).parts)]


def test_no_file_is_named_after_an_issue_or_a_session():
    """Files say what they hold; which issue or session made them is git history's to keep."""
    named = [f for f in _tracked_files() if re.search(r"issue|session|scratch", f, re.IGNORECASE)]
    assert not named, f"files named after an issue, a session or as scratch: {named}"


def test_numpy_is_declared_so_torch_does_not_warn_at_import():
    assert any(re.match(r"numpy\b", dep) for dep in PYPROJECT["project"]["dependencies"])
    done = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True, text=True, timeout=120)
    assert "Failed to initialize NumPy" not in done.stderr


def test_python_requirement_has_tomllib():
    uses_tomllib = [p for p in (ROOT / "src").rglob("*.py") if re.search(r"^\s*import tomllib", p.read_text(), re.M)]
    spec = PYPROJECT["project"]["requires-python"]
    assert not uses_tomllib or re.fullmatch(r">=\s*3\.(1[1-9]|[2-9]\d)", spec), (spec, uses_tomllib)


def test_declared_package_data_exists():
    package = ROOT / "src" / "moe_fsm"
    for pattern in PYPROJECT["tool"]["setuptools"]["package-data"]["moe_fsm"]:
        assert list(package.glob(pattern)), f"package-data {pattern!r} matches no file"
