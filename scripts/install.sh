#!/usr/bin/env bash
# Install stageserve into .venv: torch 2.13.0, then the package with the extras given (none by
# default), and Mooncake's Debian libraries first when an extra brings Mooncake.
#   bash scripts/install.sh [EXTRAS]      e.g. bash scripts/install.sh test,cpu
# Extras (pyproject.toml): test; cpu: Mooncake's host-only build; gpu: flashinfer and
# Mooncake's CUDA 13 build. torch: with an NVIDIA GPU, PyPI's build (CUDA); without one, the
# CPU build from PyTorch's CPU index when it answers within TORCH_INDEX_PROBE_S seconds, else
# PyPI's (the CUDA build on Linux x86_64, unless a local index serves another); it says which.
# Environment: VENV (default .venv), PYTHON (default python3), TORCH_CPU_INDEX,
# TORCH_INDEX_PROBE_S (default 5), DRY_RUN=1 (print the commands that change anything).
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=${1:-}
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
TORCH_VERSION=2.13.0
XGRAMMAR_VERSION=0.2.9
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
TORCH_INDEX_PROBE_S=${TORCH_INDEX_PROBE_S:-5}
DEB_PACKAGES="libibverbs1 librdmacm1 libnuma1"

say() { echo "install.sh: $*" >&2; }
run() { if [ -n "${DRY_RUN:-}" ]; then echo "+ $*"; else "$@"; fi; }

has_nvidia_gpu() {
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
    return 0
  fi
  [ -n "$(ls -A /proc/driver/nvidia/gpus 2>/dev/null)" ]
}

cpu_index_answers() {
  "$PYTHON" -c 'import sys, urllib.request
urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=float(sys.argv[2]))' \
    "$TORCH_CPU_INDEX" "$TORCH_INDEX_PROBE_S" >/dev/null 2>&1
}

KNOWN_EXTRAS=$("$PYTHON" -c 'import tomllib
print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]))')
NEEDS_MOONCAKE=""
for extra in ${EXTRAS//,/ }; do
  case " $KNOWN_EXTRAS " in
    *" $extra "*) ;;
    *) say "error: unknown extra '$extra' (known: $KNOWN_EXTRAS)"; exit 2 ;;
  esac
  case "$extra" in cpu | gpu) NEEDS_MOONCAKE=1 ;; esac
done

if [ -n "$NEEDS_MOONCAKE" ] && ! dpkg -s $DEB_PACKAGES >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  say "Mooncake's libraries: $DEB_PACKAGES"
  run $SUDO apt-get update -qq
  run $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $DEB_PACKAGES
fi

if [ -n "${CI:-}" ] || [ ! -x "$VENV/bin/python" ]; then
  run rm -rf "$VENV"
  run "$PYTHON" -m venv "$VENV"
fi

TORCH_INDEX=()
if has_nvidia_gpu; then
  say "NVIDIA GPU found: torch $TORCH_VERSION from PyPI (its CUDA build)"
elif cpu_index_answers; then
  say "no NVIDIA GPU: torch $TORCH_VERSION, the CPU build, from $TORCH_CPU_INDEX"
  TORCH_INDEX=(--index-url "$TORCH_CPU_INDEX")
else
  say "no NVIDIA GPU, but $TORCH_CPU_INDEX is not reachable" \
    "(probed for ${TORCH_INDEX_PROBE_S} s):" \
    "torch $TORCH_VERSION from PyPI instead (on Linux x86_64 its CUDA build, several GB," \
    "unless a local index serves the CPU build)"
fi
run "$VENV/bin/python" -m pip install -q --upgrade pip
run "$VENV/bin/python" -m pip install -q "${TORCH_INDEX[@]}" "torch==$TORCH_VERSION"
run "$VENV/bin/python" -m pip install -q -e ".${EXTRAS:+[$EXTRAS]}"
case ",$EXTRAS," in
  *,structured,*)
    say "structured outputs: xgrammar $XGRAMMAR_VERSION without its triton requirement"
    run "$VENV/bin/python" -m pip install -q --no-deps "xgrammar==$XGRAMMAR_VERSION"
    ;;
esac
if [ -z "${DRY_RUN:-}" ]; then
  BUILD=$("$VENV/bin/python" -c 'import torch
print(torch.__version__, f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU build")')
  say "installed torch $BUILD; extras: ${EXTRAS:-none}"
fi
