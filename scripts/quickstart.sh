#!/usr/bin/env bash
# Install (scripts/install.sh) and run the main job: the tiny BERT recipe trained with
# Trainer(strategy="dapple") on 4 local CPU processes under an automatic plan.
# Extra arguments are Hydra overrides, e.g.:
#   bash scripts/quickstart.sh trainer.max_steps=50
#   bash scripts/quickstart.sh recipe=vgg_tiny
# The run directory (outputs/<recipe>/<time>/) gets the resolved config, the plan JSON and
# table, simulated and measured timelines, metrics.csv and result.json.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/dapple-train recipe=bert_tiny "$@"
