#!/usr/bin/env bash
# Issue 22 on one GPU (run from the repository root with moe_fsm importable, $OUT set): the GPU tests of the
# compiled / CUDA-graph paths, the host cost of an eager one-token layer call (Triton's launch and the direct
# launch), the eager whole-model forward, and compiled generate() tokens/s. Each stage has its own time limit
# and writes its JSON as it goes, so a run cut short still returns what it measured.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
B="python3 bench/bench_transformers.py --device cuda --dtype bfloat16"
timeout 150 python3 -m pytest -q -p no:logging -p no:cacheprovider tests/integrations/test_compile.py tests/integrations/test_transformers.py -m gpu 2>&1 | tail -15
timeout 45 $B --host-cost --tokens 1 --shape qwen3-30b-a3b --host-calls 50 --json "$OUT/host_cost.json" 2>&1 | grep -v USDT
MOE_FSM_TRITON_DIRECT_LAUNCH=1 timeout 45 $B --host-cost --tokens 1 --shape qwen3-30b-a3b --host-calls 50 --json "$OUT/host_cost_direct.json" 2>&1 | grep -v USDT
timeout 90 $B --shape qwen3-30b-a3b --layers 4 --tokens 1 32 2048 --repeats 10 --json "$OUT/forward.json" 2>&1 | tail -25
timeout 260 $B --generate --layers 4 --generate-impls batched_mm grouped_mm moe_fsm --generate-repeats 2 --json "$OUT/generate.json" 2>&1 | grep -v USDT | tail -30
echo done
