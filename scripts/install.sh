#!/usr/bin/env bash
# Create .venv and install lightning_dapple with its test extra.
# torch==2.13.0 goes first: this machine keeps a CPU wheel of it, and installing it before
# lightning/torchmetrics stops pip from fetching a multi-GB CUDA build of a newer torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
if [ -d /opt/wheels ]; then
  PIP+=(--find-links /opt/wheels)
fi
"${PIP[@]}" "torch==2.13.0"
"${PIP[@]}" -e ".[test]"
.venv/bin/python -c "import torch, lightning, lightning_dapple; print('installed: torch', torch.__version__, 'lightning', lightning.__version__)"
