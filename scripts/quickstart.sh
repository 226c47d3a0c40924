#!/usr/bin/env bash
# Install (scripts/install.sh) and run the quick start: a tiny BERT trained with
# Trainer(strategy="dapple") on 4 local CPU processes under an automatic plan. The recipe's
# cluster file (small-memory-cpu) gives each process 24 MiB, less than the model's weights,
# gradients and AdamW state, so the planner splits the model into pipeline stages. It
# prints the plan, the measured and the simulated step side by side,
# and where the timeline pictures are.
# Extra arguments are Hydra overrides, e.g.:
#   bash scripts/quickstart.sh trainer.max_steps=50
#   bash scripts/quickstart.sh recipe=bert_tiny     # a model small enough for data parallelism
# The run directory (outputs/<recipe>/<time>/) gets the resolved config, the plan JSON and
# table, simulated and measured timelines, metrics.csv and result.json.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/dapple-train recipe=bert_pipeline_tiny "$@"
