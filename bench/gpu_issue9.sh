#!/usr/bin/env bash
# One device call for issue 9 (run from the worktree root on the GPU machine; writes under $OUT):
# GPU tests, `moe-fsm tune` of the named shapes into $OUT/cfg, then the side-by-side benchmark against vLLM
# with the freshly tuned table. Each step has its own time cap so a slow one leaves the others their share.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv | tee $OUT/log_tests.txt
timeout ${TEST_S:-110} python3 -m pytest -q -p no:cacheprovider -x tests/gpu/test_graph_engine.py tests/gpu/test_tune.py tests/gpu/test_triton_moe.py 2>&1 | tail -25 | tee -a $OUT/log_tests.txt
export MOE_FSM_TRITON_CONFIG_DIR=$OUT/cfg
timeout ${TUNE_S:-230} python3 -m moe_fsm.cli.main tune --workers 14 --shape ${TUNE_SHAPES:-qwen3-30b-a3b mixtral-8x7b-fp8-tensor qwen3-30b-a3b-tp2 qwen3-30b-a3b-tp4 deepseek-v3-fp8-block qwen3-30b-a3b-fp8-channel mixtral-8x7b} 2>&1 | grep -v "cannot build" | tee $OUT/log_tune.txt
timeout 60 python3 bench/host_cost.py 2>&1 | head -60 | tee $OUT/log_host.txt
timeout ${BENCH_S:-220} python3 bench/bench_vs_vllm.py run --workers 14 --out-dir $OUT 2>&1 | tee $OUT/log_bench.txt
