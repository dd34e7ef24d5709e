"""Parity of plan's SGLang config rules with SGLang 0.5.23's own config path (maintainer script, not CI).

For every checkpoint of tests/data/configs/ on a set of faked machines and tensor-parallel sizes, reads the
checkpoint as `moe-fsm plan --policy sglang-0.5.23` does (plan/sglang_quant_config.py) and asks SGLang's own code
(tools/sglang_config_parity_worker.py, in the isolated venv of tools/sglang_parity.py): the method name
_verify_quantization settles on, a refusal's message, and each MoE layer's method class. A layer moe-fsm leaves NOT
MAPPED (a method the profile has no runner rules for) is counted apart when SGLang builds a method for it; a method
whose constructor SGLang refuses must be refused with the same message when moe-fsm decides the layer; any other
difference is a disagreement (exit 1).

    python tools/sglang_config_parity.py --python /work/venvs/sglangparity/bin/python --source /path/to/sglang-src
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tools"))

from moe_fsm.inputs.parallel import ParallelConfig  # noqa: E402
from moe_fsm.inputs.platform import preset  # noqa: E402
from moe_fsm.plan.decider import LayerDecider  # noqa: E402
from moe_fsm.plan.plan import checkpoint_layers  # noqa: E402
from moe_fsm.plan.quant_fields import Mapped, Refused, Unmapped  # noqa: E402
from sglang_parity import sglang_source  # noqa: E402

PLATFORMS = ("sm80", "sm89", "sm90", "sm100", "sm120", "rocm-mi300", "rocm-mi355", "cpu", "cpu-x86-amx", "xpu")
TP_SIZES = (1, 8)
CONFIGS = ROOT / "tests" / "data" / "configs"


def machine(platform: str) -> dict:
    p = preset(platform)
    return {"vendor": p.vendor.value, "capability": list(p.capability) if p.capability else None,
            "gcn_arch": p.gcn_arch, "libraries": sorted(lib.value for lib in p.libraries), "cpu_amx": p.cpu_amx}


TRACES = Path(tempfile.mkdtemp(prefix="sglang-config-parity-"))
# SGLang's CompressedTensorsW4A4Nvfp4MoE asks torch.cuda for the capability when it is made: on a CPU (a CPU build of
# torch) that is this AssertionError, where moe-fsm's profile refuses the layer as not modelled off CUDA.
TORCH_WITHOUT_CUDA = "Torch not compiled with CUDA enabled"


def moe_fsm_side(directory: Path, platform: str, tp: int):
    decider = LayerDecider(platform=preset(platform), parallel=ParallelConfig(tp_size=tp), env={},
                           policy="sglang-0.5.23", trace_dir=TRACES / f"{directory.name}-{platform}-{tp}")
    model, reader, quants = checkpoint_layers(directory, decider)
    return decider, model, reader, quants


def decision_error(decider, model, index: int, quant) -> str | None:
    """The message of moe-fsm's refusal when it decides the layer (None: it decides it)."""
    from moe_fsm.errors import SelectionError
    from moe_fsm.plan.decider import LayerSpec
    from moe_fsm.plan.plan import layer_of

    try:
        decider.decide_layer(index, LayerSpec(model.experts_module(index), layer_of(model, quant)))
    except SelectionError as err:
        cause = err.__cause__ if isinstance(err.__cause__, SelectionError) else err
        return cause.message
    return None


def sglang_side(python: str, source: Path, platform: str, jobs: list[dict]) -> list[dict]:
    with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
        done = subprocess.run([python, "-W", "ignore", str(ROOT / "tools" / "sglang_config_parity_worker.py"),
                               json.dumps(machine(platform)), out.name], input=json.dumps(jobs), text=True,
                              env={**os.environ, "PYTHONPATH": str(source)}, capture_output=True)
        if done.returncode != 0:
            raise SystemExit(f"the SGLang worker failed on {platform}:\n{done.stderr[-4000:]}")
        return json.load(out)


def compare(quant, theirs, their_method, decided) -> tuple[str, str]:
    """('agree' | 'not-modelled' | 'declared' | 'disagree', what differs) for one layer; ``decided()`` is moe-fsm's
    refusal when it decides the layer (a method whose constructor SGLang refuses is refused there by the profile)."""
    if isinstance(theirs, dict) and "error" in theirs:  # SGLang refuses this layer when making its method
        if isinstance(quant, Refused) and theirs["message"].startswith(quant.reason[:300]):
            return "agree", ""
        if isinstance(quant, Mapped):
            ours = decided()
            if ours is not None and theirs["message"].startswith(ours[:300]):
                return "agree", ""
            if ours is not None and theirs["message"].startswith(TORCH_WITHOUT_CUDA):
                return "declared", f"SGLang's method asks torch.cuda on a CPU; moe-fsm refuses: {ours[:100]}"
        return "disagree", f"SGLang refuses the layer ({theirs['error']}: {theirs['message'][:120]}); moe-fsm: {quant}"
    if theirs == "__refused__":
        if isinstance(quant, Refused) and their_method["message"].startswith(quant.reason[:300]):
            return "agree", ""
        return "disagree", f"SGLang refuses at {their_method['stage']} ({their_method['message'][:160]}); moe-fsm: {quant}"
    if isinstance(quant, Unmapped):
        return "not-modelled", f"SGLang builds {theirs or 'UnquantizedFusedMoEMethod'} ({quant.reason[:80]})"
    names = theirs or ["UnquantizedFusedMoEMethod"]  # the method, and the scheme it delegates to if any
    if isinstance(quant, Mapped) and quant.method in names:
        return "agree", ""
    return "disagree", f"SGLang builds {' / '.join(names)} (serving {their_method}); moe-fsm: {quant}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default="/work/venvs/sglangparity/bin/python")
    parser.add_argument("--source", default=None)
    parser.add_argument("--json", default=None, help="write every row here")
    args = parser.parse_args()
    source = sglang_source(args.source)
    started = time.monotonic()
    fixtures = sorted(p for p in CONFIGS.iterdir() if (p / "config.json").is_file())
    counts, rows = Counter(), []
    for platform in PLATFORMS:
        jobs, ours = [], []
        for directory in fixtures:
            for tp in TP_SIZES:
                decider, model, reader, quants = moe_fsm_side(directory, platform, tp)
                g = model.geometry
                jobs.append({"dir": str(directory), "layers": [model.experts_module(i) for i in model.moe_layers],
                             "hidden_size": g.hidden_size, "intermediate_size": g.intermediate_size, "tp_size": tp,
                             "router_weight_on_input": g.router_weight_on_input})
                ours.append((directory.name, tp, decider, model, reader, quants))
        answers = sglang_side(args.python, source, platform, jobs)
        for (name, tp, decider, model, reader, quants), answer in zip(ours, answers):
            theirs = answer["layers"] if answer["ok"] else ["__refused__"] * len(quants)
            method = answer.get("quantization") if answer["ok"] else answer
            if answer["ok"] and reader.method != answer["quantization"] and not isinstance(reader.whole, Unmapped):
                counts["disagree"] += 1
                rows.append({"fixture": name, "platform": platform, "tp": tp, "verdict": "disagree",
                             "why": f"method name: SGLang {answer['quantization']}, moe-fsm {reader.method}"})
                continue
            for index, quant, their in zip(model.moe_layers, quants, theirs):
                verdict, why = compare(quant, their, method,
                                       lambda: decision_error(decider, model, index, quant))  # noqa: B023
                counts[verdict] += 1
                if verdict != "agree":
                    rows.append({"fixture": name, "platform": platform, "tp": tp, "verdict": verdict, "why": why})
    seen = set()
    for row in rows:
        key = (row["fixture"], row["platform"], row["tp"], row["why"])
        if key not in seen:
            seen.add(key)
            print(f"  {row['verdict']:<12} {row['fixture']} on {row['platform']} tp{row['tp']}: {row['why']}")
    print(f"SGLang 0.5.23's config path vs moe-fsm plan --policy sglang-0.5.23: {len(fixtures)} checkpoints x "
          f"{len(PLATFORMS)} machines x TP {list(TP_SIZES)}, {sum(counts.values())} layers, "
          f"{time.monotonic() - started:.0f} s: agree {counts['agree']}, not modelled (SGLang builds a method the "
          f"profile has no rules for) {counts['not-modelled']}, declared {counts['declared']}, "
          f"disagree {counts['disagree']}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 1 if counts["disagree"] else 0


if __name__ == "__main__":
    sys.exit(main())
