"""scripts/test_floor.sh checks the floors pyproject.toml declares, on a subset that exists:
its pins are pyproject's "NAME>=VERSION" floors, and every pytest node id of its subset is
collected by the suite (a renamed test would otherwise drop out of the floor check)."""
from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "test_floor.sh"


def _script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_the_pins_are_pyprojects_floors() -> None:
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    floors = {name: spec.split(">=")[1] for spec in dependencies for name in ("torch", "lightning") if spec.startswith(f"{name}>=")}
    done = _script("--floors")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [f"torch=={floors['torch']}", f"lightning=={floors['lightning']}"]


def test_every_test_of_the_subset_exists() -> None:
    done = _script("--tests")
    assert done.returncode == 0, done.stderr
    ids = done.stdout.split()
    assert any("test_executor_equivalence" in node for node in ids) and any("torchrun" in node for node in ids)
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *ids], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert collected.returncode == 0, collected.stdout[-3000:] + collected.stderr[-2000:]
    found = [line for line in collected.stdout.splitlines() if "::" in line]
    for node in ids:
        assert any(line.startswith(node) for line in found), node


def test_an_unknown_option_is_refused() -> None:
    done = _script("--install-everything")
    assert done.returncode == 2 and "usage: bash scripts/test_floor.sh" in done.stderr
