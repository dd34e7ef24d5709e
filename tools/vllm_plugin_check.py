#!/usr/bin/env python3
"""Check moe-fsm's vLLM plugin against vLLM's real source (a maintainer command; also run by a skipped-if-absent test).

With a downloaded vLLM wheel's source (``pip download vllm==X --no-deps``, unpacked: see docs/vllm-parity.md)
and only the machine faked (the parity tool's fakes: a faked H100 by default), it installs the plugin
(``moe_fsm.integrations.vllm.install``) into that vLLM, then selects the MoE backends of three layers through
vLLM's own oracle functions, as vLLM's quantization methods call them:

* a DeepSeek-V3-like block-FP8 layer (256 experts, top-8, hidden 7168, intermediate 2048),
* a Qwen3-30B-A3B-like bf16 layer (128 experts, top-8, hidden 2048, intermediate 768),
* a gpt-oss-20b-like MXFP4 layer (32 experts, top-4, hidden 2880, SwiGLU-OAI with expert biases),

and checks each written record: the recorded vLLM choice equals what the oracle returned, and moe-fsm's
decision under the matching profile agrees. Exit 0 when all three hold.

    python tools/vllm_plugin_check.py --cache /path/to/vllm-0.33.0-src [--platform sm90] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

LAYERS = {
    "deepseek-v3-block-fp8": {"quant": "fp8", "weight_scale": "block", "act_scale": "group", "num_experts": 256,
                              "top_k": 8, "hidden_size": 7168, "intermediate_size": 2048},
    "qwen3-bf16": {"quant": "unquantized", "num_experts": 128, "top_k": 8, "hidden_size": 2048,
                   "intermediate_size": 768},
    "gpt-oss-mxfp4": {"quant": "mxfp4", "bias": True, "activation": "swigluoai", "swiglu_limit": 7.0,
                      "num_experts": 32, "top_k": 4, "hidden_size": 2880, "intermediate_size": 2880},
}


def run(source: Path, out_dir: Path, version: str = "0.33.0", platform: str = "sm90") -> list[dict]:
    """Select the three layers through vLLM's wrapped oracles; returns [{name, returned, record}]."""
    import vllm_parity

    sys.path.insert(0, str(source))
    vllm_parity.use_version(version)
    import parity_families

    from moe_fsm.integrations import vllm as plugin

    vllm_parity.FAMILIES.update({t.family: t for t in parity_families.tables()})
    faked = parity_families.Faked(families=[vllm_parity.FAMILIES[f].module for f in ("unquantized", "fp8", "mxfp4")])
    plugin.uninstall()
    installed = plugin.install(out_dir)
    results = []
    try:
        for name, layer in LAYERS.items():
            scenario = {"platform": platform, "layer": layer, "parallel": {}, "backend": "auto", "env": {}}
            inputs = vllm_parity.moe_fsm_inputs(scenario)
            table = vllm_parity.FAMILIES[inputs.layer.quant.family.value]
            before = set(out_dir.glob("*-layer*.json"))
            with faked.facts(inputs, {}):
                config = faked.moe_config(inputs)
                # vLLM's quantization methods call the oracle by the name they imported: the module attribute
                oracle = getattr(faked.module(table.module), table.function)
                returned = oracle(config, *table.arguments(faked, inputs, config))
            written = sorted(p for p in set(out_dir.glob("*-layer*.json")) - before if not p.name.endswith(".trace.json"))
            record = json.loads(written[-1].read_text()) if written else None
            results.append({"name": name, "returned": vllm_parity_result(table, returned), "record": record,
                            "file": str(written[-1]) if written else None})
    finally:
        plugin.uninstall()
    del installed
    return results


def vllm_parity_result(table, returned) -> dict:
    backend, kernel = table.result(returned)
    return {"backend": backend, "kernel": kernel}


def check(results: list[dict]) -> list[str]:
    problems = []
    for r in results:
        rec = r["record"]
        if rec is None:
            problems.append(f"{r['name']}: no record written")
            continue
        if (rec["vllm"].get("backend"), rec["vllm"].get("kernel")) != (r["returned"]["backend"], r["returned"]["kernel"]):
            problems.append(f"{r['name']}: recorded vLLM choice {rec['vllm']} != returned {r['returned']}")
        if rec["agreement"]["status"] != "agree":
            problems.append(f"{r['name']}: moe-fsm does not agree: {rec['agreement']}")
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, required=True, help="directory holding vLLM's unpacked 'vllm' package")
    parser.add_argument("--vllm-version", default="0.33.0")
    parser.add_argument("--platform", default="sm90", help="the faked machine (a moe-fsm platform preset)")
    parser.add_argument("--out", type=Path, help="trace directory (default: a temporary one)")
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="moe-fsm-vllm-plugin-"))
    results = run(args.cache, out, args.vllm_version, args.platform)
    for r in results:
        rec = r["record"] or {}
        print(f"{r['name']:24s} vLLM returned {r['returned']['backend']} ({r['returned']['kernel']}); "
              f"recorded {rec.get('vllm', {}).get('backend')} ({rec.get('vllm', {}).get('kernel')}); "
              f"moe-fsm {rec.get('moe_fsm', {}).get('backend')} ({rec.get('moe_fsm', {}).get('kernel')}) "
              f"under {rec.get('profile', {}).get('name')}: {rec.get('agreement', {}).get('status')}  [{r['file']}]")
    problems = check(results)
    for p in problems:
        print("PROBLEM", p)
    print(f"{len(results) - len(problems)} of {len(results)} layers: recorded choice == vLLM's return, moe-fsm agrees"
          if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
