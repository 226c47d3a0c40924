#!/usr/bin/env bash
# Install (scripts/install.sh) and run the whole test suite; CI runs it with no flag.
#   bash scripts/test.sh                       # everything
#   bash scripts/test.sh --fast                # the quick part: -m "not multiproc and not cuda and not slow"
#   bash scripts/test.sh tests/test_cli_plan.py -k json   # other arguments go to pytest
# The markers are applied in tests/conftest.py (its docstring says which tests get them).
# Exit code 5 (no tests ran) counts as a failure.
set -uo pipefail
cd "$(dirname "$0")/.."
args=()
for arg in "$@"; do
  if [ "$arg" = "--fast" ]; then
    args+=(-m "not multiproc and not cuda and not slow")
  else
    args+=("$arg")
  fi
done
bash scripts/install.sh || exit 1
# a fatal signal in any process (spawned ranks too) prints every thread's Python stack
export PYTHONFAULTHANDLER=1
.venv/bin/python -m pytest -q -p no:cacheprovider ${args[@]+"${args[@]}"}
status=$?
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$status"
