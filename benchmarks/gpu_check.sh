#!/usr/bin/env bash
# The checks run on a lent CUDA machine (no network there; its own torch, triton, numpy,
# ml_dtypes, pytest, transformers and scikit-learn): the device tests, the hardware probes,
# bench_round and bench_train on the GPU. Results go to $OUT (default /tmp/fewbits_gpu).
# SKIP_TESTS=1, SKIP_BENCH=1 leave parts out.
#   bash benchmarks/gpu_check.sh
set -u
OUT=${OUT:-/tmp/fewbits_gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
FB="$PY -m fewbits.cli"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  $PY -c "import sys, torch, triton; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name())"
  $PY -m pip list 2>/dev/null | grep -i -E "^(ml.dtypes|hypothesis|transformers|safetensors|scikit-learn|numpy|pytest|pytest-timeout) "
} 2>&1 | tee "$OUT/env.txt"

if [ -z "${SKIP_TESTS:-}" ]; then
echo "== device tests"
timeout ${TEST_S:-240} $PY -m pytest -q -p no:cacheprovider -o addopts="" -m "not slow" -rfE --tb=short \
  --junitxml="$OUT/device_tests.xml" \
  tests/kernels/test_device_kernels.py tests/quant/test_device_quant.py tests/train/test_device_train.py \
  tests/test_device_misc.py "tests/kernels/test_packing.py::test_cuda_matches_cpu" 2>&1 | tee "$OUT/device_tests.log" | tail -n 150
fi
[ -n "${SKIP_BENCH:-}" ] && exit 0

echo "== fewbits bench --device cuda"
timeout 60 $FB bench --device cuda --budget 0.5 2>&1 | tee "$OUT/bench_cuda.txt"

echo "== bench_round --device cuda"
timeout ${ROUND_S:-150} $PY benchmarks/bench_round.py --device cuda --n $((1 << 26)) --repeats 10 \
  --formats ${ROUND_FORMATS:-fp8_e4m3,fp8_e5m2,bf16,fp16,fp4_e2m1,e8m0,nf4} --modes nearest_even,stochastic \
  --json "$OUT/round_cuda.json" 2>&1 | tee "$OUT/round_cuda.txt" | tail -n 60

echo "== bench_train --device cuda"
timeout ${TRAIN_S:-120} $PY benchmarks/bench_train.py --device cuda --rounds 10 --warmup 3 \
  --json "$OUT/train_cuda.json" 2>&1 | tee "$OUT/train_cuda.txt" | tail -n 20
