"""Worker side of the chunked settle test: ranks holding several stages, sends waited as
soon as their receiver is known to have them (``schedule.settle.group_settle_points``), on
``chunked_worker``'s float64 model, with the transport's pending sends counted."""
from __future__ import annotations

from typing import Any, Sequence

import torch

import chunked_worker as cw
from dist_harness import GroupsPerLayout
from lightning_dapple.execute.clipping import clip_grad_norm_global
from lightning_dapple.execute.failure import FailureChannel
from lightning_dapple.execute.runner import StageRunner
from lightning_dapple.plan.plan import plan_from_dict


class PendingSends:
    """Counts, on one transport, the sends still pending after each issued message (its
    peak) and the sends waited by ``settle`` (before the end of the step)."""

    def __init__(self, transport: Any) -> None:
        self.peak = 0
        self.settled = 0
        issue, settle = transport._isend, transport.settle

        def counted_issue(*args: Any, **kwargs: Any) -> None:
            issue(*args, **kwargs)
            self.peak = max(self.peak, len(transport._pending_sends))

        def counted_settle(keys: Any) -> None:
            before = len(transport._pending_sends)
            settle(keys)
            self.settled += before - len(transport._pending_sends)

        transport._isend, transport.settle = counted_issue, counted_settle

    def reset(self) -> None:
        """A new step."""
        self.peak = self.settled = 0


def run_cases(rank: int, world: int, cases: Sequence[tuple[dict, dict]]) -> list[dict | None]:
    """Each (plan data, runner options): ``cw.STEPS`` steps of the built schedule; the largest
    difference from one process, and the pending-send counts of the last step."""
    failure = FailureChannel(rank, timeout_s=60)
    groups_of = GroupsPerLayout()
    ref_params, ref_losses, _ = cw.reference_run()
    out: list[dict | None] = []
    for plan_data, options in cases:
        plan = plan_from_dict(plan_data)
        groups = groups_of(plan)
        if rank >= plan.world_size:
            out.append(None)
            continue
        model = cw.make_model()
        local = [model[i] for stage in plan.stages_of_rank(rank) for i in range(plan.stages[stage].start, plan.stages[stage].end)]
        runner = StageRunner.for_plan(plan, rank, local, torch.device("cpu"), failure, groups=groups, ties=(), **options)
        opt = torch.optim.Adam(runner.parameters, lr=cw.LR)
        replicas = plan.stages[plan.stages_of_rank(rank)[0]].replicas
        losses = []
        counts = PendingSends(runner.transport)
        for step in range(cw.STEPS):
            counts.reset()  # the last step's are returned
            loss, _ = runner.train_step(cw.make_batch(step), cw.Callbacks())
            clip_grad_norm_global(runner.parameters, cw.CLIP, replicas, failure, group=groups.plan)
            opt.step()
            losses.append(float(loss))
        runner.finish()
        diff = 0.0
        for stage in plan.stages_of_rank(rank):
            for index in range(plan.stages[stage].start, plan.stages[stage].end):
                for key, value in model[index].state_dict().items():
                    diff = max(diff, float((value - ref_params[index][key]).abs().max()))
        out.append(
            {
                "param_diff": diff,
                "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
                "settled": counts.settled,
                "peak_pending": counts.peak,
            }
        )
    return out
