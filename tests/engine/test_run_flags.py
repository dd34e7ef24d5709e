"""Issue 39, items 3 and 10: every flag of `moe-fsm run` does what it says, in one process and in every rank."""

from __future__ import annotations

import argparse
import json

import pytest

from moe_fsm.cli.main import build_parser, main
from moe_fsm.cli.run_cmd import LAUNCHER_FLAGS, rank_argv

# A value for every flag of `run`, none of them its default; a flag added to `run` without a value here fails
# test_every_flag_of_run_reaches_the_ranks, so none can be left out of what the ranks are given.
SET_EVERY_FLAG = {
    "preset": ["--preset", "deepseek-v3"],
    "tokens": ["--tokens", "7"],
    "layers": ["--layers", "2"],
    "device": ["--device", "cuda"],
    "backend": ["--backend", "nvfp4=flashinfer_b12x,fp8=triton"],
    "env": ["--env", "VLLM_USE_DEEP_GEMM=0", "--env", "VLLM_MOE_USE_DEEP_GEMM=-1"],
    "policy": ["--policy", "vllm-0.33"],
    "trace_dir": ["--trace-dir=-x"],  # a value that looks like a flag
    "seed": ["--seed", "5"],
    "platform": ["--platform", "sm90"],
    "strict_build": ["--strict-build"],
    "all2all": ["--all2all", "allgather_reducescatter"],
    "full_check": ["--full-check"],
    "repeats": ["--repeats", "2"],
    "max_tokens_per_rank": ["--max-tokens-per-rank", "64"],
    "speed_table": ["--speed-table", "tests/data/speed/nvidia_h100.json"],
}


def _run_flags() -> set[str]:
    """The destinations of every option of `run`'s own parser (the one `moe-fsm run` parses with)."""
    subcommands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {action.dest for action in subcommands.choices["run"]._actions if action.dest != "help"}


def test_every_flag_of_run_reaches_the_ranks():
    flags = _run_flags()
    assert set(SET_EVERY_FLAG) == flags - set(LAUNCHER_FLAGS)
    given = build_parser().parse_args(["run", "--nproc", "2", *(word for words in SET_EVERY_FLAG.values() for word in words)])
    defaults = build_parser().parse_args(["run"])
    assert [f for f in flags if getattr(given, f) == getattr(defaults, f)] == []
    argv = rank_argv(given)
    assert all(word.startswith("--") for word in argv)  # --flag or --flag=value: no value stands alone
    rank = build_parser().parse_args(["run", *argv])
    assert {f: getattr(rank, f) for f in flags - {"nproc"}} == {f: getattr(given, f) for f in flags - {"nproc"}}
    assert rank.nproc == 1  # a rank never launches again


def test_a_run_of_defaults_hands_the_ranks_its_defaults():
    given = build_parser().parse_args(["run", "--nproc", "2"])
    rank = build_parser().parse_args(["run", *rank_argv(given)])
    assert vars(rank) == {**vars(given), "nproc": 1}


@pytest.mark.distributed
def test_every_rank_decides_for_the_platform_and_policy_asked_and_builds_strictly(tmp_path, monkeypatch, capfd):
    """The repro: --platform sm90 and --policy reached no rank (they decided for this CPU under seeds), and
    --strict-build exited 0 with --nproc 2 where a single process exits 3."""
    monkeypatch.chdir(tmp_path)
    flags = ["--preset", "deepseek-v3", "--layers", "1", "--tokens", "4", "--platform", "sm90", "--policy", "vllm-0.33",
             "--strict-build"]
    assert main(["run", *flags, "--trace-dir", "single"]) == 3
    assert main(["run", *flags, "--nproc", "2", "--trace-dir=-x"]) == 3
    err = capfd.readouterr().err
    assert err.count("a strict build refuses the stand-in moe-fsm torch experts") == 3  # the single run, each rank
    # DeepSeek-V3's first MoE layer is decoder layer 3: traces are named by the decoder layer
    single = json.loads(next((tmp_path / "single").glob("layer003-*.json")).read_text())
    assert single["inputs"]["platform"]["capability"] == [9, 0] and single["inputs"]["profile"]["name"] == "vllm-0.33"
    for rank in (0, 1):
        trace = json.loads(next((tmp_path / "-x").glob(f"layer003-*.rank{rank}.json")).read_text())
        # the same inputs as the single process's but for the parallel config (dp = ep = 2)
        assert {k: v for k, v in trace["inputs"].items() if k != "parallel"} == \
            {k: v for k, v in single["inputs"].items() if k != "parallel"}
        assert trace["inputs"]["parallel"]["ep_size"] == 2
        assert trace["outcome"]["backend"] == "FLASHINFER_CUTLASS"  # sm90's choice under vllm-0.33 with ep=2


# -- item 10: --tokens 0, --strict-build and substitutes, the table's kernel column ---------------------------


def test_run_refuses_zero_tokens_instead_of_checking_no_row(tmp_path, capsys):
    assert main(["run", "--tokens", "0", "--trace-dir", str(tmp_path)]) == 2
    assert "--tokens must be from 1 to 131072, got 0" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("preset,platform,message", [
    ("gpt-oss-20b", "cpu-x86-amx", "moe-fsm runs CPUExpertsMxfp4's numerics with TorchExperts: a strict build runs only "
                                   "the decided CPUExpertsMxfp4, and refuses the substitute TorchExperts"),
    ("deepseek-v3", "cpu", "a strict build runs only the decided NONE (the platform's own MoE path), and refuses the "
                           "substitute TorchExperts"),
])
def test_strict_build_refuses_a_substitute_as_it_refuses_a_stand_in(preset, platform, message, tmp_path, capsys):
    assert main(["run", "--preset", preset, "--platform", platform, "--strict-build", "--layers", "1", "--tokens", "2",
                 "--trace-dir", str(tmp_path)]) == 3
    err = capsys.readouterr().err
    layer = 3 if preset == "deepseek-v3" else 0  # the decoder layer, as trace names and manifests number it
    assert err.startswith(f"moe-fsm run: error: layer {layer} (model.layers.{layer}.mlp.experts): ")
    assert err.rstrip().endswith(message) and err.count("\n") == 1


def test_the_table_names_the_decided_kernel_beside_its_substitute(tmp_path, capsys):
    assert main(["run", "--preset", "gpt-oss-20b", "--platform", "cpu-x86-amx", "--layers", "1", "--tokens", "2",
                 "--repeats", "1", "--trace-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "CPU      CPUExpertsMxfp4 decided; runs as TorchExperts (substitute)  LocalPrepareFinalize" in out
    assert "1 x mxfp4: CPU (CPUExpertsMxfp4 decided; runs as TorchExperts (substitute))" in out
    assert main(["run", "--preset", "deepseek-v3", "--platform", "cpu", "--layers", "1", "--tokens", "2", "--repeats", "1",
                 "--trace-dir", str(tmp_path / "ds")]) == 0
    assert "fp8     NONE     left to the platform; runs as TorchExperts (substitute)" in capsys.readouterr().out
