"""The one-command GPU check, on a CPU: without CUDA it says so in one line and runs
nothing; its report (``bench_gpu.gpu_report``) holds the device, the versions, each test's
result and the ratios, and fails on any failure; its parts (the JUnit reading, the
benchmark's ratios, the two-rank run through the staged wire) run here as they will there."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "scripts"))

import bench_gpu  # noqa: E402
import gpu_check  # noqa: E402

DEVICE = {"name": "NVIDIA H100 80GB HBM3", "memory_gib": 79.2, "capability": "9.0", "multiprocessors": 132, "count": 1, "cuda": "13.0"}
VERSIONS = {"python": "3.12.3", "torch": "2.11.0", "lightning": "2.6.6", "hydra-core": "1.3.2"}
STAGED_OK = {"ok": True, "wire": "staged", "steps": 3, "reference_diff": 1e-16, "tolerance": 1e-8}


def _bench_result(m: int = 4) -> dict:
    """What bench_overhead reports for one model on a GPU (numbers made up)."""
    return {
        "median_ms": {"plain": 100.0, "accumulate": 110.0, "dapple-M1": 102.0, "dapple": 115.0, "dapple-ooo": 113.0, "dapple-recompute": 140.0},
        "ratios": {
            "dapple-M1 / plain": 1.02, "dapple / accumulate": 1.045, "dapple-ooo / accumulate": 1.03,
            "dapple-ooo / dapple": 0.98, "dapple-recompute / dapple": 1.22,
        },
        "peak_gib": {"plain": 10.0, "accumulate": 6.0, "dapple-M1": 10.5, "dapple": 6.6, "dapple-ooo": 6.7, "dapple-recompute": 4.0},
        "config": {"micro_batches": m, "model": "bert"},
    }


def test_without_cuda_one_line_exit_0_and_nothing_run(tmp_path: Path) -> None:
    report = tmp_path / "gpu_report.json"
    env = {**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(report)], capture_output=True, text=True, timeout=120, env=env)
    lines = (done.stdout + done.stderr).splitlines()
    assert done.returncode == 0 and len(lines) == 1, done.stdout + done.stderr
    assert lines[0].startswith("gpu_check: no CUDA device (torch ") and lines[0].endswith("nothing run")
    assert not report.exists()


def test_the_report_holds_device_versions_tests_and_ratios() -> None:
    tests = [
        {"test": "tests/test_cuda.py::test_one_gpu_trains_like_plain_lightning", "outcome": "passed", "message": ""},
        {"test": "tests/test_cuda_transport.py::test_nccl_batched_p2p_round_trips_every_dtype", "outcome": "skipped", "message": "needs two CUDA devices"},
    ]
    report = bench_gpu.gpu_report(DEVICE, VERSIONS, tests, {"bert": _bench_result(), "vgg": _bench_result()}, STAGED_OK)
    assert report["ok"] is True and report["failures"] == []
    assert report["device"] == DEVICE and report["versions"] == VERSIONS and report["tests"] == tests
    assert report["staged_two_ranks"] == STAGED_OK
    ratios = report["benchmarks"]["bert"]["ratios"]
    assert ratios == {
        "dapple M=1 / plain Lightning": 1.02,
        "dapple M=4 / Lightning accumulate_grad_batches=4": 1.045,
        "ooo / no ooo (dapple M=4)": 0.98,
        "recompute / no recompute (dapple M=4)": 1.22,
        "peak memory, dapple M=1 / plain Lightning": pytest.approx(1.05),
        "peak memory, dapple M=4 / Lightning accumulate_grad_batches=4": pytest.approx(1.1),
    }
    assert report["benchmarks"]["vgg"]["peak_gib"]["plain"] == 10.0
    json.dumps(report)  # what gpu_check.py writes


def test_any_failure_fails_the_report() -> None:
    passed = {"test": "tests/test_cuda.py::a", "outcome": "passed", "message": ""}
    failed = {"test": "tests/test_cuda.py::b", "outcome": "failed", "message": "assert 0.1 < 1e-10"}
    benchmarks = {"bert": _bench_result(), "vgg": {"error": "CUDA out of memory"}}
    report = bench_gpu.gpu_report(DEVICE, VERSIONS, [passed, failed], benchmarks, {"ok": False, "error": "rank 1 died"})
    assert report["ok"] is False
    assert report["failures"] == [
        "test tests/test_cuda.py::b: failed: assert 0.1 < 1e-10",
        "benchmark vgg: CUDA out of memory",
        "staged two-rank run: rank 1 died",
    ]
    assert report["benchmarks"]["vgg"] == {"error": "CUDA out of memory"}
    skipped_only = bench_gpu.gpu_report(DEVICE, VERSIONS, [{"test": "t", "outcome": "skipped", "message": ""}], {}, STAGED_OK)
    assert skipped_only["failures"] == ["tests: none passed"]


def test_peak_memory_ratios_are_none_without_peaks() -> None:
    result = _bench_result(m=8)
    result["peak_gib"] = {}
    ratios = bench_gpu.ratios(result)
    assert ratios["dapple M=8 / Lightning accumulate_grad_batches=8"] == 1.045
    assert ratios["peak memory, dapple M=8 / Lightning accumulate_grad_batches=8"] is None


def test_junit_results_are_read_per_test(tmp_path: Path) -> None:
    (tmp_path / "test_three.py").write_text(
        "import pytest\n"
        "def test_good():\n    assert True\n"
        "def test_bad():\n    assert 1 == 2, 'one is not two'\n"
        "@pytest.mark.skip(reason='needs two CUDA devices')\n"
        "def test_skipped():\n    pass\n"
    )
    junit = tmp_path / "junit.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", "test_three.py"], cwd=tmp_path, capture_output=True, timeout=120)
    got = {entry["test"].split("::")[1]: entry for entry in gpu_check.parse_junit(junit)}
    assert {name: entry["outcome"] for name, entry in got.items()} == {"test_good": "passed", "test_bad": "failed", "test_skipped": "skipped"}
    assert "one is not two" in got["test_bad"]["message"] and "needs two CUDA devices" in got["test_skipped"]["message"]
    assert got["test_good"]["test"] == "test_three.py::test_good"


@pytest.mark.timeout(300)
def test_the_two_rank_staged_run_matches_single_process_training() -> None:
    """The check's pipeline of two ranks sharing one device, on the CPU (the staged wire
    also runs over gloo with CPU tensors)."""
    result = gpu_check.staged_two_ranks("cpu", 240)
    assert result["ok"] is True and result["wire"] == "staged", result
    assert result["reference_diff"] < 1e-10


@pytest.mark.timeout(300)
def test_the_benchmark_reports_every_ratio(tmp_path: Path) -> None:
    """bench_gpu's path end to end at its tiny size on the CPU (no peak memory there)."""
    result = bench_gpu.benchmark("bert", "tiny", precision="32-true", rounds=1, block=1, out_dir=tmp_path, device="cpu")
    assert bench_gpu.result_path(tmp_path, "bert", "32-true", "tiny").is_file()
    ratios = bench_gpu.ratios(result)
    assert len(ratios) == 6
    assert all(value > 0 for label, value in ratios.items() if not label.startswith("peak memory"))
    assert all(value is None for label, value in ratios.items() if label.startswith("peak memory"))


def test_test_patterns_expand_and_name_what_matches_nothing() -> None:
    """File globs, node ids and ``file::*part*`` selections; what matches nothing is an error entry."""
    targets, missing = gpu_check.pytest_targets(["tests/test_gpu_che*.py", "tests/test_gpu_check.py::*without_cuda*", "tests/nothing_*.py", "tests/test_gpu_check.py::*no_such_test*"])
    assert targets[0] == str(ROOT / "tests" / "test_gpu_check.py")
    assert targets[1:] == [str(ROOT / "tests" / "test_gpu_check.py::test_without_cuda_one_line_exit_0_and_nothing_run")]
    assert missing == ["tests/nothing_*.py", "tests/test_gpu_check.py::*no_such_test*"]
    entries = gpu_check.run_tests(["tests/nothing_*.py"], seconds=60)
    assert entries == [{"test": "tests/nothing_*.py", "outcome": "error", "message": "matches no test (no such file or name, or pytest could not collect it)"}]


def test_with_several_gpus_the_script_passes_their_count(tmp_path: Path) -> None:
    """gpu_check.sh counts the GPUs (torch.cuda.device_count()) and hands the count to
    gpu_check.py, which then runs the multi-GPU tests first (a stand-in Python answers the
    script's questions as a 3-GPU machine would and prints what it was asked to run)."""
    fake = tmp_path / "python"
    fake.write_text(
        "#!/usr/bin/env bash\n"
        'if [ "$1" = "-c" ]; then\n'
        '  case "$2" in\n'
        '    *is_available*) echo 2.13.0; exit 0;;\n'
        '    *device_count*) echo 3; exit 0;;\n'
        f'    *) exec {sys.executable} "$@";;\n'
        "  esac\n"
        "fi\n"
        'echo "ran: $*"\n'
    )
    fake.chmod(0o755)
    report = tmp_path / "gpu_report.json"
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(report)], capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHON": str(fake)})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "gpu_check: 3 GPUs: the multi-GPU tests run first, one at a time" in done.stdout
    assert f"ran: scripts/gpu_check.py --report {report} --gpus 3" in done.stdout


def test_several_gpus_run_the_multi_gpu_tests_first_alone_and_not_again(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls = []

    def run_tests(patterns, seconds, log=None, workers=1, deselect=()):
        calls.append({"patterns": tuple(patterns), "workers": workers, "deselect": tuple(deselect), "seconds": seconds})
        return [{"test": str(patterns[0]), "outcome": "passed", "message": ""}]

    monkeypatch.setattr(gpu_check, "run_tests", run_tests)
    monkeypatch.setattr(gpu_check, "run_benchmark", lambda *args: {"error": "not run here"})
    monkeypatch.setattr(gpu_check, "staged_two_ranks", lambda *args: STAGED_OK)
    monkeypatch.setattr(gpu_check, "device_info", lambda name: DEVICE)
    for gpus in (1, 2):
        calls.clear()
        gpu_check.main(["--report", str(tmp_path / f"report{gpus}.json"), "--gpus", str(gpus), "--workers", "4"])
        if gpus == 1:
            assert [(c["patterns"], c["workers"], c["deselect"]) for c in calls] == [(gpu_check.CUDA_TESTS, 4, ())]
        else:
            first, rest = calls
            assert (first["patterns"], first["workers"]) == (gpu_check.MULTI_GPU_TESTS, 1)
            assert (rest["patterns"], rest["workers"], rest["deselect"]) == (gpu_check.CUDA_TESTS, 4, gpu_check.MULTI_GPU_TESTS)
            assert first["seconds"] == gpu_check.MULTI_GPU_S


def test_every_test_that_needs_several_gpus_is_in_the_multi_gpu_pass() -> None:
    """A test skipped below two or three CUDA devices (or in a file skipped so) runs in the
    serial pass: listed by node id or by its file; every listed node exists."""
    import ast

    needs: set[str] = set()
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        tree = ast.parse(path.read_text())
        several = "device_count() < 2" in path.read_text() or "device_count() < 3" in path.read_text()
        if not several:
            continue
        module_wide = any(
            isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in node.targets) and "TWO_GPUS" in ast.unparse(node.value)
            for node in tree.body
        )
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                marks = " ".join(ast.unparse(d) for d in node.decorator_list)
                if module_wide or "device_count() < 2" in marks or "device_count() < 3" in marks:
                    needs.add(f"tests/{path.name}::{node.name}")
    listed = set(gpu_check.MULTI_GPU_TESTS)
    unlisted = sorted(node for node in needs if node not in listed and node.split("::")[0] not in listed)
    assert unlisted == []
    targets, missing = gpu_check.pytest_targets(gpu_check.MULTI_GPU_TESTS)
    assert missing == [] and len(targets) == len(gpu_check.MULTI_GPU_TESTS)
