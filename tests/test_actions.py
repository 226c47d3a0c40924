"""The text form of schedule actions (``schedule.actions``): exact strings, round trips, errors.

The form follows ``torch.distributed.pipelining``'s printed schedules (stage, kind, micro-batch)
so that the lists the simulator and executor interpret -- DAPPLE early backward (sec. 3.2,
5.3), GPipe (gpipe.txt sec. 2), their out-of-order versions with B/W split (ooo-backprop
sec. 3) and the per-layer ending phase with gradient buckets (Algorithm 2, DAPPLE 5.2.3) --
can be written down and read back without loss.
"""
from __future__ import annotations

from dataclasses import replace

import pytest

from lightning_dapple.plan.plan import Plan, StagePlan
from lightning_dapple.profile.model_profile import LayerProfile, ModelProfile
from lightning_dapple.schedule import Action, Kind, Schedule, build_ooo_schedule, build_schedule
from lightning_dapple.schedule.actions import GRAMMAR, format_actions, parse_actions
from lightning_dapple.simulate.plan_and_schedule import schedule_for_plan

HAND_MADE = [
    (Action(Kind.F, 1, 0), "1F0"),
    (Action(Kind.B, 1, 0), "1B0"),
    (Action(Kind.I, 1, 3), "1I3"),
    (Action(Kind.W, 1, 0), "1W0"),
    (Action(Kind.W, 0, 3, (2, 4)), "0W3[2:4]"),
    (Action(Kind.SEND_ACT, 0, 0), "0SEND_F0"),
    (Action(Kind.RECV_ACT, 1, 0), "1RECV_F0"),
    (Action(Kind.SEND_GRAD, 1, 0), "1SEND_B0"),
    (Action(Kind.RECV_GRAD, 0, 0), "0RECV_B0"),
    (Action(Kind.ALLREDUCE, 0), "0ALLREDUCE"),
    (Action(Kind.ALLREDUCE, 0, layers=(0, 2)), "0ALLREDUCE[0:2]"),
    (Action(Kind.F, 12, 105), "12F105"),
]


@pytest.mark.parametrize(("action", "text"), HAND_MADE, ids=[text for _, text in HAND_MADE])
def test_hand_made_actions_have_exact_text_and_parse_back(action: Action, text: str) -> None:
    assert action.text == text
    assert Action.parse(text) == action


def test_label_keeps_its_stageless_form() -> None:
    assert Action(Kind.F, 2, 3).label == "F3"
    assert Action(Kind.W, 0, 7, (2, 3)).label == "W7[2:3]"
    assert Action(Kind.ALLREDUCE, 1, layers=(0, 1)).label == "allreduce[0:1]"
    assert Action(Kind.RECV_GRAD, 0, 4).label == "recv_grad4"


def uniform_profile(num_layers: int, param_bytes: float) -> ModelProfile:
    layers = tuple(
        LayerProfile(f"l{i}", 1.0, 2.0, 1e6, param_bytes, 1e6, backward_input_ms=1.0, backward_weight_ms=1.0)
        for i in range(num_layers)
    )
    return ModelProfile(micro_batch_size=4, layers=layers, name="uniform", input_bytes=1e6)


def replicated_plan(ooo: bool, schedule: str) -> Plan:
    """Stages 0 and 2 on two devices each (split micro-batches, gradient AllReduce)."""
    stages = (
        StagePlan((0, 3), (0, 1)),
        StagePlan((3, 5), (2,)),
        StagePlan((5, 8), (3, 4), recompute="always"),
        StagePlan((8, 10), (5,)),
    )
    return Plan(global_batch_size=48, micro_batches=6, stages=stages, schedule=schedule, ooo=ooo)


def built_schedules() -> list[Schedule]:
    """Every builder, with and without out-of-order backprop and layer ranges."""
    built: list[Schedule] = []
    for name in ("dapple", "gpipe"):
        for stages, micro_batches in ((1, 1), (2, 3), (4, 8), (5, 3)):
            built.append(build_schedule(name, stages, micro_batches))
            built.append(build_ooo_schedule(name, stages, micro_batches))
        built.append(build_ooo_schedule(name, 4, 8, caps=[0, -1, 2, 4], recompute=("always", "never", "except_last", "never")))
        built.append(
            build_ooo_schedule(
                name, 2, 3, layer_counts=[3, 2], replicated=[True, False], first_k=2, param_bytes=[[10, 10, 10], [1, 1]], bucket_bytes=10
            )
        )
        profile = uniform_profile(10, param_bytes=30 * 2**20)
        for ooo in (False, True):
            built.append(schedule_for_plan(replicated_plan(ooo, name), profile))
    return built


def test_every_action_of_built_schedules_round_trips() -> None:
    kinds: set[Kind] = set()
    with_layers: set[Kind] = set()
    for schedule in built_schedules():
        for actions in schedule.actions:
            for action in actions:
                assert Action.parse(action.text) == action, action.text
                kinds.add(action.kind)
                if action.layers is not None:
                    with_layers.add(action.kind)
        text = format_actions(schedule.actions)
        assert parse_actions(text) == schedule.actions
        assert replace(schedule, actions=parse_actions(text)) == schedule
        assert len(text.splitlines()) == schedule.num_stages
        assert format_actions(parse_actions(text)) == text
    # the schedules above hold every kind, and W and ALLREDUCE with layer ranges
    assert kinds == set(Kind)
    assert with_layers == {Kind.W, Kind.ALLREDUCE}


def test_format_actions_writes_one_line_per_stage() -> None:
    schedule = build_schedule("dapple", 2, 3)  # K = (2, 1)
    assert format_actions(schedule.actions) == (
        "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0F2 0SEND_F2 0RECV_B1 0B1 0RECV_B2 0B2 0ALLREDUCE\n"
        "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1 1RECV_F2 1F2 1B2 1SEND_B2 1ALLREDUCE"
    )
    assert format_actions(schedule.actions, compute_only=True) == "0F0 0F1 0B0 0F2 0B1 0B2\n1F0 1B0 1F1 1B1 1F2 1B2"


def test_format_actions_of_the_ooo_ending_phase() -> None:
    """Algorithm 2 with k = 2 on stage 0 (three layers, one bucket per layer)."""
    built = build_ooo_schedule(
        "dapple", 2, 3, layer_counts=[3, 2], replicated=[True, False], first_k=2, param_bytes=[[10, 10, 10], [1, 1]], bucket_bytes=10
    )
    first = format_actions(built.actions).splitlines()[0]
    assert first.endswith("0RECV_B2 0I2 0W2[2:3] 0ALLREDUCE[2:3] 0W2[0:1] 0W2[1:2] 0ALLREDUCE[1:2] 0ALLREDUCE[0:1]")


def test_parse_actions_skips_blank_lines() -> None:
    assert parse_actions("\n0F0  0B0\n\n1F0 1B0\n") == (
        (Action(Kind.F, 0, 0), Action(Kind.B, 0, 0)),
        (Action(Kind.F, 1, 0), Action(Kind.B, 1, 0)),
    )


BAD = [
    "", "F0", "1", "1X0", "1f0", "1F0 ", " 1F0", "01F0", "1F00", "1F-1", "-1F0", "1F0[2]", "1F0[2:]", "1F0[a:b]",
    "1F0[02:3]", "1F0@s1", "1recv_act0", "1RECV_ACT0", "0ALLREDUCE[0:2", "1F\u0663",
]


@pytest.mark.parametrize("text", BAD)
def test_bad_text_raises_value_error_naming_it_and_the_grammar(text: str) -> None:
    with pytest.raises(ValueError) as info:
        Action.parse(text)
    message = str(info.value)
    assert repr(text) in message
    assert GRAMMAR in message
    assert "<stage><KIND>[<microbatch>][[<lo>:<hi>]]" in message


def test_parse_actions_names_the_bad_token() -> None:
    with pytest.raises(ValueError, match=r"'1Q0'"):
        parse_actions("0F0 0B0\n1F0 1Q0")
