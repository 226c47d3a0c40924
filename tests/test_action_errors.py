"""An error inside a step names the schedule action it happened in (``execute/action_errors.py``).

The failing rank's message starts with the action's text form (``in action 1B3:``), which is
what the failure channel publishes to its peers; under ``DAPPLE_DEBUG=1`` the message carries
the stage's action list with the failing action marked.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import equivalence_worker as ew
from dist_harness import run_ranks
from lightning_dapple.execute.failure import FailureChannel
from lightning_dapple.execute.runner import StageRunner
from lightning_dapple.plan.plan import plan_from_dict


class FailsOnCall(nn.Module):
    """``inner``, except that its ``call``-th forward (counting from 0) fails: in the forward
    itself, or (``in_backward``) when the gradient of that forward's output arrives."""

    def __init__(self, inner: nn.Module, call: int, in_backward: bool) -> None:
        super().__init__()
        self.inner, self.call, self.in_backward, self.calls = inner, call, in_backward, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        this, self.calls = self.calls, self.calls + 1
        if this == self.call and not self.in_backward:
            raise RuntimeError("forward failed")
        out = self.inner(x)
        if this == self.call:
            out.register_hook(_fail_in_backward)
        return out


def _fail_in_backward(grad: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("backward failed")


def _plan(stages: list[list[int]], ooo: bool) -> Any:
    data = [{"layers": layers, "devices": [rank]} for rank, layers in enumerate(stages)]
    return plan_from_dict({"global_batch_size": 12, "micro_batches": 4, "stages": data, "schedule": "dapple", "ooo": ooo})


def _failing_step(rank: int, world: int, ooo: bool) -> dict[str, str]:
    """Two stages; stage 1's first layer fails in the backward of micro-batch 3."""
    torch.set_num_threads(1)
    plan = _plan([[0, 2], [2, 5]], ooo)
    model = ew.make_model("mlp")
    stage = plan.stages[rank]
    local = [model[i] for i in range(stage.start, stage.end)]
    if rank == 1:
        local[0] = FailsOnCall(local[0], call=3, in_backward=True)
    # the failing rank reports and stays: its blocked peer ends grace_s later (a short one here)
    failure = FailureChannel(rank, timeout_s=60, grace_s=3.0)
    runner = StageRunner.for_plan(plan, rank, local, torch.device("cpu"), failure, ties=())
    try:
        runner.train_step(ew.make_batch("mlp", 0), ew.Callbacks("mlp"))
    except Exception as exc:  # noqa: BLE001 -- the test reads what each rank raised
        failure.report(exc)
        return {"type": type(exc).__name__, "message": str(exc)}
    finally:
        failure.close()
    return {"type": "none", "message": ""}


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("ooo", "action"), [(False, "1B3"), (True, "1I3")])
def test_the_failing_rank_names_its_action(ooo: bool, action: str) -> None:
    """Stage 1 fails in the backward of micro-batch 3: a full backward B without out-of-order
    backprop, the input-only I with it. The failure channel publishes that message; its peer,
    blocked on the gradient, is ended with it (``execute/failure.py``)."""
    results = run_ranks(_failing_step, 2, ooo, timeout_s=200)
    failing = results[1]
    assert failing["type"] == "RuntimeError", failing
    assert failing["message"].startswith(f"in action {action}: "), failing
    assert "backward failed" in failing["message"]
    assert "the step's actions" not in failing["message"]  # the schedule only under DAPPLE_DEBUG=1


def test_under_dapple_debug_the_message_carries_the_stage_actions_with_the_failing_one_marked(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    failure = FailureChannel(0, timeout_s=30)
    plan = _plan([[0, 5]], ooo=False)
    batch, callbacks = ew.make_batch("mlp", 0), ew.Callbacks("mlp")
    messages = []
    for debug in ("0", "1"):
        monkeypatch.setenv("DAPPLE_DEBUG", debug)
        layers = list(ew.make_model("mlp"))
        layers[1] = FailsOnCall(layers[1], call=2, in_backward=False)
        runner = StageRunner.for_plan(plan, 0, layers, torch.device("cpu"), failure, ties=())
        with pytest.raises(RuntimeError) as raised:
            runner.train_step(batch, callbacks)
        messages.append(str(raised.value))
    failure.close()
    assert messages[0] == "in action 0F2: forward failed"
    first, listed = messages[1].split("\n")
    assert first == messages[0]
    marked = " ".join(f">>{action}<<" if action.text == "0F2" else action.text for action in runner.schedule.actions[0])
    assert ">>0F2<<" in marked and listed == f"the step's actions on stage 0: {marked}"
