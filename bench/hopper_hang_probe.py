"""Which Hopper TMA layer calls finish: each case in its own child process, with a deadline.

Issue 21's finding: two GPU tests with a persistent grid over a gathered input on the Qwen3-30B-A3B shape never
finished. This runs such calls one by one, each in a child that has ``DEADLINE_S`` seconds; a child past it
prints every thread's Python stack (``faulthandler``: where it waited, compiling or synchronizing) and is
killed, so one hung kernel costs one deadline and not the session. Each case that finishes is compared with
the pointer-load kernel on the same tiles (relative Frobenius difference).

    python bench/hopper_hang_probe.py [--deadline-s 45] [--only NAME ...] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

QWEN3 = (128, 2048, 768, 8)  # experts, hidden (K), intermediate (N), top_k
MIXTRAL = (8, 4096, 14336, 2)

# name: (shape, tokens, config flags, call options); tiles bm128, w1 128, w2 256, k64, group 8, 8 warps
CASES = {
    "qwen3-500-pers-gather": (QWEN3, 500, dict(persistent=True, gather=True), {}),
    "qwen3-500-pers": (QWEN3, 500, dict(persistent=True), {}),
    "qwen3-500-gather": (QWEN3, 500, dict(gather=True), {}),
    "qwen3-500-pers-gather-dropped-limit": (QWEN3, 500, dict(persistent=True, gather=True),
                                            dict(dropped=True, activation="swigluoai", swiglu_limit=7.0)),
    "qwen3-500-pers-dropped-limit": (QWEN3, 500, dict(persistent=True),
                                     dict(dropped=True, activation="swigluoai", swiglu_limit=7.0)),
    "qwen3-2000-pers-gather": (QWEN3, 2000, dict(persistent=True, gather=True), {}),
    "qwen3-8192-pers-gather": (QWEN3, 8192, dict(persistent=True, gather=True), {}),
    "qwen3-500-pers-gather-paired": (QWEN3, 500, dict(persistent=True, gather=True, paired=True), {}),
    "mixtral-700-pers-gather": (MIXTRAL, 700, dict(persistent=True, gather=True), {}),
    # the warp-specialized test case (4 warps run as 12, w2 128 wide); needs MOE_FSM_TRITON_WARP_SPECIALIZE=1
    "qwen3-2000-pers-gather-ws": (QWEN3, 2000, dict(persistent=True, gather=True, ws=True, warps=4, w2_n=128), {}),
}


def run_case(name: str) -> dict:
    import torch

    from moe_fsm.kernels.triton_moe import GemmConfig, MoEConfig, align_tokens, fused_experts
    from moe_fsm.kernels.triton_moe.hopper import hopper_usable

    (experts, hidden, inter, top_k), tokens, flags, opts = CASES[name]
    persistent, gather, paired = flags.get("persistent", False), flags.get("gather", False), flags.get("paired", False)
    ws, warps, w2_n = flags.get("ws", False), flags.get("warps", 8), flags.get("w2_n", 256)
    config = MoEConfig(128, GemmConfig(128, 64, 8, warps, 3, persistent=persistent, paired=paired, warp_specialize=ws),
                       GemmConfig(w2_n, 64, 8, warps, 3, persistent=persistent, warp_specialize=ws), False, True, gather)
    pointer = MoEConfig(128, GemmConfig(128, 64, 8, warps, 3), GemmConfig(w2_n, 64, 8, warps, 3), False, False, False)
    gen = torch.Generator(device="cuda").manual_seed(0)
    w1 = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16, generator=gen) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16, generator=gen) * inter**-0.5
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    w, ids = torch.rand(tokens, experts, device="cuda", generator=gen).topk(top_k, dim=1)
    g, ids = (w / w.sum(1, keepdim=True)).float(), ids.to(torch.int32)
    if opts.get("dropped"):
        ids[::3, 2] = -1
        ids[::7, 5] = experts + 3
    kw = {k: v for k, v in opts.items() if k != "dropped"}
    if not hopper_usable(config, align_tokens(ids, experts, 128), x, w1, w2):
        return {"case": name, "status": "no hopper path"}
    start = time.time()
    out = fused_experts(x, w1, w2, g, ids, config=config, **kw)
    torch.cuda.synchronize()
    took = time.time() - start
    ref = fused_experts(x, w1, w2, g, ids, config=pointer, **kw).double()
    diff = float((out.double() - ref).norm() / ref.norm())
    return {"case": name, "status": "finished", "first_call_s": round(took, 2), "diff_vs_pointer": diff,
            "nan": bool(out.isnan().any())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deadline-s", type=float, default=45.0)
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        import faulthandler

        faulthandler.dump_traceback_later(args.deadline_s - 5, exit=True)
        print("RESULT " + json.dumps(run_case(args.child)), flush=True)
        return
    results = []
    for name in args.only or list(CASES):
        start = time.time()
        try:
            proc = subprocess.run([sys.executable, __file__, "--child", name, "--deadline-s", str(args.deadline_s)],
                                  capture_output=True, text=True, timeout=args.deadline_s + 10)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if lines:
                result = json.loads(lines[-1][len("RESULT "):])
            else:
                result = {"case": name, "status": f"no result (exit {proc.returncode})",
                          "stderr_tail": proc.stderr[-3000:]}
        except subprocess.TimeoutExpired as exc:
            result = {"case": name, "status": "killed at the deadline", "stderr_tail": str(exc.stderr or "")[-3000:]}
        result["wall_s"] = round(time.time() - start, 1)
        results.append(result)
        print(json.dumps(result), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
