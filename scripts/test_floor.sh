#!/usr/bin/env bash
# The floor check: the oldest torch and Lightning that pyproject.toml allows (its
# "torch>=X" and "lightning>=Y", installed as ==X and ==Y) in a second environment,
# .venv-floor, with the package (editable) and its test extra at their newest, and a fast
# subset of the suite run there: the planners, the executor's equivalence to
# single-device training, mixed precision, one Trainer run per launcher (spawn,
# Lightning's subprocess launcher, torchrun), and the set-up probes (the run optimizer
# copied through Lightning's configure_optimizers reading, the links).
#
#   bash scripts/test_floor.sh            # install (first time: about 3 GB of torch's CUDA wheels) and run
#   bash scripts/test_floor.sh --floors   # print the pins it installs
#   bash scripts/test_floor.sh --tests    # print the subset, one pytest node id a line
#
# Older torch releases on the package index are CUDA builds whose CUDA libraries
# `import torch` loads even on a CPU: the environment takes about 5 GB.
set -uo pipefail
cd "$(dirname "$0")/.."

TESTS=(
  tests/test_planner.py
  tests/test_planner_pipedream.py
  tests/test_executor_equivalence.py
  tests/test_precision.py::test_mixed_precision_matches_plain_lightning
  tests/test_strategy_friction.py::test_a_second_reference_to_the_layers_trains_and_consolidates
  tests/test_strategy_trainer.py::test_subprocess_launcher_from_a_script
  tests/test_reliability_torchrun.py::test_torchrun_two_nodes_matches_single_process
  tests/test_process_group.py
  tests/test_optimizer_step.py
  tests/test_collective_probe.py
)

floor() {  # the version in pyproject.toml's "NAME>=VERSION"
  sed -n "s/^ *\"$1>=\([0-9][0-9.]*\)\".*/\1/p" pyproject.toml | head -n 1
}
PINS=("torch==$(floor torch)" "lightning==$(floor lightning)")
for pin in "${PINS[@]}"; do
  if [[ "$pin" == *== ]]; then
    echo "test_floor: pyproject.toml has no floor for ${pin%==} (a \"${pin%==}>=X\" dependency)" >&2
    exit 1
  fi
done

case "${1:-}" in
  --floors) printf '%s\n' "${PINS[@]}"; exit 0 ;;
  --tests) printf '%s\n' "${TESTS[@]}"; exit 0 ;;
  "") ;;
  *) echo "usage: bash scripts/test_floor.sh [--floors | --tests]" >&2; exit 2 ;;
esac

PYTHON="${PYTHON:-python3}"
VENV=.venv-floor
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV" || exit 1
fi
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "${PINS[@]}" -e ".[test]" || exit 1
"$VENV/bin/python" - "${PINS[@]}" <<'PY' || exit 1
import sys
import lightning
import torch

got = {"torch": torch.__version__.split("+")[0], "lightning": lightning.__version__}
for pin in sys.argv[1:]:
    name, version = pin.split("==")
    if got[name] != version:
        sys.exit(f"test_floor: {name} {got[name]} is installed, not the floor {version}")
print(f"test_floor: torch {torch.__version__}, lightning {lightning.__version__}")
PY
export PYTHONFAULTHANDLER=1
"$VENV/bin/python" -m pytest -q -p no:cacheprovider "${TESTS[@]}"
status=$?
if [ "$status" -eq 5 ]; then
  echo "test_floor: pytest collected no tests: failing" >&2
  exit 1
fi
exit "$status"
