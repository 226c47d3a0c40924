"""Measured effect of out-of-order backprop and recomputation on CPU pipelines.

Model: ``--layers`` dense layers ``Linear(width, width) + GELU`` (float32) and a linear
head, cut into S equal stages (one gloo rank per stage, one thread each). For such layers
the weight gradient is as heavy as the input gradient (dW and dX are GEMMs of the same
size), so W is about half of every backward: the case out-of-order backprop targets.

For S = 2 and S = 4 (``--stages``), with the DAPPLE schedule and M micro-batches (defaults:
M = 4, global batch 512, width 1024, 7 hidden layers):

* step time, ooo off vs on (recompute never): variants run round-robin in one process
  group for ``--steps`` timed steps each after ``--warmup`` steps; a step's time is the
  slowest rank's ``train_step``; medians, and the median of per-round ratios; also the
  CPU time all ranks spent per step (the work, without the waiting);
* peak stashed bytes (``runner.stats.peak_stash_bytes``, the executor's measurement) with
  ooo on and recompute never / always / except_last / auto, against the planner's estimate
  (``simulate.plan_and_schedule.stage_memory``) and a stated budget per device: weights + gradients +
  Adam state of a stage plus ``--budget-fraction`` (0.7) of the largest stash the plain
  schedule (no ooo, no recomputation) needs, so no stage that holds more than one
  micro-batch fits without recomputation. Fixed modes use the default deferral caps;
  ``auto`` is resolved under the budget by ``apply_ooo_recompute`` from a profile;
* every variant's parameters after the timed steps are compared with the plain variant's
  (same data, same seeds): they must agree to 1e-4 (float32).

Simulated part (``--skip-measured`` runs only this): the bubble of uniform F:B:W = 1:1:1
stages (S = 4, M = 8) with and without ooo, and for BERT-48 (global batch 64) and GNMT-16
(1024) from shared/profiles/dapple on paper-a the plan DAPPLE's planner chooses
(``simulate.plan_and_schedule.make_plan``) simulated without ooo and with
it (``apply_ooo_recompute``: caps and k chosen; the graph texts' B/W split is the estimate
of ``with_weight_split``), plus that plan with every stage recomputing (DAPPLE 6.5).

Deferred-W cost per layer (``--deferred-layers`` runs only this, in one process, one
thread): what a split backward costs the executor beyond what the profile prices. For
stages of L = 1, 2, 4, 8 identical layers (a small ``Conv2d`` and a small ``Linear``
block) and for the tiny VGG-19 recipe's layers cut into 4 straight stages, one micro-batch
of ``--deferred-rows`` rows through the executor's ``Stage``: F + I + W (split) against
F + B, paired, the median of ``--deferred-repeats``; less what the layer profile and the
action-overhead probe price for the split (the layers' I + W - B, and the probe's I + W - B
overheads). The rest is fitted as a + c L: ``c`` is the cost per deferred layer that
``strategy.ooo_choice.DEFERRED_LAYER_MS`` prices.

    python benchmarks/bench_ooo.py                       # both parts: S = 2 and 4, M = 4, batch 512, width 1024
    python benchmarks/bench_ooo.py --skip-simulated --stages 2 --steps 30
    python benchmarks/bench_ooo.py --deferred-layers --out benchmarks/results/ooo_deferred_layers.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from lightning_dapple.execute.launch import run_ranks

HERE = Path(__file__).resolve().parent
SEED = 1234
MODES = ("never", "always", "except_last", "auto")


def make_layers(width: int, layers: int) -> list[Any]:
    import torch
    from torch import nn

    torch.manual_seed(SEED)
    body = [nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers)]
    return [*body, nn.Linear(width, width)]


def make_batch(step: int, batch: int, width: int) -> tuple[Any, Any]:
    import torch

    gen = torch.Generator().manual_seed(10_000 + step)
    return torch.randn(batch, width, generator=gen), torch.randn(batch, width, generator=gen)


def plans(cfg: dict) -> dict[str, dict]:
    """Plan dicts per variant name for ``cfg['num_stages']`` (auto resolved here)."""
    from lightning_dapple.cluster import Cluster
    from lightning_dapple.plan.plan import straight_plan
    from lightning_dapple.simulate.memory_fit import apply_ooo_recompute
    from lightning_dapple.simulate.plan_and_schedule import stage_memory
    from lightning_dapple.profile.profiler import profile_layers

    stages, total = cfg["num_stages"], cfg["layers"] + 1
    per = total // stages
    bounds = [per * i for i in range(1, stages)]
    base = straight_plan(total, bounds, cfg["batch"], cfg["micro_batches"])
    layers = make_layers(cfg["width"], cfg["layers"])
    sample = make_batch(0, cfg["batch"], cfg["width"])[0][: cfg["batch"] // cfg["micro_batches"]]
    profile = profile_layers(layers, sample, repeats=3, warmup=1)
    cluster = Cluster(1, stages)
    plain = apply_ooo_recompute(base, profile, cluster, ooo=False, recompute="never")
    memory, stash, _, _ = stage_memory(plain, profile, cluster)
    weights = [m - s for m, s in zip(memory, stash)]
    budget = max(weights) + cfg["budget_fraction"] * max(stash)
    out: dict[str, dict] = {"plain": plain.to_dict()}
    estimates: dict[str, list[float]] = {"plain": stash}
    for mode in MODES:
        # fixed modes: no budget (default deferral caps); auto: under the stated budget
        limit = budget if mode == "auto" else None
        plan = apply_ooo_recompute(base, profile, cluster, recompute=mode, memory_budget_bytes=limit)
        name = "ooo" if mode == "never" else f"ooo/{mode}"
        out[name] = plan.to_dict()
        estimates[name] = stage_memory(plan, profile, cluster)[1]
    cfg["budget_bytes"] = budget
    cfg["weights_bytes"] = weights
    cfg["estimates"] = estimates
    cfg["profile"] = {
        "forward_ms": sum(l.forward_ms for l in profile.layers),
        "backward_input_ms": sum(l.input_grad_ms for l in profile.layers),
        "backward_weight_ms": sum(l.weight_grad_ms for l in profile.layers),
    }
    return out


def worker(rank: int, world: int, cfg: dict) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from lightning_dapple.execute.failure import FailureChannel
    from lightning_dapple.execute.runner import StageRunner
    from lightning_dapple.plan.plan import plan_from_dict

    class Callbacks:
        def make_input(self, batch: Any) -> Any:
            return batch[0]

        def compute_loss(self, batch: Any, forward: Any) -> Any:
            return F.mse_loss(forward(batch[0]), batch[1])

    failure = FailureChannel(rank, timeout_s=cfg["timeout"])
    runners: dict[str, Any] = {}
    optimizers: dict[str, Any] = {}
    for name, data in cfg["plans"].items():
        plan = plan_from_dict(data)
        stage = plan.stages[plan.stage_of_rank(rank)]
        layers = make_layers(cfg["width"], cfg["layers"])
        local = layers[stage.start : stage.end]
        runners[name] = StageRunner.for_plan(plan, rank, local, torch.device("cpu"), failure, ties=())
        optimizers[name] = torch.optim.Adam(runners[name].parameters, lr=1e-3)
    timed = [name for name in ("plain", "ooo") if name in runners]
    times: dict[str, list[float]] = {name: [] for name in timed}
    cpu: dict[str, list[float]] = {name: [] for name in timed}
    stash: dict[str, int] = {}
    callbacks = Callbacks()
    for step in range(cfg["warmup"] + cfg["steps"]):
        batch = make_batch(step, cfg["batch"], cfg["width"])
        order = timed if step % 2 == 0 else list(reversed(timed))
        for name in order:
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            runners[name].train_step(batch, callbacks)
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            used = torch.tensor([time.process_time() - start_cpu], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            dist.all_reduce(used, op=dist.ReduceOp.SUM)
            optimizers[name].step()
            if step >= cfg["warmup"]:
                times[name].append(float(elapsed) * 1000.0)
                cpu[name].append(float(used) * 1000.0)
    for name, runner in runners.items():  # one more step each, same batch: stash and parameters
        batch = make_batch(cfg["warmup"] + cfg["steps"], cfg["batch"], cfg["width"])
        if name not in timed:  # bring the untimed variants to the same number of steps
            for step in range(cfg["warmup"] + cfg["steps"]):
                runner.train_step(make_batch(step, cfg["batch"], cfg["width"]), callbacks)
                optimizers[name].step()
        runner.train_step(batch, callbacks)
        optimizers[name].step()
        stash[name] = runner.stats.peak_stash_bytes
    for runner in runners.values():
        runner.finish()
    params = {name: torch.cat([p.detach().reshape(-1) for p in runner.parameters]).tolist()[:4096] for name, runner in runners.items()}
    origin = runners["ooo"].stats.timeline[0][0]
    timeline = [(round((s - origin) * 1000, 3), round((e - origin) * 1000, 3), k, mb) for s, e, k, mb, *_ in runners["ooo"].stats.timeline]
    return {"times": times, "cpu": cpu, "stash": stash, "params": params, "timeline": timeline, "stage": rank}


def summarise(cfg: dict, ranks: dict[int, Any]) -> dict:
    timed = ranks[0]["times"]
    plain, ooo = timed["plain"], timed["ooo"]
    ratios = [b / a for a, b in zip(plain, ooo)]
    stash = {name: [ranks[r]["stash"][name] for r in sorted(ranks)] for name in ranks[0]["stash"]}
    gaps = {}
    for name in ranks[0]["params"]:
        gaps[name] = max(max(abs(x - y) for x, y in zip(ranks[r]["params"][name], ranks[r]["params"]["plain"])) for r in ranks)
    weights = cfg["weights_bytes"]
    fits = {name: all(w + s <= cfg["budget_bytes"] for w, s in zip(weights, values)) for name, values in stash.items()}
    modes = {name: [s.get("recompute", "never") for s in cfg["plans"][name]["stages"]] for name in cfg["plans"]}
    return {
        "median_step_ms": {"plain": statistics.median(plain), "ooo": statistics.median(ooo)},
        "speedup_median": statistics.median(plain) / statistics.median(ooo),
        "paired_ratio_median": statistics.median(ratios),
        "median_cpu_ms_all_ranks": {name: statistics.median(values) for name, values in ranks[0]["cpu"].items()},
        "step_ms": timed,
        "peak_stash_bytes": stash,
        "estimated_stash_bytes": cfg["estimates"],
        "within_estimate": {name: all(m <= e + 1e-6 for m, e in zip(stash[name], cfg["estimates"][name])) for name in stash},
        "budget_bytes": cfg["budget_bytes"],
        "weights_bytes": weights,
        "fits_budget": fits,
        "recompute": modes,
        "param_gap_vs_plain": gaps,
        "profile": cfg["profile"],
        "timeline_ooo_rank0": ranks[0]["timeline"],
    }


def simulated() -> dict[str, Any]:
    """The simulated benchmark (no processes): uniform stages and the papers' profiles."""
    from lightning_dapple.cluster import load_cluster
    from lightning_dapple.plan.costs import StageCost
    from lightning_dapple.simulate.memory_fit import apply_ooo_recompute
    from lightning_dapple.simulate.plan_and_schedule import stage_memory
    from lightning_dapple.profile.loader import load_profile
    from lightning_dapple.schedule import build_schedule
    from lightning_dapple.schedule.ooo import build_ooo_schedule
    from lightning_dapple.simulate import simulate, simulate_plan

    out: dict[str, Any] = {}
    unit = StageCost(1.0, 2.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0)
    for name in ("dapple", "gpipe"):
        plain = simulate(build_schedule(name, 4, 8), [unit] * 4)
        ooo = simulate(build_ooo_schedule(name, 4, 8), [unit] * 4)
        out[f"uniform-{name}"] = {
            "latency": {"plain": plain.latency_ms, "ooo": ooo.latency_ms},
            "bubble": {"plain": plain.bubble_fraction, "ooo": ooo.bubble_fraction},
            "peak_in_flight_ooo": [st.peak_in_flight for st in ooo.stages],
            "actions_ooo": [build_ooo_schedule(name, 4, 8).describe(s) for s in range(4)],
        }
        print(f"uniform F:B:W=1:1:1 S=4 M=8 {name}: bubble {plain.bubble_fraction:.4f} -> {ooo.bubble_fraction:.4f} with ooo "
              f"(latency {plain.latency_ms:.0f} -> {ooo.latency_ms:.0f} units)")
    from lightning_dapple.simulate.plan_and_schedule import make_plan as planner
    planner_name = "make_plan"
    cluster = load_cluster("paper-a")
    profiles = Path(__file__).resolve().parents[2] / "shared" / "profiles" / "dapple"
    if not profiles.is_dir():
        profiles = Path("/work/shared/profiles/dapple")
    for name, batch in (("bert-48-pbs-2.txt", 64), ("gnmt-16-pbs-64.txt", 1024)):
        if not (profiles / name).is_file():
            continue
        profile = load_profile(profiles / name)
        start = time.perf_counter()
        plan = planner(profile, cluster, batch)
        planned_s = time.perf_counter() - start
        plain = simulate_plan(plan, profile, cluster)
        chosen = apply_ooo_recompute(plan, profile, cluster, ooo=True, recompute="never")
        ooo = simulate_plan(chosen, profile, cluster)
        rc = apply_ooo_recompute(plan, profile, cluster, ooo=False, recompute="always")
        rc_sim = simulate_plan(rc, profile, cluster)
        memory = {
            "plain": stage_memory(plan, profile, cluster)[0],
            "ooo": stage_memory(chosen, profile, cluster)[0],
            "recompute_always": stage_memory(rc, profile, cluster)[0],
        }
        out[name] = {
            "planner": planner_name, "planning_s": planned_s, "plan": plan.to_dict(),
            "latency_ms": {"plain": plain.latency_ms, "ooo": ooo.latency_ms, "recompute_always": rc_sim.latency_ms},
            "bubble": {"plain": plain.bubble_fraction, "ooo": ooo.bubble_fraction},
            "first_k": chosen.first_k, "ooo_in_flight": chosen.ooo_in_flight,
            "memory_bytes": memory,
        }
        print(f"{name} ({plan.kind()}, M={plan.micro_batches}, {planner_name}): {plain.latency_ms:.1f} ms -> {ooo.latency_ms:.1f} ms with ooo "
              f"(bubble {plain.bubble_fraction:.3f} -> {ooo.bubble_fraction:.3f}, k={chosen.first_k}, caps {chosen.ooo_in_flight}); "
              f"recompute always: {rc_sim.latency_ms:.1f} ms, peak memory {max(memory['recompute_always']) / 2**30:.2f} GiB "
              f"vs {max(memory['plain']) / 2**30:.2f} GiB")
    return out


def _split_extra_ms(layers: list[Any], x: Any, repeats: int) -> float:
    """Median over ``repeats`` paired runs of (F + I + W) - (F + B) of one micro-batch ``x``
    through a middle ``Stage`` of ``layers`` (split vs not), in milliseconds."""
    import torch

    from lightning_dapple.execute.stage import Stage

    with torch.no_grad():
        out = x
        for layer in layers:
            out = layer(out)
    grad = torch.randn_like(out)
    rows = x.shape[0]
    stages = {split: Stage(layers, torch.device("cpu"), 1, 0, 3, split=split, w_count={0: 1} if split else None) for split in (False, True)}

    def once(split: bool) -> float:
        stage = stages[split]
        stage.end_step()
        stage.begin_step(torch.zeros(rows, 1), rows, [(0, rows)], None, 1.0, (0, 0))
        stage.receive(0, x.clone().requires_grad_(True))
        start = time.perf_counter()
        stage.forward(0)
        like = stage.gradient_like(0)
        stage.receive_gradient(0, like, [grad])
        stage.backward_input(0)
        stage.input_gradients(0)
        if split:
            stage.backward_weight(0)
        return (time.perf_counter() - start) * 1e3

    for _ in range(10):
        once(False), once(True)
    return statistics.median(once(True) - once(False) for _ in range(repeats))


def _priced_extra_ms(layers: list[Any], x: Any, overhead: Any) -> float:
    """What the layer profile and the overhead probe price for the split: layers' I + W - B
    and the probe's I + W - B overheads."""
    from lightning_dapple.profile.profiler import profile_layers

    profile = profile_layers(layers, x, repeats=30, warmup=5)
    layer_ms = sum(layer.input_grad_ms + layer.weight_grad_ms - layer.backward_ms for layer in profile.layers)
    return layer_ms + overhead.backward_input + overhead.backward_weight - overhead.backward


def deferred_layers(rows: int, repeats: int) -> dict[str, Any]:
    """The deferred-W cost per layer (module docstring, ``--deferred-layers``)."""
    import torch
    from torch import nn

    from lightning_dapple.execute.overhead_probe import measure_action_overhead
    from lightning_dapple.models.vgg import VGG19

    torch.set_num_threads(1)
    overhead = measure_action_overhead()
    families = {
        "conv": (lambda: nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU()), torch.randn(rows, 8, 16, 16)),
        "linear": (lambda: nn.Sequential(nn.Linear(64, 64), nn.ReLU()), torch.randn(rows, 64)),
    }
    out: dict[str, Any] = {"rows": rows, "repeats": repeats, "action_overhead_ms": overhead.to_dict(), "families": {}}
    for name, (make, x) in families.items():
        torch.manual_seed(SEED)
        points = []
        for count in (1, 2, 4, 8):
            layers = [make() for _ in range(count)]
            measured = _split_extra_ms(layers, x, repeats)
            points.append((count, measured, measured - _priced_extra_ms(layers, x, overhead)))
        counts, missing = [p[0] for p in points], [p[2] for p in points]
        slope = statistics.linear_regression(counts, missing)
        out["families"][name] = {"points": points, "per_layer_ms": slope.slope, "intercept_ms": slope.intercept}
        print(f"{name}: per layer {slope.slope:.4f} ms, intercept {slope.intercept:.4f} ms; (layers, measured extra, unpriced) "
              + ", ".join(f"({c}, {m:.3f}, {u:.3f})" for c, m, u in points))
    torch.manual_seed(SEED)
    vgg = VGG19(num_classes=4, width_multiplier=0.0625, image_size=32, fc_hidden=64, dropout=0.0, optimizer="adam", lr=1e-3, weight_decay=0.0)
    layers, x = list(vgg.layers), torch.randn(rows, 3, 32, 32)
    stages = []
    for lo, hi in ((0, 2), (2, 7), (7, 12), (12, 19)):  # vgg_tiny's straight 4-stage cut (balanced compute)
        with torch.no_grad():
            inputs = nn.Sequential(*layers[:lo])(x) if lo else x
        measured = _split_extra_ms(layers[lo:hi], inputs, repeats)
        unpriced = measured - _priced_extra_ms(layers[lo:hi], inputs, overhead)
        stages.append({"layers": [lo, hi], "measured_extra_ms": measured, "unpriced_ms": unpriced, "per_layer_ms": unpriced / (hi - lo)})
        print(f"vgg_tiny layers {lo}:{hi}: split extra {measured:.3f} ms, unpriced {unpriced:.3f} ms ({unpriced / (hi - lo):.4f} ms per layer)")
    out["vgg_tiny_stages"] = stages
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=7, help="hidden layers; with the head, layers + 1 must divide by each S")
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--budget-fraction", type=float, default=0.7)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--out", default=str(HERE / "results" / "ooo.json"))
    parser.add_argument("--skip-simulated", action="store_true")
    parser.add_argument("--skip-measured", action="store_true")
    parser.add_argument("--deferred-layers", action="store_true", help="only the deferred-W cost per layer (module docstring)")
    parser.add_argument("--deferred-rows", type=int, default=4, help="rows per micro-batch there (vgg_tiny's recipe: 32 / 8)")
    parser.add_argument("--deferred-repeats", type=int, default=200)
    args = parser.parse_args(argv)
    if args.deferred_layers:
        result = deferred_layers(args.deferred_rows, args.deferred_repeats)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"config": vars(args), "deferred_layers": result}, indent=1))
        print(f"wrote {args.out}")
        return 0
    report: dict[str, Any] = {"config": vars(args), "results": {}}
    if not args.skip_simulated:
        report["simulated"] = simulated()
    for stages in ([] if args.skip_measured else args.stages):
        cfg = {
            "num_stages": stages, "micro_batches": args.micro_batches, "width": args.width, "layers": args.layers,
            "batch": args.batch, "steps": args.steps, "warmup": args.warmup, "budget_fraction": args.budget_fraction,
            "timeout": args.timeout,
        }
        assert (args.layers + 1) % stages == 0, "layers + 1 must be a multiple of every stage count"
        cfg["plans"] = plans(cfg)
        ranks = run_ranks(worker, stages, cfg, timeout_s=cfg["timeout"], raise_on_error=True)
        result = summarise(cfg, ranks)
        report["results"][str(stages)] = result
        med = result["median_step_ms"]
        print(f"S={stages} M={args.micro_batches}: step {med['plain']:.1f} ms plain, {med['ooo']:.1f} ms ooo "
              f"(x{result['speedup_median']:.3f}; paired ratio ooo/plain {result['paired_ratio_median']:.3f}); "
              f"CPU time of all ranks per step {result['median_cpu_ms_all_ranks']['plain']:.1f} vs {result['median_cpu_ms_all_ranks']['ooo']:.1f} ms")
        print(f"  budget {result['budget_bytes'] / 2**20:.2f} MiB per device (weights+grads+Adam {max(result['weights_bytes']) / 2**20:.2f} MiB "
              f"+ {args.budget_fraction:g} x the plain schedule's largest stash)")
        for name, values in result["peak_stash_bytes"].items():
            est = result["estimated_stash_bytes"][name]
            print(f"  {name:16s} recompute {result['recompute'][name]}: peak stash MiB {[round(v / 2**20, 2) for v in values]} "
                  f"(estimate {[round(v / 2**20, 2) for v in est]}), fits budget: {result['fits_budget'][name]}, "
                  f"max |param - plain| {result['param_gap_vs_plain'][name]:.2e}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
