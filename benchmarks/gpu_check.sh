#!/usr/bin/env bash
# The checks run on a lent CUDA machine (no network there; its own torch, triton, numpy,
# ml_dtypes, pytest, transformers and scikit-learn): the device tests, the hardware probes,
# bench_round and bench_train on the GPU (the small LM, and issue 16's GPT-350M training run:
# fewbits bf16-mixed / fp8-hybrid delayed, current, row-wise / torch autocast / torchao float8,
# torchao's float8 torch.compile'd, as it documents; GPT-1.3B when time is left). Results go to $OUT
# (default /tmp/fewbits_gpu).
#   bash benchmarks/gpu_check.sh
#   FEWBITS_TEST_DEVICE=cpu bash benchmarks/gpu_check.sh   # the same parts on this CPU, tiny sizes
# The whole script stays under TOTAL_S seconds (default 470: under 8 minutes on an H200): each
# part has its own limit (timeout), cut to what is left; a part that would get under 20 s is
# skipped and says so. SKIP_TESTS=1, SKIP_BENCH=1 leave parts out; TEST_S, TRAIN_S, BIG_S, ... set
# a part's limit. torchao is not installed on the lent machine: wheels in $WHEELS (default .whl,
# carried) are installed into /tmp/site first when there are any (see benchmarks/README.md).
set -u
OUT=${OUT:-/tmp/fewbits_gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
FB="$PY -m fewbits.cli"
DEV=${FEWBITS_TEST_DEVICE:-cuda}
TOTAL_S=${TOTAL_S:-470}
WHEELS=${WHEELS:-.whl}
START=$SECONDS
: > "$OUT/summary.txt"

# part NAME LIMIT LOG COMMAND...: COMMAND under `timeout`, its limit cut to the time left
part() {
  local name=$1 want=$2 log=$3 left limit rc t0
  shift 3
  left=$(( TOTAL_S - (SECONDS - START) ))
  limit=$(( want < left ? want : left ))
  if [ "$limit" -lt 20 ]; then
    echo "== $name: skipped (${left}s left of the script's ${TOTAL_S}s)" | tee -a "$OUT/summary.txt"
    return 0
  fi
  echo "== $name (limit ${limit}s)"
  t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$log" 2>&1
  rc=$?
  tail -n "${TAIL_N:-60}" "$OUT/$log"
  echo "== $name: exit $rc$([ $rc = 124 ] && echo ' (timed out)') after $((SECONDS - t0))s" | tee -a "$OUT/summary.txt"
}
left() { echo $(( TOTAL_S - (SECONDS - START) )); }

if [ "$DEV" = cpu ]; then
  # the same parts on this machine's CPU: the device tests against the CPU itself, tiny sizes
  ROUND_N=${ROUND_N:-16384}; ROUND_FORMATS=${ROUND_FORMATS:-fp8_e4m3,bf16,nf4}
  SMALL=(--model readme --d-model 64 --layers 2 --heads 4 --seq 64 --batch 4 --steps 6 --warmup 2)
  MID=(--model gpt-350m --d-model 64 --layers 2 --heads 4 --seq 64 --batch 2 --steps 6 --warmup 2)
  BIG=(--model gpt-1.3b --d-model 128 --layers 2 --heads 4 --seq 64 --batch 2 --steps 4 --warmup 1)
  BIG_MIN=20
else
  ROUND_N=${ROUND_N:-$((1 << 26))}; ROUND_FORMATS=${ROUND_FORMATS:-fp8_e4m3,fp8_e5m2,bf16,nf4}
  SMALL=(--model readme --steps 25 --warmup 5)
  MID=(--model gpt-350m --steps 200)
  BIG=(--model gpt-1.3b --steps 200)
  BIG_MIN=${BIG_MIN:-150}  # what a GPT-1.3B run of the GPU set needs at the least
fi

if ls "$WHEELS"/*.whl > /dev/null 2>&1; then  # carried wheels (torchao): into a folder of their own
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHEELS"/*.whl > "$OUT/wheels.txt" 2>&1
  rc=$?
  [ $rc = 0 ] && export PYTHONPATH=$PYTHONPATH:/tmp/site
  echo "wheels from $WHEELS: $(cd "$WHEELS" && ls -- *.whl | tr '\n' ' ')(pip exit $rc)" >> "$OUT/wheels.txt"
fi
{
  if [ "$DEV" = cpu ]; then
    echo "FEWBITS_TEST_DEVICE=cpu: no GPU; every part runs on the CPU at tiny sizes"
  else
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  fi
  [ -f "$OUT/wheels.txt" ] && cat "$OUT/wheels.txt"
  $PY - "$DEV" <<'EOF'
import sys, torch
from fewbits.hardware import machine_info
print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, machine_info(sys.argv[1]))
for name in ("triton", "torchao"):
    try:
        print(name, __import__(name).__version__)
    except Exception as exc:  # noqa: BLE001
        print(name, "not importable:", type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
EOF
  $PY -m pip list 2>/dev/null | grep -i -E "^(ml.dtypes|hypothesis|transformers|safetensors|scikit-learn|numpy|pytest|pytest-timeout|torchao) "
} 2>&1 | tee "$OUT/env.txt"
rm -f "$OUT/wheels.txt"

if [ -z "${SKIP_TESTS:-}" ]; then
  TAIL_N=150 part "device tests" "${TEST_S:-150}" device_tests.log \
    $PY -m pytest -q -p no:cacheprovider -o addopts="" -m "not slow" -rfE --tb=short \
    --junitxml="$OUT/device_tests.xml" \
    tests/kernels/test_device_kernels.py tests/quant/test_device_quant.py tests/train/test_device_train.py \
    tests/test_device_misc.py "tests/kernels/test_packing.py::test_cuda_matches_cpu"
fi
[ -n "${SKIP_BENCH:-}" ] && exit 0

# issue 16's GPU training run first (what the other benchmarks leave of the budget is less
# important); --max-seconds lets it stop and report before its timeout would kill it
TRAIN_LIMIT=$(( ${TRAIN_S:-220} < $(left) ? ${TRAIN_S:-220} : $(left) ))
part "bench_train --device $DEV ${MID[*]}" "$TRAIN_LIMIT" train_gpt350m.txt \
  $PY benchmarks/bench_train.py --device "$DEV" --set gpu --schedule sequential "${MID[@]}" --compile torchao --compiled-only \
  --max-seconds $(( TRAIN_LIMIT > 40 ? TRAIN_LIMIT - 15 : 10 )) --json "$OUT/train_gpt350m.json"

part "fewbits bench --device $DEV" "${BENCH_S:-30}" bench_device.txt \
  $FB bench --device "$DEV" --budget 0.5

part "bench_round --device $DEV" "${ROUND_S:-45}" round_device.txt \
  $PY benchmarks/bench_round.py --device "$DEV" --n "$ROUND_N" --repeats 10 \
  --formats "$ROUND_FORMATS" --modes nearest_even,stochastic --json "$OUT/round_device.json"

part "bench_train --device $DEV ${SMALL[*]}" "${SMALL_S:-30}" train_small.txt \
  $PY benchmarks/bench_train.py --device "$DEV" "${SMALL[@]}" --schedule sequential \
  --only "fp32,torch autocast bf16,bf16-mixed,fp8-hybrid,fp16-mixed" --json "$OUT/train_small.json"

if [ "$(left)" -ge "$BIG_MIN" ]; then
  BIG_LIMIT=$(( ${BIG_S:-600} < $(left) ? ${BIG_S:-600} : $(left) ))
  part "bench_train --device $DEV ${BIG[*]}" "$BIG_LIMIT" train_gpt1p3b.txt \
    $PY benchmarks/bench_train.py --device "$DEV" --set gpu --schedule sequential "${BIG[@]}" \
    --compile torchao --compiled-only \
    --max-seconds $(( BIG_LIMIT > 40 ? BIG_LIMIT - 15 : 10 )) --json "$OUT/train_gpt1p3b.json"
else
  echo "== bench_train ${BIG[*]}: skipped ($(left)s left, it needs ${BIG_MIN}s)" | tee -a "$OUT/summary.txt"
fi
echo "== done in $((SECONDS - START))s (budget ${TOTAL_S}s)" | tee -a "$OUT/summary.txt"

# the lent machine returns at most 8 files from $OUT: everything goes into results.tgz, and the
# summary, the device tests' log and the training tables stay beside it (KEEP_FILES=1: no bundle)
if [ -z "${KEEP_FILES:-}" ]; then
  (cd "$OUT" && tar czf results.tgz --exclude results.tgz ./* && \
    find . -maxdepth 1 -type f ! -name results.tgz ! -name summary.txt ! -name device_tests.log \
      ! -name 'train_gpt*.txt' -delete)
  ls "$OUT"
fi
