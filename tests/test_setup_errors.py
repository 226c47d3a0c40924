"""A failure in one of Lightning's own hooks on one rank, before the strategy's set-up (its
failure channel does not exist yet): the failing rank prints one line naming the error,
the others print nothing, and every process of the run ends in bounded time
(``strategy/reporting.py``)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "fail_before_setup.py"


def _alive(pid: int) -> bool:
    """Whether a process runs (a zombie has ended, only not been reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as stream:
            return stream.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("hook", "rank", "start_method"),
    [("prepare_data", 0, "popen"), ("setup", 0, "popen"), ("configure_model", 1, "popen"), ("setup", 0, "spawn")],
)
def test_a_hook_failing_on_one_rank_prints_one_line_from_that_rank(tmp_path: Path, hook: str, rank: int, start_method: str) -> None:
    """With ``popen`` every rank is a process of its own that prints for itself; with
    ``spawn`` the launching process prints the root cause the ranks hand back."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "DAPPLE_DEBUG")}
    env["PYTHONWARNINGS"] = "ignore"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path), start_method, hook, str(rank)],
        capture_output=True, text=True, timeout=200, cwd=tmp_path, env=env,
    )
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower() or "Traceback" in line]
    expected = f"lightning_dapple: error: rank {rank}: ValueError: deliberate failure in {hook} on rank {rank}"
    assert len(errors) == 1 and errors[0].startswith(expected), result.stderr[-3000:]
    pids = [int(path.name) for path in (tmp_path / "pids").iterdir()]
    assert len(pids) == (2 if start_method == "popen" else 1)  # spawned ranks do not run the script's main
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in pids), "a rank outlived the failed run"
