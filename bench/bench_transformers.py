"""moe_fsm inside transformers against transformers' own experts implementations, on one model.

Builds a Qwen3-MoE (or Mixtral) model from its config class with random weights
(no download), then times the forward of the same model, same tokens, under
``eager``, ``batched_mm``, ``grouped_mm`` and ``moe_fsm`` (enable() decides and
builds every experts module first; that load time is printed apart). Two scopes:
``model`` (the whole forward: attention, router, experts, lm head) and
``experts`` (the experts modules alone, on fixed routing, summed over layers),
medians of repeated runs, side by side in one process. Also checks that each
implementation's logits agree with eager.

``--compile MODE ...`` also times the model forward of every implementation under
``torch.compile(model, fullgraph=True, mode=MODE)`` (``default``, ``reduce-overhead``,
``max-autotune``, ...; ``none`` is the eager forward, always run); an implementation
that does not compile is a row with its error.

``--generate`` times an end-to-end ``generate()`` instead: greedy, a static cache,
transformers' own compiled decoding (``CompileConfig(fullgraph=True, mode=...)``),
``--new-tokens`` (128) after a ``--prompt``-token prompt, at each ``--batch`` (1 and 8),
reporting tokens/s (batch x new tokens / the wall time of the whole call, prefill
included) and how many generated tokens agree with the first implementation's.

``--host-cost`` measures, with ``torch.profiler``, an eager experts call at ``--tokens``
(1): its host (CPU) time per call, the time of the operators it runs, the host time
above them (Python, checks, lookups), and on CUDA the kernels' device time and the
host time in kernel launches.

    python bench/bench_transformers.py                       # CPU, tiny model
    python bench/bench_transformers.py --shape qwen3-30b-a3b --layers 2 --device cuda --dtype bfloat16
    python bench/bench_transformers.py --shape qwen3-30b-a3b --layers 2 --device cuda --dtype bfloat16 --compile default
    python bench/bench_transformers.py --generate --shape qwen3-30b-a3b --layers 4 --device cuda --dtype bfloat16
    python bench/bench_transformers.py --host-cost --tokens 1 --shape qwen3-30b-a3b --device cuda --dtype bfloat16
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
    # gpt-oss-20b's dimensions on the Qwen3-MoE layout: moe_fsm refuses gpt-oss's own (expert biases,
    # interleaved gate/up rows, a clamped gate), so this is its shape, not its architecture
    "gpt-oss-20b": dict(arch="qwen3_moe", hidden_size=2880, moe_intermediate_size=2880, num_experts=32,
                        num_experts_per_tok=4, num_attention_heads=64, num_key_value_heads=8, head_dim=64),
    # a tiny Qwen3-MoE for the CPU
    "tiny": dict(arch="qwen3_moe", hidden_size=256, moe_intermediate_size=128, num_experts=32, num_experts_per_tok=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64),
}
IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm", "moe_fsm")
# experts that cost nothing (the input handed back): the bound on what any experts implementation can reach
FREE_EXPERTS = "free_experts"
GENERATE_IMPLEMENTATIONS = IMPLEMENTATIONS + (FREE_EXPERTS,)


def register_free_experts() -> None:
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(FREE_EXPERTS, lambda module, hidden, index, weights: hidden)


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
               "compile": list(args.compile), "rows": []}
    for tokens in args.tokens:
        ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(1)).to(device)
        routed = experts_inputs(model, tokens, device, dtype)
        reference = experts_reference = None
        row = {"tokens": tokens}
        for impl in args.impls:
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
        if args.ceiling:
            register_free_experts()
            model.set_experts_implementation(FREE_EXPERTS)
            with torch.no_grad():
                row["ceiling_model_ms"] = timed(lambda: model(ids), device, args.repeats)
            model.set_experts_implementation("moe_fsm")
        if args.rounds:
            interleaved_forward(model, ids, device, args, row)
        for mode in [m for m in args.compile if m != "none"]:
            for impl in IMPLEMENTATIONS:
                if f"{impl}_model_ms" not in row:  # did not run eager (skipped, or failed): not compiled either
                    continue
                compiled_forward(model, impl, mode, ids, reference, device, args.repeats, row)
        results["rows"].append(row)
        print(f"  {tokens} tokens done", file=sys.stderr)
    return results


def interleaved_forward(model, ids, device, args, row: dict) -> None:
    """The model forward of every implementation that ran (and the free experts with --ceiling), interleaved.

    An eager forward is bound by the host, whose speed drifts over seconds (other processes, clocks): timing one
    implementation after another lets the drift decide a 10% ratio. Here each of ``--rounds`` rounds times
    ``--repeats`` forwards of every implementation in turn; the figure is the median of the rounds' medians
    (``{impl}_model_rounds_ms``, the rounds in ``{impl}_model_round_ms``).
    """
    impls = [i for i in args.impls if f"{i}_model_ms" in row] + ([FREE_EXPERTS] if args.ceiling else [])
    rounds = {impl: [] for impl in impls}
    with torch.no_grad():
        for _ in range(args.rounds):
            for impl in impls:
                model.set_experts_implementation(impl)
                rounds[impl].append(timed(lambda: model(ids), device, args.repeats, warmup=1))
    model.set_experts_implementation("moe_fsm")
    for impl, samples in rounds.items():
        key = "ceiling" if impl == FREE_EXPERTS else impl
        row[f"{key}_model_round_ms"] = samples
        row[f"{key}_model_rounds_ms"] = statistics.median(samples)


def compiled_forward(model, impl: str, mode: str, ids, reference, device, repeats: int, row: dict) -> None:
    """``torch.compile(model, fullgraph=True, mode=mode)`` under ``impl``: compile time, agreement, median ms."""
    key = f"{impl}@{mode}"
    torch._dynamo.reset()
    model.set_experts_implementation(impl)
    compiled = torch.compile(model, fullgraph=True, mode=mode, dynamic=False)

    def call():
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(ids).logits

    try:
        with torch.no_grad():
            start = time.perf_counter()
            logits = call().float()
            row[f"{key}_compile_s"] = time.perf_counter() - start
            row[f"{key}_rel_err"] = float((logits - reference).abs().max() / reference.abs().max())
            row[f"{key}_model_ms"] = timed(call, device, repeats)
    except Exception as err:  # e.g. a data-dependent implementation that fullgraph cannot take
        row[f"{key}_error"] = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:160]}"
    finally:
        torch._dynamo.reset()


def bench_generate(args) -> dict:
    """End-to-end greedy ``generate()`` with a static cache and transformers' compiled decoding, per implementation.

    With ``--generate-rounds R`` every implementation gets its own copy of the model (same weights), all are
    compiled first, then timed one call each, in turn, R times: a decoding step of a small model is bound by
    generate()'s own host work, whose speed drifts over a run by more than the gaps between implementations.
    """
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import CompileConfig

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    results = {"kind": "generate", "device_name": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "transformers": transformers.__version__, "dtype": args.dtype,
               "layers": args.layers, "new_tokens": args.new_tokens, "prompt": args.prompt, "mode": args.generate_mode,
               "rounds": args.generate_rounds, "cpu_threads": torch.get_num_threads(), "rows": []}
    register_free_experts()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    compile_config = CompileConfig(fullgraph=True, mode=args.generate_mode)
    compile_config._compile_all_devices = True  # transformers compiles only on accelerators unless told
    for shape in args.generate_shapes:
        copies = args.generate_impls if args.generate_rounds else args.generate_impls[:1]
        models = {}
        for impl in copies:
            models[impl] = build_model(shape, args.layers, dtype, device)
            with tempfile.TemporaryDirectory() as traces:
                enabled = enable(models[impl], env={}, trace_dir=traces)
        decision = next(iter(enabled.modules.values())).loaded.decision
        model_of = (lambda impl: models[impl]) if args.generate_rounds else (lambda impl: models[copies[0]])
        for batch in args.batch:
            prompt = torch.randint(0, models[copies[0]].config.vocab_size, (batch, args.prompt),
                                   generator=torch.Generator().manual_seed(batch)).to(device)
            config = GenerationConfig(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                                      cache_implementation="static", compile_config=compile_config,
                                      pad_token_id=0, eos_token_id=None, bos_token_id=None)
            row, reference, ready = {"shape": shape, "batch": batch, "moe_fsm": f"{decision.backend} ({decision.kernel})"}, None, []

            def run(impl):
                with torch.no_grad():
                    return model_of(impl).generate(prompt, generation_config=config)

            def timed_call(impl) -> float:
                sync()
                start = time.perf_counter()
                run(impl)
                sync()
                return (time.perf_counter() - start) * 1e3

            for impl in args.generate_impls:
                model = model_of(impl)
                model.set_experts_implementation(impl)
                if not args.generate_rounds:
                    torch._dynamo.reset()
                for attr in ("_compiled_call", "_last_compile_config"):
                    if hasattr(model, attr):
                        delattr(model, attr)
                try:
                    start = time.perf_counter()
                    out = run(impl)
                    row[f"{impl}_first_s"] = time.perf_counter() - start  # compiles the decoding step
                    generated = out[:, args.prompt:]
                    if generated.shape[1] != args.new_tokens:
                        raise RuntimeError(f"generated {generated.shape[1]} tokens, asked for {args.new_tokens}")
                    if reference is None:
                        reference = generated
                    row[f"{impl}_agree"] = float((generated == reference).float().mean())
                    run(impl)  # records the CUDA graphs
                    if not args.generate_rounds:
                        row[f"{impl}_ms"] = statistics.median(timed_call(impl) for _ in range(args.generate_repeats))
                    ready.append(impl)
                except Exception as err:
                    row[f"{impl}_error"] = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:160]}"
            if args.generate_rounds:
                samples = {impl: [] for impl in ready}
                for _ in range(args.generate_rounds):
                    for impl in ready:
                        samples[impl].append(timed_call(impl))
                for impl in ready:
                    row[f"{impl}_ms"] = statistics.median(samples[impl])
                    row[f"{impl}_samples_ms"] = samples[impl]
            for impl in args.generate_impls:
                if f"{impl}_ms" in row:
                    row[f"{impl}_tokens_per_s"] = batch * args.new_tokens / (row[f"{impl}_ms"] / 1e3)
                print(f"  generate {shape} batch {batch} {impl}: "
                      f"{row.get(f'{impl}_tokens_per_s', row.get(f'{impl}_error'))}", file=sys.stderr)
            results["rows"].append(row)
            if args.json:  # what is measured so far survives a run cut short
                with open(args.json, "w") as f:
                    json.dump(results, f, indent=2)
        del models
        torch._dynamo.reset()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


def generate_table(results: dict) -> str:
    impls = [i for i in GENERATE_IMPLEMENTATIONS if any(f"{i}_ms" in r or f"{i}_error" in r for r in results["rows"])]
    lines = [
        f"generate(): greedy, static cache, compiled decoding (fullgraph=True, mode={results['mode']!r}), "
        f"{results['new_tokens']} new tokens after a {results['prompt']}-token prompt, {results['layers']} layers, "
        f"{results['dtype']} on {results['device_name']} (torch {results['torch']}, transformers {results['transformers']})",
        "",
        "tokens/s (batch x new tokens / wall time of the call, prefill included); moe_fsm/best above 1: moe_fsm is faster",
        "",
        "| shape | batch | " + " | ".join(impls) + " | moe_fsm/best |",
        "|---|---:|" + "---:|" * (len(impls) + 1),
    ]
    for row in results["rows"]:
        cells = [f"{row[f'{i}_tokens_per_s']:.1f}" if f"{i}_tokens_per_s" in row else "error" for i in impls]
        peers = [row[f"{i}_tokens_per_s"] for i in impls if i not in ("moe_fsm", FREE_EXPERTS) and f"{i}_tokens_per_s" in row]
        mine = row.get("moe_fsm_tokens_per_s")
        ratio = f"{mine / max(peers):.2f}x" if peers and mine else "-"
        lines.append(f"| {row['shape']} | {row['batch']} | " + " | ".join(cells) + f" | {ratio} |")
    lines.append("")
    for row in results["rows"]:
        agree = ", ".join(f"{i} {row[f'{i}_agree']:.2f}" for i in impls if f"{i}_agree" in row)
        first = ", ".join(f"{i} {row[f'{i}_first_s']:.0f} s" for i in impls if f"{i}_first_s" in row)
        lines.append(f"{row['shape']} batch {row['batch']}: moe_fsm ran {row['moe_fsm']}; generated tokens equal to the "
                     f"first implementation's: {agree}; first call (compiles): {first}")
        for i in impls:
            if f"{i}_error" in row:
                lines.append(f"  not run: {i}: {row[f'{i}_error']}")
    return "\n".join(lines)


def host_cost(args) -> dict:
    """Profiler view of one eager experts call per implementation: host time, its operators, the rest; CUDA kernels."""
    from torch.profiler import ProfilerActivity, profile, record_function

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    model = build_model(args.shape, 1, dtype, device)
    with tempfile.TemporaryDirectory() as traces:
        enabled = enable(model, env={}, trace_dir=traces)
    decision = next(iter(enabled.modules.values())).loaded.decision
    tokens = args.tokens[0]
    (module, hidden, ids, weights), = experts_inputs(model, tokens, device, dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    results = {"kind": "host_cost", "shape": args.shape, "tokens": tokens, "dtype": args.dtype, "device": str(device),
               "device_name": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "transformers": transformers.__version__, "cpu_threads": torch.get_num_threads(),
               "moe_fsm": f"{decision.backend} ({decision.kernel})", "calls": args.host_calls, "rows": {}}
    rows = ("moe_fsm", "moe_fsm (no graphs)", "grouped_mm", "batched_mm", "eager")
    for impl in rows:
        model.set_experts_implementation(impl.split()[0])
        for prepared in enabled.modules.values():  # eager CUDA-graph replay on, except in the "no graphs" row
            prepared.eager_graphs = impl == "moe_fsm" and getattr(prepared.kernel, "capturable", False)
        call = lambda: module(hidden, ids, weights)  # noqa: E731
        with torch.no_grad():
            for _ in range(20):
                call()
            sync()
            start = time.perf_counter()  # a host-bound loop: no synchronization inside, the queue absorbs kernels
            for _ in range(args.host_calls):
                call()
            wall_us = (time.perf_counter() - start) / args.host_calls * 1e6
            sync()
            with profile(activities=activities) as prof:
                for _ in range(args.host_calls):
                    with record_function("experts_call"):
                        call()
                sync()
        events = prof.events()
        calls = [e for e in events if e.name == "experts_call" and e.device_type.name == "CPU"]
        host = statistics.median(e.cpu_time_total for e in calls)
        ops = statistics.median(sum(c.cpu_time_total for c in e.cpu_children) for e in calls)
        row = {"wall_us": wall_us, "host_us": host, "ops_us": ops, "above_ops_us": host - ops,
               "ops_per_call": statistics.median(len(e.cpu_children) for e in calls)}
        if device.type == "cuda":
            kernels = [e for e in events if e.device_type.name == "CUDA"]
            row["kernels_per_call"] = len(kernels) / len(calls)
            row["device_us"] = sum(e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
                                   for e in kernels) / len(calls)
            # kernel launches and graph launches (an eager moe_fsm call replays a captured graph)
            launches = [e for e in events if e.device_type.name == "CPU"
                        and ("LaunchKernel" in e.name or "GraphLaunch" in e.name)]
            row["launch_us"] = sum(e.cpu_time_total for e in launches) / len(calls)
            row["host_above_device_us"] = host - row["device_us"]
            row["host_above_launch_us"] = host - row["launch_us"]
        results["rows"][impl] = row
    return results


def host_cost_table(results: dict) -> str:
    cuda = results["device"].startswith("cuda")
    lines = [
        f"host cost of one eager experts call: {results['shape']}, {results['tokens']} token(s), {results['dtype']} on "
        f"{results['device_name']} (torch {results['torch']}, {results['cpu_threads']} CPU thread(s)); moe_fsm runs "
        f"{results['moe_fsm']}; medians over {results['calls']} profiled calls, µs per call",
        "",
        "| implementation | wall (no profiler) | host (profiled) | its operators | host above operators |"
        + (" kernels (device) | host above kernels | launch calls | host above launch calls |" if cuda else ""),
        "|---|---:|---:|---:|---:|" + ("---:|---:|---:|---:|" if cuda else ""),
    ]
    for impl, r in results["rows"].items():
        line = (f"| {impl} | {r['wall_us']:.1f} | {r['host_us']:.1f} | {r['ops_us']:.1f} ({r['ops_per_call']:.0f}) | "
                f"{r['above_ops_us']:.1f} |")
        if cuda:
            line += (f" {r['device_us']:.1f} ({r['kernels_per_call']:.0f}) | {r['host_above_device_us']:.1f} | "
                     f"{r['launch_us']:.1f} | {r['host_above_launch_us']:.1f} |")
        lines.append(line)
    return "\n".join(lines)


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
    interleaved = [r for r in results["rows"] if "moe_fsm_model_rounds_ms" in r]
    if interleaved:
        names = [i for i in IMPLEMENTATIONS if any(f"{i}_model_rounds_ms" in r for r in interleaved)]
        free = any("ceiling_model_rounds_ms" in r for r in interleaved)
        lines.append("model forward, interleaved rounds: median of the rounds' medians, ms")
        lines.append("")
        lines.append("| tokens | " + " | ".join(names) + (" | free experts" if free else "") + " | best/moe_fsm |"
                     + (" best/free experts |" if free else ""))
        lines.append("|---:|" + "---:|" * (len(names) + 1 + 2 * free))
        for row in interleaved:
            cells = [f"{row[f'{i}_model_rounds_ms']:.3f}" if f"{i}_model_rounds_ms" in row else "-" for i in names]
            peers = [row[f"{i}_model_rounds_ms"] for i in names if i != "moe_fsm" and f"{i}_model_rounds_ms" in row]
            best = min(peers) if peers else None
            line = f"| {row['tokens']} | " + " | ".join(cells)
            if free:
                line += f" | {row['ceiling_model_rounds_ms']:.3f}"
            line += f" | {best / row['moe_fsm_model_rounds_ms']:.2f}x |" if best else " | - |"
            if free:
                line += f" {best / row['ceiling_model_rounds_ms']:.2f}x |" if best else " - |"
            lines.append(line)
        lines.append("")
    ceilings = [r for r in results["rows"] if "ceiling_model_ms" in r]
    if ceilings:
        lines.append("model forward with experts that cost nothing (the bound on any experts implementation)")
        lines.append("")
        lines.append("| tokens | free experts ms | best transformers / free experts |")
        lines.append("|---:|---:|---:|")
        for row in ceilings:
            peers = [row[f"{i}_model_ms"] for i in IMPLEMENTATIONS[:-1] if f"{i}_model_ms" in row]
            ratio = f"{min(peers) / row['ceiling_model_ms']:.2f}x" if peers else "-"
            lines.append(f"| {row['tokens']} | {row['ceiling_model_ms']:.3f} | {ratio} |")
        lines.append("")
    for mode in [m for m in results.get("compile", []) if m != "none"]:
        lines.append(f"model forward, torch.compile(fullgraph=True, mode={mode!r}), median ms (compile s)")
        lines.append("")
        lines.append("| tokens | " + " | ".join(IMPLEMENTATIONS) + " | best/moe_fsm |")
        lines.append("|---:|" + "---:|" * (len(IMPLEMENTATIONS) + 1))
        for row in results["rows"]:
            cells, peers = [], []
            for impl in IMPLEMENTATIONS:
                ms = row.get(f"{impl}@{mode}_model_ms")
                cells.append(f"{ms:.3f} ({row[f'{impl}@{mode}_compile_s']:.0f})" if ms is not None else "error")
                if ms is not None and impl != "moe_fsm":
                    peers.append(ms)
            mine = row.get(f"moe_fsm@{mode}_model_ms")
            ratio = f"{min(peers) / mine:.2f}x" if peers and mine else "-"
            lines.append(f"| {row['tokens']} | " + " | ".join(cells) + f" | {ratio} |")
        lines.append("")
    errors = {f"{i} @ {r['tokens']}": r[f"{i}_error"] for r in results["rows"] for i in IMPLEMENTATIONS if f"{i}_error" in r}
    errors.update({f"{i} @ {r['tokens']} compiled ({m})": r[f"{i}@{m}_error"] for r in results["rows"]
                   for i in IMPLEMENTATIONS for m in results.get("compile", []) if f"{i}@{m}_error" in r})
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
    parser.add_argument("--compile", nargs="+", default=["none"], metavar="MODE",
                        help="also time the forward under torch.compile(fullgraph=True, mode=MODE): default, "
                             "reduce-overhead, max-autotune, ... (none: eager only)")
    parser.add_argument("--impls", nargs="+", default=list(IMPLEMENTATIONS), choices=IMPLEMENTATIONS,
                        help="implementations of the forward and experts timings (the first one is the logits reference)")
    parser.add_argument("--rounds", type=int, default=0,
                        help="also time the model forwards interleaved, this many rounds (see interleaved_forward)")
    parser.add_argument("--ceiling", action="store_true",
                        help="also time the forward with experts that cost nothing: the bound on any implementation")
    parser.add_argument("--generate", action="store_true", help="time generate() instead (see the module docstring)")
    parser.add_argument("--generate-shapes", nargs="+", default=["qwen3-30b-a3b", "gpt-oss-20b"], choices=sorted(SHAPES))
    parser.add_argument("--generate-impls", nargs="+", default=list(IMPLEMENTATIONS), choices=GENERATE_IMPLEMENTATIONS)
    parser.add_argument("--generate-mode", default="reduce-overhead", help="torch.compile mode of the decoding step")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens per sequence")
    parser.add_argument("--generate-repeats", type=int, default=3)
    parser.add_argument("--generate-rounds", type=int, default=0,
                        help="interleave: a model copy per implementation, timed in turn this many rounds (0: one after another)")
    parser.add_argument("--host-cost", action="store_true", help="profile one eager experts call instead")
    parser.add_argument("--host-calls", type=int, default=50,
                        help="profiled calls per implementation (the profiler's event tree grows with them)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.generate or args.host_cost:
        results = bench_generate(args) if args.generate else host_cost(args)
        print(generate_table(results) if args.generate else host_cost_table(results))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2)
        return
    results = bench(args)
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
