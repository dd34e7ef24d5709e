"""moe_fsm inside transformers against transformers' own experts implementations, on one model.

Builds a Qwen3-MoE (or Mixtral) model from its config class with random weights
(no download), then times the forward of the same model, same tokens, under
``eager``, ``batched_mm``, ``grouped_mm`` and ``moe_fsm`` (enable() decides and
builds every experts module first; that load time is printed apart). Two scopes:
``model`` (the whole forward: attention, router, experts, lm head) and
``experts`` (the experts modules alone, on fixed routing, summed over layers),
medians of repeated runs, side by side in one process. Also checks that each
implementation's logits agree with eager.

    python bench/bench_transformers.py                       # CPU, tiny model
    python bench/bench_transformers.py --shape qwen3-30b-a3b --layers 2 --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import torch
import transformers

from moe_fsm.integrations.transformers import enable, experts_modules

SHAPES = {
    # the real checkpoints' MoE dimensions
    "qwen3-30b-a3b": dict(arch="qwen3_moe", hidden_size=2048, moe_intermediate_size=768, num_experts=128,
                          num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128),
    "mixtral-8x7b": dict(arch="mixtral", hidden_size=4096, intermediate_size=14336, num_local_experts=8,
                         num_experts_per_tok=2, num_attention_heads=32, num_key_value_heads=8, head_dim=128),
    # a tiny Qwen3-MoE for the CPU
    "tiny": dict(arch="qwen3_moe", hidden_size=256, moe_intermediate_size=128, num_experts=32, num_experts_per_tok=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64),
}
IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm", "moe_fsm")


def build_model(shape: str, layers: int, dtype, device):
    spec = dict(SHAPES[shape])
    arch = spec.pop("arch")
    common = dict(vocab_size=1024, num_hidden_layers=layers, max_position_embeddings=4096, **spec)
    if arch == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(intermediate_size=4 * spec["hidden_size"], norm_topk_prob=True, **common)
        cls = transformers.Qwen3MoeForCausalLM
    else:
        config = transformers.MixtralConfig(**common)
        cls = transformers.MixtralForCausalLM
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(config).to(dtype).eval()
    with torch.no_grad():
        for _, module in experts_modules(model):
            module.gate_up_proj.normal_(0, module.gate_up_proj.shape[-1] ** -0.5)
            module.down_proj.normal_(0, module.down_proj.shape[-1] ** -0.5)
    return model


def timed(call, device, repeats: int, warmup: int = 2) -> float:
    """Median milliseconds of ``repeats`` calls after ``warmup`` calls."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        call()
    sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        sync()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def experts_inputs(model, tokens: int, device, dtype):
    """Fixed routing per experts module: softmax top-k of random logits, as the routers give it."""
    generator = torch.Generator(device="cpu").manual_seed(tokens)
    inputs = []
    for _, module in experts_modules(model):
        e, k = module.num_experts, module.config.num_experts_per_tok
        hidden = torch.randn(tokens, module.gate_up_proj.shape[-1], generator=generator).to(device, dtype)
        weights, ids = torch.topk(torch.softmax(torch.randn(tokens, e, generator=generator), -1), k, -1)
        inputs.append((module, hidden, ids.to(device), (weights / weights.sum(-1, keepdim=True)).to(device, dtype)))
    return inputs


def batched_gather_gb(model, tokens: int) -> float:
    """What batched_mm copies per layer: each routed (token, expert) pair's gate_up and down weights."""
    _, module = experts_modules(model)[0]
    per_pair = module.gate_up_proj[0].numel() + module.down_proj[0].numel()
    return tokens * module.config.num_experts_per_tok * per_pair * module.gate_up_proj.element_size() / 2**30


def bench(args) -> dict:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    model = build_model(args.shape, args.layers, dtype, device)
    with tempfile.TemporaryDirectory() as traces:
        start = time.perf_counter()
        enabled = enable(model, env={}, trace_dir=args.trace_dir or traces)
        load_ms = (time.perf_counter() - start) * 1e3
    decision = next(iter(enabled.modules.values())).loaded.decision
    results = {"shape": args.shape, "layers": args.layers, "device": str(device), "dtype": args.dtype,
               "device_name": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "cpu_threads": torch.get_num_threads(), "transformers": transformers.__version__,
               "moe_fsm_backend": decision.backend, "moe_fsm_kernel": decision.kernel, "enable_ms": load_ms,
               "rows": []}
    for tokens in args.tokens:
        ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(1)).to(device)
        routed = experts_inputs(model, tokens, device, dtype)
        reference = experts_reference = None
        row = {"tokens": tokens}
        for impl in IMPLEMENTATIONS:
            model.set_experts_implementation(impl)
            gathered = batched_gather_gb(model, tokens)
            if impl == "batched_mm" and gathered > args.max_gather_gb:
                row[f"{impl}_error"] = (f"skipped: it would gather {gathered:.1f} GB of expert weights per layer "
                                        f"(--max-gather-gb {args.max_gather_gb})")
                continue
            try:
                with torch.no_grad():
                    logits = model(ids).logits.float()
                    if reference is None:
                        reference = logits
                    row[f"{impl}_rel_err"] = float((logits - reference).abs().max() / reference.abs().max())
                    outs = [m(h, i, w).float() for m, h, i, w in routed]
                    if experts_reference is None:
                        experts_reference = outs
                    row[f"{impl}_experts_rel_err"] = max(
                        float((o - r).abs().max() / r.abs().max()) for o, r in zip(outs, experts_reference))
                    repeats = args.repeats if tokens < 2048 or device.type == "cuda" else max(3, args.repeats // 3)
                    row[f"{impl}_model_ms"] = timed(lambda: model(ids), device, repeats)
                    row[f"{impl}_experts_ms"] = timed(
                        lambda: [m(h, i, w) for m, h, i, w in routed], device, repeats)
            except Exception as err:  # an implementation this torch/device cannot run: say so in the table
                row[f"{impl}_error"] = f"{type(err).__name__}: {str(err)[:80]}"
        results["rows"].append(row)
        print(f"  {tokens} tokens done", file=sys.stderr)
    return results


def table(results: dict) -> str:
    lines = [
        f"{results['shape']} x {results['layers']} layers, {results['dtype']} on {results['device_name']} "
        f"(torch {results['torch']}, transformers {results['transformers']}, {results['cpu_threads']} CPU thread(s)); moe_fsm decided "
        f"{results['moe_fsm_backend']} ({results['moe_fsm_kernel']}), enable() took {results['enable_ms']:.1f} ms",
        "",
    ]
    for scope in ("model", "experts"):
        lines.append(f"{scope} forward, median ms (ratio: the best transformers implementation / moe_fsm)")
        lines.append("")
        lines.append("| tokens | " + " | ".join(IMPLEMENTATIONS) + " | best/moe_fsm |")
        lines.append("|---:|" + "---:|" * (len(IMPLEMENTATIONS) + 1))
        for row in results["rows"]:
            cells = []
            for impl in IMPLEMENTATIONS:
                ms = row.get(f"{impl}_{scope}_ms")
                cells.append(f"{ms:.3f}" if ms is not None else "error")
            peers = [row[f"{i}_{scope}_ms"] for i in IMPLEMENTATIONS[:-1] if f"{i}_{scope}_ms" in row]
            mine = row.get(f"moe_fsm_{scope}_ms")
            ratio = f"{min(peers) / mine:.2f}x" if peers and mine else "-"
            lines.append(f"| {row['tokens']} | " + " | ".join(cells) + f" | {ratio} |")
        lines.append("")
    errors = {f"{i} @ {r['tokens']}": r[f"{i}_error"] for r in results["rows"] for i in IMPLEMENTATIONS if f"{i}_error" in r}
    lines.append("agreement with eager, max |diff| / max |eager|: logits (routing may flip on near-ties) / "
                 "experts outputs on fixed routing")
    for impl in IMPLEMENTATIONS[1:]:
        cells = [f"{r['tokens']} tok: {r[impl + '_rel_err']:.1e} / {r[impl + '_experts_rel_err']:.1e}"
                 for r in results["rows"] if impl + "_experts_rel_err" in r]
        lines.append(f"  {impl}: " + ("; ".join(cells) or "-"))
    for where, err in errors.items():
        lines.append(f"not run: {where}: {err}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 2048])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's; 1 keeps a shared, busy CPU from stalling the pool)")
    parser.add_argument("--trace-dir", default=None, help="keep enable()'s traces here (default: a temporary dir)")
    parser.add_argument("--json", default=None, help="also write the figures as JSON here")
    parser.add_argument("--max-gather-gb", type=float, default=1.0,
                        help="skip batched_mm where it would copy more expert weights than this per layer (default 1)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    results = bench(args)
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
