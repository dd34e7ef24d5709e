set -x
export PYTHONPATH=/tmp/moe-fsm-site:$PWD/src
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/moe-fsm-site .whl/*.whl 2>&1 | tail -2
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv
timeout 240 python3 -m pytest -q -m gpu tests/gpu/test_gluon_fp8.py -p no:cacheprovider -x 2>&1 | tail -40 > $OUT/test.log
cat $OUT/test.log | tail -25
timeout 300 python3 bench/bench_hopper.py --shapes deepseek-v3-fp8-block --tokens 8192 2048 --gluon --workers 14 --json $OUT/gluon.json > $OUT/bench.log 2>&1
tail -30 $OUT/bench.log
