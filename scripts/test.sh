#!/usr/bin/env bash
# Install (scripts/install.sh) and run the whole test suite. Exit code 5 (no tests ran)
# counts as a failure.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh || exit 1
# a fatal signal in any process (spawned ranks too) prints every thread's Python stack
export PYTHONFAULTHANDLER=1
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
status=$?
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$status"
