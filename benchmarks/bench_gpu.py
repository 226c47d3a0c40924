"""The executor against plain Lightning loops on one GPU, with the paper's models, and the
report of the one-command GPU check (``gpu_report``; ``scripts/gpu_check.sh`` writes it).

Runs ``bench_overhead.py --part single --device cuda`` for BERT and VGG-19 in bf16
(``--precision``, default bf16-true), M = 4 for the pipeline variants, one stage: plain,
accumulate (M micro-batches, as Lightning's ``accumulate_grad_batches``), dapple M=1 and
M, with ooo, with recompute="always"; at full size each variant timed alone with its peak
allocated memory, at the smaller sizes all built at once and timed in rotating blocks
(``--side-by-side``), so that clock drift falls on every variant alike. ``--size`` picks the models:

* ``full``: BERT-48 (DAPPLE Table 1: hidden 1024, 16 heads, 48 blocks; sequence 128, global
  batch 64) and VGG-19 (224 x 224 images, 1000 classes, global batch 128);
* ``small``: BERT-12 at the same width (global batch 32) and VGG-19 at half width (global
  batch 32), which run in a minute or two on one GPU (the GPU check's size);
* ``tiny``: a few-layer BERT and VGG for a CPU smoke run of the whole path (``--device cpu``).

Writes one JSON per model (``gpu_<model>_<precision>.json``, ``_<size>`` added unless full).

    python benchmarks/bench_gpu.py                         # full size -> benchmarks/results/gpu_*.json
    python benchmarks/bench_gpu.py --size small --models bert
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import bench_overhead  # noqa: E402

__all__ = ["MODELS", "SIZES", "benchmark", "gpu_report", "ratios", "result_path"]

MODELS = ("bert", "vgg")
_BERT_LARGE = ["--model", "bert", "--hidden", "1024", "--heads", "16", "--seq", "128", "--vocab", "30522"]
SIZES: dict[str, dict[str, list[str]]] = {
    "full": {
        "bert": [*_BERT_LARGE, "--blocks", "48", "--batch", "64"],
        "vgg": ["--model", "vgg", "--width", "1", "--image", "224", "--fc", "4096", "--vocab", "1000", "--batch", "128"],
    },
    "small": {
        "bert": [*_BERT_LARGE, "--blocks", "12", "--batch", "32"],
        "vgg": ["--model", "vgg", "--width", "0.5", "--image", "224", "--fc", "4096", "--vocab", "1000", "--batch", "32"],
    },
    "tiny": {
        "bert": ["--model", "bert", "--hidden", "32", "--heads", "2", "--seq", "16", "--vocab", "64", "--blocks", "2", "--batch", "8"],
        "vgg": ["--model", "vgg", "--width", "0.0625", "--image", "32", "--fc", "32", "--vocab", "4", "--batch", "8"],
    },
}
# the report's ratios: (variant, baseline) as bench_overhead names them; "plain" and
# "accumulate" are the loops Lightning runs (plain, and accumulate_grad_batches=M)
_TIME_RATIOS = (
    ("dapple M=1 / plain Lightning", "dapple-M1", "plain"),
    ("dapple M={m} / Lightning accumulate_grad_batches={m}", "dapple", "accumulate"),
    ("ooo / no ooo (dapple M={m})", "dapple-ooo", "dapple"),
    ("recompute / no recompute (dapple M={m})", "dapple-recompute", "dapple"),
)
_MEMORY_RATIOS = (
    ("peak memory, dapple M=1 / plain Lightning", "dapple-M1", "plain"),
    ("peak memory, dapple M={m} / Lightning accumulate_grad_batches={m}", "dapple", "accumulate"),
)


def result_path(out_dir: Path, model: str, precision: str, size: str) -> Path:
    """Where ``benchmark`` writes one model's results."""
    suffix = "" if size == "full" else f"_{size}"
    return out_dir / f"gpu_{model}_{precision}{suffix}.json"


def benchmark(model: str, size: str, precision: str = "bf16-true", rounds: int = 5, block: int = 4, out_dir: Path = HERE / "results", device: str = "cuda") -> dict[str, Any]:
    """One model's comparison (bench_overhead's single part), written to ``result_path``
    and returned as bench_overhead reports it (median ms, ratios, peak GiB, config)."""
    out = result_path(out_dir, model, precision, size)
    out.parent.mkdir(parents=True, exist_ok=True)
    bench_overhead.main([
        "--part", "single", "--device", device, "--precision", precision, *SIZES[size][model],
        "--rounds", str(rounds), "--block", str(block), "--out", str(out),
        *([] if size == "full" else ["--side-by-side"]),  # small models fit together: timed in rotating blocks
    ])
    return json.loads(out.read_text())


def ratios(result: Mapping[str, Any]) -> dict[str, float | None]:
    """The GPU issue's ratios from one model's bench_overhead result: step time of the
    executor against the loops Lightning runs, of ooo and recomputation against neither,
    and peak allocated memory against Lightning's loops (None where a number is missing,
    e.g. peak memory on a CPU)."""
    m = int(result.get("config", {}).get("micro_batches", 4))
    times, peaks = result.get("ratios", {}), result.get("peak_gib") or {}
    out: dict[str, float | None] = {}
    for label, variant, base in _TIME_RATIOS:
        out[label.format(m=m)] = times.get(f"{variant} / {base}")
    for label, variant, base in _MEMORY_RATIOS:
        have = variant in peaks and peaks.get(base)
        out[label.format(m=m)] = peaks[variant] / peaks[base] if have else None
    return out


def gpu_report(
    device: Mapping[str, Any],
    versions: Mapping[str, str],
    tests: Sequence[Mapping[str, Any]],
    benchmarks: Mapping[str, Mapping[str, Any]],
    staged: Mapping[str, Any],
) -> dict[str, Any]:
    """The GPU check's report (``gpu_report.json``).

    ``tests``: one entry per CUDA test (``test``, ``outcome`` passed/failed/error/skipped,
    ``message``); ``benchmarks``: per model, bench_overhead's result or ``{"error": text}``;
    ``staged``: the two-rank run on one GPU (``ok``, ``wire``, ``reference_diff``, or
    ``error``). ``failures`` lists everything that failed, and no passing test at all
    counts as a failure (skipped tests are reported, not failed: a test for two GPUs skips on
    one); ``ok`` is true when the list is empty."""
    failures = [f"test {t['test']}: {t['outcome']}: {t.get('message', '')}" for t in tests if t.get("outcome") in ("failed", "error")]
    if not any(t.get("outcome") == "passed" for t in tests):
        failures.append("tests: none passed")
    report_benchmarks: dict[str, Any] = {}
    for model, result in benchmarks.items():
        if "error" in result:
            failures.append(f"benchmark {model}: {result['error']}")
            report_benchmarks[model] = {"error": result["error"]}
            continue
        report_benchmarks[model] = {
            "ratios": ratios(result),
            "median_ms": result.get("median_ms", {}),
            "peak_gib": result.get("peak_gib", {}),
            "config": result.get("config", {}),
        }
    if not staged.get("ok"):
        failures.append(f"staged two-rank run: {staged.get('error') or 'did not match single-process training'}")
    return {
        "ok": not failures,
        "failures": failures,
        "device": dict(device),
        "versions": dict(versions),
        "tests": [dict(t) for t in tests],
        "benchmarks": report_benchmarks,
        "staged_two_ranks": dict(staged),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--precision", choices=("bf16-true", "bf16-mixed", "32-true"), default="bf16-true")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--block", type=int, default=4)
    parser.add_argument("--out-dir", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    for model in args.models:
        result = benchmark(model, args.size, args.precision, args.rounds, args.block, args.out_dir, args.device)
        print(json.dumps({model: ratios(result)}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
