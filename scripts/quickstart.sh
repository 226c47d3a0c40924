#!/usr/bin/env bash
# Install (scripts/install.sh) and run the main job: a tiny model trained with
# Trainer(strategy="dapple") on 4 local CPU processes, on generated data.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/python examples/quickstart.py "$@"
