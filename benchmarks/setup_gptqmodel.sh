#!/usr/bin/env bash
# Install GPTQModel (the GPTQ checkpoint reader of transformers, with optimum) in a venv of its own,
# CPU-only, for tests/files/test_gptq_format.py::test_gptqmodel_loads_it_through_transformers (which
# skips without it) and by hand.
#
#   benchmarks/setup_gptqmodel.sh              # create the venv and install (about 2 minutes)
#   benchmarks/setup_gptqmodel.sh --dry-run    # print the venv and the commands, install nothing
#   benchmarks/setup_gptqmodel.sh --force      # reinstall even if the venv already imports gptqmodel
#   FEWBITS_GPTQ_VENV=/some/dir PYTHON=python3.12 benchmarks/setup_gptqmodel.sh
#
# The last line of stdout is the venv's python (progress goes to stderr); the test finds the venv at
# ${FEWBITS_GPTQ_VENV:-~/.cache/fewbits/gptqmodel-venv}.
#
# Why a venv of its own, and --no-deps: gptqmodel 7.7.0 asks for torch>=2.14.1 while fewbits' CI pins
# torch 2.13.0, and it pulls pandas, pyarrow and datasets (about 1.6 GB in all). It runs on 2.13.0:
# gptqmodel goes in without its dependencies, then those dependencies less torch, under a
# constraint that keeps torch at TORCH_VERSION. Its CPU int4 kernel compiles with g++ the first time
# a model loads (about a minute), cached under ~/.cache/gptqmodel.
set -euo pipefail

VERSION="${GPTQMODEL_VERSION:-7.7.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
TRANSFORMERS_VERSION="${TRANSFORMERS_VERSION:-5.25.0}"
OPTIMUM_VERSION="${OPTIMUM_VERSION:-2.3.0}"
VENV="${FEWBITS_GPTQ_VENV:-$HOME/.cache/fewbits/gptqmodel-venv}"
BASE_PYTHON="${PYTHON:-python3}"
DRY_RUN=0
FORCE=0
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY_RUN=1 ;;
        --force) FORCE=1 ;;
        -h|--help) sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "setup_gptqmodel.sh: unknown option $arg (options: --dry-run, --force, --help)" >&2; exit 2 ;;
    esac
done

log() { echo "setup_gptqmodel.sh: $*" >&2; }
die() { echo "setup_gptqmodel.sh: error: $*" >&2; exit 1; }

VPY="$VENV/bin/python"
SMOKE='import gptqmodel, optimum, transformers; print(gptqmodel.__version__)'

if [[ $DRY_RUN == 1 ]]; then
    log "venv: $VENV (FEWBITS_GPTQ_VENV), gptqmodel $VERSION, torch $TORCH_VERSION, base python: $BASE_PYTHON"
    log "would run:"
    log "  $BASE_PYTHON -m venv $VENV"
    log "  $VPY -m pip install -c <torch==$TORCH_VERSION> torch==$TORCH_VERSION transformers==$TRANSFORMERS_VERSION accelerate safetensors optimum==$OPTIMUM_VERSION"
    log "  $VPY -m pip download --no-deps --no-binary :all: gptqmodel==$VERSION; $VPY -m pip install --no-deps <its sdist>"
    log "  $VPY -m pip install -c <torch==$TORCH_VERSION> -r <its requirements.txt without torch>"
    log "  $VPY -c '$SMOKE'"
    echo "$VPY"
    exit 0
fi

if [[ $FORCE == 0 && -x "$VPY" ]]; then
    if have="$("$VPY" -c "$SMOKE" 2>/dev/null | tail -n 1)" && [[ -n "$have" ]]; then
        log "gptqmodel $have already imports in $VENV (--force reinstalls)"
        echo "$VPY"
        exit 0
    fi
fi

command -v "$BASE_PYTHON" >/dev/null 2>&1 || die "no $BASE_PYTHON on PATH (set PYTHON)"
start=$(date +%s)
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
if [[ ! -x "$VPY" ]]; then
    log "creating the venv $VENV"
    mkdir -p "$(dirname "$VENV")"
    "$BASE_PYTHON" -m venv "$VENV" || die "python3 -m venv $VENV failed (Debian: apt-get install python3-venv)"
fi
echo "torch==$TORCH_VERSION" > "$work/constraints.txt"
log "installing torch $TORCH_VERSION, transformers $TRANSFORMERS_VERSION, optimum $OPTIMUM_VERSION"
"$VPY" -m pip install --quiet -c "$work/constraints.txt" "torch==$TORCH_VERSION" "transformers==$TRANSFORMERS_VERSION" \
    accelerate safetensors "optimum==$OPTIMUM_VERSION" >&2 || die "installing torch/transformers/optimum failed"
log "downloading gptqmodel $VERSION (an sdist; pure Python)"
"$VPY" -m pip download --quiet --no-deps --no-binary :all: "gptqmodel==$VERSION" -d "$work" >&2 \
    || die "pip download gptqmodel==$VERSION failed"
sdist="$(ls "$work"/gptqmodel-*.tar.gz | head -n 1)"
NODEPS=("$VPY" -m pip install --quiet --no-deps "$sdist")
[[ $FORCE == 1 ]] && NODEPS+=(--force-reinstall)
"${NODEPS[@]}" >&2 || die "pip install --no-deps $sdist failed"
tar -xzf "$sdist" -C "$work"
req="$(ls "$work"/gptqmodel-*/requirements.txt | head -n 1)"
grep -v -E '^torch([<>=!~ ]|$)' "$req" > "$work/requirements-without-torch.txt"
log "installing gptqmodel's requirements less torch (pandas, pyarrow, datasets, ...)"
"$VPY" -m pip install --quiet -c "$work/constraints.txt" -r "$work/requirements-without-torch.txt" >&2 \
    || die "installing gptqmodel's requirements failed"
log "smoke test: $SMOKE"
if ! version="$("$VPY" -c "$SMOKE" 2>/dev/null | tail -n 1)"; then
    die "gptqmodel installed but does not import (run: $VPY -c '$SMOKE')"
fi
log "gptqmodel $version imports; install took $(( $(date +%s) - start )) s"
echo "$VPY"
