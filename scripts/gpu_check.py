"""The GPU check's runs, after ``scripts/gpu_check.sh`` has found CUDA and put the
repository and Hydra on ``PYTHONPATH``: the CUDA tests, the executor against Lightning's
loops (``benchmarks/bench_gpu.py``), a two-rank pipeline sharing one GPU through the
``staged`` wire, and ``gpu_report.json`` (``bench_gpu.gpu_report``). Exit status 1 when
anything failed.

    python scripts/gpu_check.py [--report gpu_report.json] [--size small]
    python scripts/gpu_check.py --device cpu --size tiny --tests tests/test_x.py   # the same path on a CPU

Every part runs under its own time limit, all of them inside ``--budget-s`` (7.75 minutes),
so the check ends in bounded time whatever hangs. With ``--gpus 2`` or more (``gpu_check.sh``
passes the count it finds) the tests that need several GPUs (``MULTI_GPU_TESTS``) run first,
one at a time, within 7 more minutes, and the other CUDA tests without them.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from importlib import metadata
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_gpu  # noqa: E402

# every test that needs CUDA: the CUDA files, and the CUDA cases of the files that test a
# feature on the CPU first (a pytest node id, or a file with ``-k``-style selection by name)
CUDA_TESTS = (
    "tests/test_cuda*.py",
    "tests/test_batchnorm.py::test_one_gpu_with_recomputation_moves_statistics_as_one_process",
    "tests/test_tied_weights.py::test_tied_gpt_on_ranks_sharing_one_gpu_keeps_its_copies_identical",
    "tests/test_traced_layers.py::test_traced_layers_follow_the_module_to_the_gpu",
    "tests/test_weight_grad_memory.py::*cuda*",
)
# the tests that need two or three GPUs (NCCL between ranks): with several GPUs they run
# first, one at a time, each with the GPUs to itself (docs/gpus.md lists what each shows)
MULTI_GPU_TESTS = (
    "tests/test_cuda_multi_gpu.py",
    "tests/test_cuda.py::test_two_gpus_hold_only_their_stage",
    "tests/test_cuda_checkpoint.py::test_a_checkpoint_of_two_gpus_under_nccl_loads_without_one_and_resumes",
    "tests/test_cuda_hot_path.py::test_frozen_stage_under_fp16_on_two_gpus",
    "tests/test_cuda_transport.py::test_nccl_round_trips_every_dtype",
    "tests/test_cuda_transport.py::test_every_schedule_runs_through_nccl_with_crossing_traffic",
    "tests/test_cuda_transport.py::test_a_middle_stage_receives_while_its_send_downstream_waits",
    "tests/test_cuda_transport.py::test_training_under_nccl_matches_single_process",
    "tests/test_cuda_transport.py::test_a_peer_that_never_sends_ends_the_job_within_the_timeout",
    "tests/test_cuda_transport.py::test_chunked_plans_under_nccl_match_single_process",
)
MULTI_GPU_S = 420.0  # their time limit, on top of the one-GPU budget
STAGED_PLAN = {"global_batch_size": 8, "micro_batches": 2, "stages": [{"layers": [0, 2], "devices": [0]}, {"layers": [2, 4], "devices": [1]}]}
STAGED_STEPS = 3
STAGED_TOLERANCE = 1e-8  # float64 on the GPU; the micro-batches sum in another order than one batch


class Deadline:
    """Seconds left of the check's budget, handed out part by part."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def limit(self, wanted: float) -> float:
        return max(1.0, min(wanted, self.end - time.monotonic()))


def parse_junit(path: Path) -> list[dict[str, str]]:
    """One entry per test case of a pytest JUnit XML file: ``test`` (file::name),
    ``outcome`` (passed, failed, error or skipped) and ``message``."""
    out = []
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        test = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name', '')}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                lines = (found.get("message") or found.text or "").strip().splitlines()
                message = lines[0][:300] if lines else ""
                break
        out.append({"test": test, "outcome": outcome, "message": message})
    return out


def pytest_targets(patterns: Sequence[str]) -> tuple[list[str], list[str]]:
    """pytest's node ids for ``patterns``: a file glob expands to its files, ``file::name``
    stays a node id, and ``file::*part*`` becomes the file's tests whose ids hold ``part``
    (collected here, so that the selection applies to that file alone). Returns (node ids,
    patterns that match nothing)."""
    targets: list[str] = []
    missing = []
    for pattern in patterns:
        path, _, name = pattern.partition("::")
        found = sorted(glob.glob(str(ROOT / path)))
        if found and name.startswith("*") and name.endswith("*"):
            found = [node for node in _collect(found) if name.strip("*") in node.partition("::")[2]]
        elif name:
            found = [f"{file}::{name}" for file in found]
        targets += found
        if not found:
            missing.append(pattern)
    return targets, missing


def _collect(files: Sequence[str]) -> list[str]:
    """The node ids pytest collects from ``files``, as absolute paths; none when collecting
    fails or runs past 2 minutes (the pattern is then reported as matching nothing)."""
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files]
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return []
    return [str(ROOT / line) for line in done.stdout.splitlines() if "::" in line]


def run_tests(
    patterns: Sequence[str], seconds: float, log: Path | None = None, workers: int = 1, deselect: Sequence[str] = ()
) -> list[dict[str, str]]:
    """The tests ``patterns`` name (``pytest_targets``) under pytest, one entry per test, in
    ``workers`` processes (pytest-xdist) when more than one, less the node ids (or their
    prefixes) in ``deselect``; pytest's whole output goes to ``log`` when given."""
    targets, missing = pytest_targets(patterns)
    if missing:
        return [{"test": pattern, "outcome": "error", "message": "matches no test (no such file or name, or pytest could not collect it)"} for pattern in missing]
    with tempfile.TemporaryDirectory() as folder:
        junit = Path(folder) / "tests.xml"
        # a hanging test fails alone (pytest-timeout) instead of costing the whole run its report
        command = [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", "--timeout=150", f"--junitxml={junit}", *targets]
        command += [f"--deselect={node}" for node in deselect]
        if workers > 1:
            command[3:3] = ["-n", str(workers)]
        try:
            done = subprocess.run(command, cwd=ROOT, timeout=seconds, env={**os.environ, "PYTHONFAULTHANDLER": "1"}, capture_output=True, text=True)
        except subprocess.TimeoutExpired as exc:
            if log is not None:
                log.write_text(_text(exc.stdout) + _text(exc.stderr))
            return [{"test": " ".join(patterns), "outcome": "error", "message": f"pytest ran past {seconds:.0f} s"}]
        if log is not None:
            log.write_text(done.stdout + done.stderr)
        sys.stdout.write(done.stdout[-4000:])
        if not junit.is_file():
            return [{"test": pattern, "outcome": "error", "message": (done.stderr.strip().splitlines() or ["pytest wrote no report"])[-1][:300]}]
        return parse_junit(junit)


def _text(output: bytes | str | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else (output or "")


def run_benchmark(model: str, size: str, device: str, seconds: float, out_dir: Path) -> dict[str, Any]:
    """``bench_gpu.py`` for one model in its own process (a crash or a hang stays there)."""
    command = [sys.executable, str(ROOT / "benchmarks" / "bench_gpu.py"), "--models", model, "--size", size, "--device", device, "--out-dir", str(out_dir)]
    if device == "cpu":
        command += ["--precision", "32-true", "--rounds", "2", "--block", "1"]
    try:
        done = subprocess.run(command, cwd=ROOT, timeout=seconds, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        return {"error": f"ran past {seconds:.0f} s"}
    precision = "32-true" if device == "cpu" else "bf16-true"
    path = bench_gpu.result_path(out_dir, model, precision, size)
    if done.returncode != 0 or not path.is_file():
        return {"error": (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1][:300]}
    return json.loads(path.read_text())


def _staged_model() -> Any:
    """A small BERT in float64, the same on every rank (seeded), dropout off."""
    import torch

    from lightning_dapple.models.bert import BertMLM

    torch.manual_seed(1234)
    return BertMLM(vocab_size=64, hidden=32, layers=2, heads=2, ffn=64, seq_len=16, dropout=0.0).double()


def _staged_batches(device: Any) -> list[tuple[Any, Any]]:
    """Masked-LM batches with the same number of masked tokens in every sample, so the
    mean loss over micro-batches weighted by rows is the mean over the global batch."""
    import torch

    from lightning_dapple.models.common import IGNORE_INDEX

    generator = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STAGED_STEPS):
        ids = torch.randint(1, 64, (STAGED_PLAN["global_batch_size"], 16), generator=generator)
        labels = torch.full_like(ids, IGNORE_INDEX)
        labels[:, ::4] = ids[:, ::4]
        ids[:, ::4] = 1
        out.append((ids.to(device), labels.to(device)))
    return out


class _Loss:
    """The executor's entry into the model: the batch's input and the model's loss."""

    def __init__(self, module: Any) -> None:
        self.module = module

    def make_input(self, batch: Any) -> Any:
        return batch[0]

    def compute_loss(self, batch: Any, forward: Any) -> Any:
        return self.module.loss(forward(batch[0]), batch[1])


def _staged_worker(rank: int, world: int, device_name: str) -> dict[str, Any]:
    """One rank of the two-stage plan, both ranks on ``device_name``, over the staged wire."""
    import torch

    from lightning_dapple.execute.failure import FailureChannel
    from lightning_dapple.execute.runner import StageRunner
    from lightning_dapple.plan.plan import plan_from_dict
    from lightning_dapple.profile.ties import tied_parameters

    torch.set_num_threads(1)
    device = torch.device(device_name)
    plan = plan_from_dict(STAGED_PLAN)
    stage = plan.stages[plan.stage_of_rank(rank)]
    model = _staged_model()
    layers = [model.layers[index].to(device) for index in range(stage.start, stage.end)]
    failure = FailureChannel(rank, timeout_s=60)
    runner = StageRunner.for_plan(plan, rank, layers, device, failure, ties=tied_parameters(model.layers), wire="staged")
    optimizer = torch.optim.Adam(runner.parameters, lr=1e-3)
    for batch in _staged_batches(device):
        runner.train_step(batch, _Loss(model))
        optimizer.step()
    runner.finish()
    params = {f"{stage.start + i}.{key}": value.detach().cpu().flatten().tolist() for i, layer in enumerate(layers) for key, value in layer.state_dict().items()}
    return {"wire": runner.transport.wire.name, "params": params}


def _reference(device_name: str) -> dict[str, list[float]]:
    """The same steps in one process on the whole model: what the pipeline must match."""
    import torch

    model = _staged_model().to(device_name)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for ids, labels in _staged_batches(torch.device(device_name)):
        optimizer.zero_grad(set_to_none=True)
        model.loss(model(ids), labels).backward()
        optimizer.step()
    return {f"{index}.{key}": value.detach().cpu().flatten().tolist() for index, layer in enumerate(model.layers) for key, value in layer.state_dict().items()}


def staged_two_ranks(device_name: str, seconds: float) -> dict[str, Any]:
    """Two ranks sharing one device, a stage each, through the staged wire (pinned host
    buffers over gloo on a GPU), against single-process training of the same steps."""
    from lightning_dapple.execute.launch import run_ranks

    try:
        results = run_ranks(_staged_worker, 2, device_name, timeout_s=seconds)
    except TimeoutError as exc:
        return {"ok": False, "error": str(exc)[:300]}
    if "__errors__" in results:
        errors = results["__errors__"]
        return {"ok": False, "error": " | ".join(str(text).strip().splitlines()[-1] for text in errors.values())[:300]}
    reference = _reference(device_name)
    got = {key: value for rank in (0, 1) for key, value in results[rank]["params"].items()}
    if set(got) != set(reference):
        return {"ok": False, "error": f"parameters {sorted(set(reference) ^ set(got))[:3]} missing or extra"}
    diff = max(abs(a - b) for key in reference for a, b in zip(got[key], reference[key]))
    wires = sorted({results[rank]["wire"] for rank in (0, 1)})
    ok = wires == ["staged"] and diff < STAGED_TOLERANCE
    return {"ok": ok, "wire": ",".join(wires), "steps": STAGED_STEPS, "reference_diff": diff, "tolerance": STAGED_TOLERANCE}


def device_info(device_name: str) -> dict[str, Any]:
    import torch

    if not device_name.startswith("cuda"):
        return {"name": platform.processor() or "cpu", "kind": "cpu"}
    props = torch.cuda.get_device_properties(0)
    return {
        "name": props.name,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "capability": f"{props.major}.{props.minor}",
        "multiprocessors": props.multi_processor_count,
        "count": torch.cuda.device_count(),
        "cuda": torch.version.cuda,
    }


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("torch", "lightning", "hydra-core", "omegaconf", "numpy", "rich"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def default_workers() -> int:
    """Test processes: 4 where pytest-xdist is installed (the tests share the GPU, each one
    small; most of their time is process start-up), else 1."""
    try:
        import xdist  # noqa: F401
    except ImportError:
        return 1
    return 4


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", type=Path, default=ROOT / "gpu_report.json")
    parser.add_argument("--size", choices=sorted(bench_gpu.SIZES), default="small")
    parser.add_argument("--device", default="cuda", help="cuda (the check); cpu runs the same path on a CPU")
    parser.add_argument("--tests", nargs="+", default=list(CUDA_TESTS), help="tests to run: file globs under the repository, node ids, or file::*part* for the file's tests named with part")
    parser.add_argument("--workers", type=int, default=None, help="test processes (default: 4 with pytest-xdist, else 1)")
    parser.add_argument("--budget-s", type=float, default=465.0, help="the whole check's time limit (one GPU)")
    parser.add_argument("--gpus", type=int, default=1, help="GPUs found (gpu_check.sh counts them); with 2 or more the multi-GPU tests run first, one at a time")
    args = parser.parse_args(argv)
    several = args.gpus >= 2
    deadline = Deadline(args.budget_s + (MULTI_GPU_S if several else 0.0))
    device_name = "cuda:0" if args.device == "cuda" else args.device
    started = time.monotonic()
    tests: list[dict[str, str]] = []
    if several:
        tests += run_tests(MULTI_GPU_TESTS, deadline.limit(MULTI_GPU_S), log=args.report.with_name(args.report.stem + "_multi_gpu_pytest.txt"))
    tests += run_tests(
        args.tests, deadline.limit(270), log=args.report.with_name(args.report.stem + "_pytest.txt"), workers=args.workers or default_workers(),
        deselect=MULTI_GPU_TESTS if several else (),
    )
    with tempfile.TemporaryDirectory() as folder:
        benchmarks = {model: run_benchmark(model, args.size, args.device, deadline.limit(75), Path(folder)) for model in bench_gpu.MODELS}
    staged = staged_two_ranks(device_name, deadline.limit(60))
    report = bench_gpu.gpu_report(device_info(device_name), versions(), tests, benchmarks, staged)
    report["size"] = args.size
    report["wall_s"] = round(time.monotonic() - started, 1)
    args.report.write_text(json.dumps(report, indent=2) + "\n")
    print(f"gpu_check: {'ok' if report['ok'] else 'FAILED'}: {sum(t['outcome'] == 'passed' for t in tests)} of {len(tests)} tests passed, "
          f"report in {args.report} ({report['wall_s']} s)")
    for failure in report["failures"]:
        print(f"gpu_check: failed: {failure}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
