#!/usr/bin/env bash
# Install stageserve from scratch into .venv: Mooncake's Debian libraries if missing,
# CPU torch pinned to 2.13.0 (served from local disk here; other versions download
# gigabytes), then the package with the extras given (default: cpu).
#   bash scripts/install.sh [EXTRAS]      e.g. bash scripts/install.sh test,cpu
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=${1:-cpu}

DEB_PACKAGES="libibverbs1 librdmacm1 libnuma1"
if ! dpkg -s $DEB_PACKAGES >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $DEB_PACKAGES
fi

PYTHON=${PYTHON:-python3}
if [ -n "${CI:-}" ] || [ ! -x .venv/bin/python ]; then
  rm -rf .venv
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[$EXTRAS]"
