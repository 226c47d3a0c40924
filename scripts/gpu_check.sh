#!/usr/bin/env bash
# One command on a GPU machine: the CUDA tests (tests/test_cuda*.py), the executor against
# Lightning's loops at a size that runs in minutes (benchmarks/bench_gpu.py --size small),
# a two-rank pipeline sharing one GPU through the staged wire, and gpu_report.json
# (device, versions, each test's result, the ratios). Exit status 1 when anything failed;
# under 8 minutes on one H100. With several GPUs (torch.cuda.device_count() >= 2) it first
# runs the tests that need two or three (NCCL between ranks: tests/test_cuda_multi_gpu.py
# and the multi-GPU cases of the other CUDA files, scripts/gpu_check.py: MULTI_GPU_TESTS)
# one at a time, each with the GPUs to itself, within 7 more minutes; docs/gpus.md says what
# each is expected to show.
#
#   bash scripts/gpu_check.sh [REPORT [OPTION...]]   # REPORT: default gpu_report.json in the repository;
#                                                    # options go to scripts/gpu_check.py (e.g. --budget-s 300)
#
# It installs nothing into the machine's Python (its torch stays): the repository goes on
# PYTHONPATH, and Hydra, which GPU images lack, is installed from wheels carried beside the
# repository into .gpu_site/. Fetch the wheels on a machine that reaches the package index:
#   bash scripts/gpu_check.sh --fetch-wheels   # -> .gpu_wheels/ (hydra-core, omegaconf, antlr4)
# Without CUDA it says so in one line and exits 0, having run nothing.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
WHEELS="${DAPPLE_GPU_WHEELS:-.gpu_wheels}"
SITE=.gpu_site

if [ "${1:-}" = "--fetch-wheels" ]; then
  mkdir -p "$WHEELS" || exit 1
  "$PYTHON" -m pip download --quiet --no-deps -d "$WHEELS" hydra-core==1.3.2 omegaconf==2.3.0 || exit 1
  # antlr4's runtime is published as source only: build its (pure Python) wheel here
  "$PYTHON" -m pip wheel --quiet --no-deps -w "$WHEELS" antlr4-python3-runtime==4.9.3 || exit 1
  ls "$WHEELS"
  exit 0
fi

if ! found=$("$PYTHON" -c 'import sys, torch; print(torch.__version__); sys.exit(0 if torch.cuda.is_available() else 3)' 2>/dev/null); then
  echo "gpu_check: no CUDA device (torch ${found:-cannot be imported}): nothing run"
  exit 0
fi
GPUS=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 1)
if [ "${GPUS:-1}" -ge 2 ] 2>/dev/null; then
  echo "gpu_check: $GPUS GPUs: the multi-GPU tests run first, one at a time"
else
  GPUS=1
fi

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PYTHON" -c 'import hydra, omegaconf' 2>/dev/null; then
  if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    echo "gpu_check: Hydra is not installed here and $WHEELS/ holds no wheels. Fix: run 'bash scripts/gpu_check.sh --fetch-wheels' where the package index is reachable and bring $WHEELS/ along" >&2
    exit 1
  fi
  "$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --upgrade --target "$SITE" "$WHEELS"/*.whl || exit 1
  export PYTHONPATH="$PYTHONPATH:$PWD/$SITE"
fi
exec "$PYTHON" scripts/gpu_check.py --report "${1:-gpu_report.json}" --gpus "$GPUS" "${@:2}"
