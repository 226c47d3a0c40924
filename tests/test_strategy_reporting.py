"""A failed run says what failed on one line, once, whichever launcher started the ranks;
DAPPLE_DEBUG=1 brings the tracebacks back."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "fail_with_dapple.py"
# the failing rank names the schedule action it failed in (execute/action_errors.py)
LINE = "lightning_dapple: error: rank 1: RuntimeError: in action 1F0: deliberate failure at step 1"


def _run(tmp_path: Path, start_method: str, debug: bool, kind: str = "runtime", rank: int = 1) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "DAPPLE_DEBUG")}
    env["PYTHONWARNINGS"] = "ignore"
    if debug:
        env["DAPPLE_DEBUG"] = "1"
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path), start_method, str(rank), kind], capture_output=True, text=True, timeout=200, cwd=tmp_path, env=env
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("start_method", ["popen", "spawn"])
def test_a_rank_failure_prints_one_line_once(tmp_path: Path, start_method: str) -> None:
    result = _run(tmp_path, start_method, debug=False)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower() or "Traceback" in line]
    assert len(errors) == 1 and errors[0].startswith(LINE), result.stderr[-3000:]
    assert "DAPPLE_DEBUG=1" in errors[0]


@pytest.mark.timeout(300)
def test_debug_flag_shows_the_traceback(tmp_path: Path) -> None:
    result = _run(tmp_path, "popen", debug=True)
    assert result.returncode != 0
    assert "Traceback" in result.stderr and "deliberate failure at step 1" in result.stderr
    assert "the step's actions on stage 1: " in result.stderr and ">>1F0<<" in result.stderr
    assert "lightning_dapple: error:" not in result.stderr


@pytest.mark.timeout(300)
@pytest.mark.parametrize("start_method", ["popen", "spawn"])
def test_a_refusal_only_the_last_stage_finds_is_printed_once_by_it(tmp_path: Path, start_method: str) -> None:
    """A configuration error raised on one rank only (the last stage's loss check, a second
    self(...) call) is printed by that rank: the rank that holds the peer's failure stays
    quiet, and so does every other."""
    result = _run(tmp_path, start_method, debug=False, kind="refusal")
    assert result.returncode != 0
    errors = [line for line in (result.stdout + result.stderr).splitlines() if "error" in line.lower() or "Traceback" in line]
    assert len(errors) == 1, result.stderr[-3000:]
    assert "DappleConfigError: " in errors[0] and "deliberate refusal at step 1. Fix: do not refuse" in errors[0], errors[0]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("hook", "rank"), [("setup", 1), ("configure_optimizers", 1), ("on_train_batch_end", 0)])
def test_an_error_in_a_lightning_hook_on_one_rank_is_printed_once_by_that_rank(tmp_path: Path, hook: str, rank: int) -> None:
    """Before the pipeline exists (setup), while it is set up (configure_optimizers) and
    between steps (a callback): the failing rank's line, and no other."""
    result = _run(tmp_path, "popen", debug=False, kind=f"hook:{hook}", rank=rank)
    assert result.returncode != 0
    errors = [line for line in (result.stdout + result.stderr).splitlines() if "error" in line.lower() or "Traceback" in line]
    assert len(errors) == 1, result.stderr[-3000:]
    assert f"rank {rank}: RuntimeError: deliberate failure in a hook on rank {rank}" in errors[0], errors[0]
