"""bench/gpu.sh, the GPU machine's one entry point, on a machine without a GPU: its subcommands and its refusals.

What can be checked here is everything that happens before a GPU is touched: the subcommand table, the
refusals that must come before anything runs (NVLink multicast on, a malformed budget, an unknown phase), and
the suite's own refusal on a machine where it could only skip.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu.sh"
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="bench/gpu.sh is a bash script")
NVLINK_MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def gpu_sh(*args: str, env: dict[str, str] | None = None, cwd: Path = ROOT, timeout: float = 120):
    base = {k: v for k, v in os.environ.items() if k not in NVLINK_MULTICAST_OFF and k != "OUT"}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, cwd=cwd,
                          env={**base, **(env or {})}, timeout=timeout)


def dispatched_subcommands() -> list[str]:
    table = SCRIPT.read_text().split('case "$command" in', 1)[1]
    return [name for name in re.findall(r"^    ([a-z][a-z-]*)\)", table, re.M) if name != "help"]


def test_help_names_every_subcommand_the_script_dispatches():
    done = gpu_sh("--help")
    assert done.returncode == 0, done.stderr
    names = dispatched_subcommands()
    assert names == ["suite", "step", "distributed", "experts-vs-vllm", "hopper-prefill", "transformers",
                     "weight-quantized", "flashinfer-build"]
    for name in names:
        assert re.search(rf"^  {name}\b", done.stdout, re.M), f"--help does not describe {name}"


@pytest.mark.parametrize("args", [(), ("gpu_issue21",)])
def test_an_unknown_subcommand_is_one_line_naming_the_accepted_ones(args):
    done = gpu_sh(*args)
    assert done.returncode == 2 and done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert "unknown subcommand" in line and ", ".join(dispatched_subcommands()) in line


def test_it_finds_the_repository_wherever_it_is_called_from(tmp_path):
    here, there = gpu_sh("--help"), gpu_sh("--help", cwd=tmp_path)
    assert there.returncode == 0 and there.stdout == here.stdout


def test_distributed_refuses_to_start_unless_nvlink_multicast_is_off(tmp_path):
    out = tmp_path / "out"
    for name in NVLINK_MULTICAST_OFF:
        env = {**NVLINK_MULTICAST_OFF, "OUT": str(out)}
        del env[name]
        done = gpu_sh("distributed", env=env)
        assert done.returncode == 3
        assert f"refusing to run: {name} is '<unset>'" in done.stderr
        assert not out.exists(), "nothing is written before the refusal"


def test_distributed_needs_an_output_directory():
    done = gpu_sh("distributed", env=NVLINK_MULTICAST_OFF)
    assert done.returncode == 2 and "set OUT" in done.stderr


@pytest.mark.parametrize("name", ["TESTS_S", "BENCH_S"])
def test_distributed_refuses_a_step_limit_that_is_not_seconds(tmp_path, name):
    out = tmp_path / "out"
    done = gpu_sh("distributed", env={**NVLINK_MULTICAST_OFF, "OUT": str(out), name: "2m"})
    assert done.returncode == 2 and f"{name} is '2m'" in done.stderr and "BENCH_S=0: no benchmark" in done.stderr
    assert not out.exists(), "nothing is written before the refusal"


def test_weight_quantized_refuses_a_budget_that_is_not_seconds(tmp_path):
    done = gpu_sh("weight-quantized", "ten", env={"OUT": str(tmp_path / "out")})
    assert done.returncode == 2 and "BUDGET_S is 'ten'" in done.stderr
    assert not (tmp_path / "out").exists()


def test_flashinfer_build_names_its_two_phases(tmp_path):
    done = gpu_sh("flashinfer-build", "begin", env={"OUT": str(tmp_path)})
    assert done.returncode == 2 and "say start or follow, not 'begin'" in done.stderr


def test_suite_refuses_a_machine_where_it_could_only_skip(tmp_path):
    """Without CUDA (or without Triton and pytest-timeout) the GPU suite would skip every test: exit 3 instead."""
    torch = pytest.importorskip("torch")
    try:
        import pytest_timeout  # noqa: F401
        import triton  # noqa: F401
        fit = torch.cuda.is_available()
    except ImportError:
        fit = False
    if fit:
        pytest.skip("this machine can run the GPU suite")
    out = tmp_path / "out"
    done = gpu_sh("suite", str(tmp_path / "no-wheels-here"), env={"OUT": str(out), "SITE": str(tmp_path / "site")})
    assert done.returncode == 3 and "wheel folder" in done.stdout
    empty = tmp_path / "wheels"
    empty.mkdir()
    done = gpu_sh("suite", str(empty), "--", "tests/test_docs.py", env={"OUT": str(out), "SITE": str(tmp_path / "site")})
    assert done.returncode == 3, done.stdout + done.stderr
    assert re.search(r"gpu suite: (not importable: |torch sees no CUDA device)", done.stdout + done.stderr)
    assert not (out / "gpu-suite.xml").exists(), "pytest never started"
