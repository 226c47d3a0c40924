"""Test-wide isolation of torch.distributed state.

Lightning's single-device runs initialise a process group in the pytest process and pin
MASTER_PORT in the environment; spawned runs would then inherit the port (already bound
by this process's store) and fail with EADDRINUSE. Every test starts with no process group
and, unless it sets one, a fresh free port.

Markers, applied here at collection (registered in pyproject.toml), so that
``bash scripts/test.sh --fast`` (``-m "not multiproc and not cuda and not slow"``) runs the quick part:

* ``multiproc``: every test of a module that can start processes. A module counts when its
  source, or that of a helper module of this folder it imports (directly or through
  another helper: ``lightning_toys``, ``dist_harness``, ``scripts/reliability_launch``,
  ...), names a way to start one: ``run_ranks``, ``start_method``, ``subprocess``,
  ``multiprocessing``, ``Popen``. Every process a test starts goes through one of these
  (Lightning's launchers through ``start_method`` or a helper that names it), so the rule
  errs towards marking: a module that only might start processes is marked too. The rule
  checks itself: a test without the marker that starts a process (``subprocess.Popen``,
  ``multiprocessing``'s ``Process.start``, which Lightning's and torch's launchers use)
  fails, naming the marker it should have had.
* ``cuda``: a test skipped without a CUDA device (a ``skipif`` whose reason names CUDA or a
  GPU, the module's ``pytestmark`` included) and every test of a ``test_cuda*`` module.
* ``slow``: the few single-process tests that take 20 s or more on 2 cores (``SLOW_TESTS``,
  by name, measured); ``--fast`` leaves them out too.
"""
from __future__ import annotations

import ast
import functools
import multiprocessing.process
import os
import subprocess
import traceback
import sys
from functools import lru_cache
from pathlib import Path

import pytest
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

from dist_harness import free_port  # noqa: E402


def shared_profiles() -> Path:
    """shared/profiles beside the checkout (as CI clones it), else the workplace copy."""
    beside = Path(__file__).resolve().parents[2] / "shared" / "profiles"
    return beside if beside.is_dir() else Path("/work/shared/profiles")


#: processes started in this pytest process so far (subprocess.Popen, multiprocessing)
_STARTED = [0]


def _counting(original):
    @functools.wraps(original)
    def start(*args, **kwargs):
        # torch.compile's compile workers are torch's own, started by whichever test compiles first
        if not any("torch/_inductor" in frame.filename for frame in traceback.extract_stack(limit=40)):
            _STARTED[0] += 1
        return original(*args, **kwargs)

    return start


subprocess.Popen.__init__ = _counting(subprocess.Popen.__init__)
multiprocessing.process.BaseProcess.start = _counting(multiprocessing.process.BaseProcess.start)


@pytest.fixture(autouse=True)
def _processes_only_where_marked(request: pytest.FixtureRequest):
    before = _STARTED[0]
    yield
    if _STARTED[0] != before and request.node.get_closest_marker("multiproc") is None:
        pytest.fail(f"{request.node.nodeid} started a process but is not marked multiproc: name how in its module (see tests/conftest.py)", pytrace=False)


@pytest.fixture(autouse=True)
def _isolated_distributed():
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for key in ("MASTER_PORT", "MASTER_ADDR", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK"):
        os.environ.pop(key, None)


TESTS = Path(__file__).resolve().parent
#: single-process tests of 20 s or more on 2 cores (planner sweeps over many profiles, a compiled profile)
SLOW_TESTS = {
    "test_table4_cells_in_the_papers_category",
    "test_plans_match_the_record_except_where_changed_on_purpose",
    "test_a_compiled_layer_is_profiled_with_its_whole_backward_as_b",
    "test_planner_matches_exhaustive_search_on_random_instances",
}
#: names in a module's source that start processes (see the module docstring)
PROCESS_MARKERS = ("run_ranks", "start_method", "subprocess", "multiprocessing", "Popen")


def _helper_file(name: str) -> Path | None:
    """The file of this folder that an import of ``name`` loads, if any."""
    base = TESTS.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imported_helpers(path: Path) -> set[Path]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom):
            package = ".".join(path.relative_to(TESTS).parent.parts[: len(path.relative_to(TESTS).parent.parts) - node.level + 1]) if node.level else ""
            module = ".".join(part for part in (package, node.module or "") if part)
            names = [module, *(f"{module}.{alias.name}" for alias in node.names)]
        for name in names:
            helper = _helper_file(name)
            if helper is not None and helper.name != "conftest.py" and helper != path:
                found.add(helper)
    return found


@lru_cache(maxsize=None)
def starts_processes(path: Path) -> bool:
    """Whether the module at ``path``, or a helper module of this folder it imports, names a
    way to start a process."""
    seen, todo = set(), [path]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        text = current.read_text(encoding="utf-8")
        if any(marker in text for marker in PROCESS_MARKERS):
            return True
        todo.extend(_imported_helpers(current))
    return False


def _needs_cuda(item: pytest.Item) -> bool:
    if Path(str(item.fspath)).name.startswith("test_cuda"):
        return True
    for mark in item.iter_markers("skipif"):
        reason = str(mark.kwargs.get("reason", ""))
        if "CUDA" in reason.upper() or "GPU" in reason.upper():
            return True
    return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if starts_processes(Path(str(item.fspath)).resolve()):
            item.add_marker(pytest.mark.multiproc)
        if _needs_cuda(item):
            item.add_marker(pytest.mark.cuda)
        if item.name.split("[")[0] in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)
