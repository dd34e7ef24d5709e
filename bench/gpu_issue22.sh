#!/usr/bin/env bash
# Issue 22 on one GPU, in one call (run from the repository root; carry .whl; $OUT set): the GPU tests of eager
# CUDA-graph replay and the compiled paths, the host cost of an eager one-token layer call (graphs, no graphs,
# transformers' implementations), a profile of whole eager forwards, and the eager forward at 1 / 32 / 2048 tokens
# with and without replay. Each stage has its own time limit and writes as it goes, so a cut run still returns
# what it measured. STAGES (default "tests host profile forward") picks stages; also "hostpath" (bench/host_cost.py:
# the host time of each layer of the call path), "ceiling" (the forward with free experts beside the others),
# "generate" (compiled generate(), free experts included, interleaved: a model copy per implementation) and "compiled"
# (the compiled one-token forward).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STAGES=${STAGES:-tests host profile forward}
has() { case " $STAGES " in *" $1 "*) return 0;; esac; return 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
if has tests; then
    SUITE_S=${TESTS_S:-200} bash bench/gpu_suite.sh .whl -- tests/gpu/test_eager_graphs.py tests/gpu/test_block_graphs.py \
        tests/integrations/test_compile.py tests/integrations/test_transformers.py tests/integrations/test_block_graphs_cpu.py 2>&1 | tail -25
fi
export PYTHONPATH=/tmp/moe-fsm-site:$PWD/src:$PWD/bench
B="python3 bench/bench_transformers.py --device cuda --dtype bfloat16"
if has host; then
    timeout 90 $B --host-cost --tokens 1 --shape qwen3-30b-a3b --host-calls 50 --json "$OUT/host_cost.json" 2>&1 | grep -v USDT | tail -12
fi
if has profile; then
    timeout 90 python3 bench/profile_forward.py --shape qwen3-30b-a3b --layers 4 --tokens 1 --json "$OUT/profile_forward.json" 2>&1 | grep -v USDT | tail -60
fi
if has forward; then
    timeout 120 $B --shape qwen3-30b-a3b --layers 4 --tokens 1 32 2048 --repeats 10 --json "$OUT/forward.json" 2>&1 | grep -v USDT | tail -30
    MOE_FSM_EAGER_GRAPHS=0 timeout 60 $B --shape qwen3-30b-a3b --layers 4 --tokens 1 32 2048 --repeats 10 --impls grouped_mm moe_fsm \
        --json "$OUT/forward_no_graphs.json" 2>&1 | grep -v USDT | tail -12
fi
if has hostpath; then
    timeout 90 python3 bench/host_cost.py --json "$OUT/host_path.json" 2>&1 | grep -v USDT | tail -40
fi
if has ceiling; then
    timeout ${CEILING_S:-150} $B --shape qwen3-30b-a3b --layers 4 --tokens 1 32 2048 --repeats 5 --rounds ${ROUNDS:-7} \
        --impls batched_mm grouped_mm moe_fsm --ceiling --json "$OUT/forward_ceiling.json" 2>&1 | grep -v USDT | tail -24
fi
if has compiled; then
    timeout 200 $B --shape qwen3-30b-a3b --layers 4 --tokens 1 --repeats 10 --impls batched_mm grouped_mm moe_fsm \
        --compile reduce-overhead --json "$OUT/compiled_forward.json" 2>&1 | grep -v USDT | tail -30
fi
if has generate; then
    timeout ${GENERATE_S:-300} $B --generate --layers 4 --generate-impls ${GENERATE_IMPLS:-batched_mm grouped_mm moe_fsm free_experts} \
        --generate-shapes ${GENERATE_SHAPES:-qwen3-30b-a3b gpt-oss-20b} --generate-repeats 2 --generate-rounds ${GENERATE_ROUNDS:-5} \
        --batch ${GENERATE_BATCH:-1 8} \
        --json "$OUT/generate.json" 2>&1 | grep -v USDT | tail -30
fi
echo done
