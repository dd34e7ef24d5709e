"""The newcomer's path (issue 12, items 14-16 and 18): the README's set-up and examples, and packaging.

The README's examples run as shown; its set-up commands install torch's CPU
build first, as .ci/run does; what pyproject declares exists and what the code
needs is declared.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
CPU_INDEX = "--extra-index-url https://download.pytorch.org/whl/cpu"


def _blocks(lang: str, section: str | None = None) -> list[str]:
    text = README
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


def test_readme_library_examples_run_as_shown(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    examples = _blocks("python", section="As a library")
    assert len(examples) == 2
    for code in examples:
        exec(compile(code, "README.md", "exec"), {})
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == ["CPU TorchExperts", "torch.Size([4, 256])"]
    assert out[2] == "FLASHINFER_B12X"
    assert out[3] == "FlashInferB12xExperts decided; runs as moe-fsm torch experts (stand-in)"
    assert "which moe-fsm models for selection but cannot run" in out[4]
    assert (tmp_path / "traces" / "layer0.json").exists()


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
