"""PipeDream graph text (shared/profiles/) -> ModelProfile: parsing, linearisation, cut bytes, errors."""
from __future__ import annotations

from pathlib import Path

import pytest
from conftest import shared_profiles

from lightning_dapple.errors import DappleConfigError
from lightning_dapple.profile import load_profile
from lightning_dapple.profile.graph_text import parse_graph_text

PROFILES = shared_profiles()
SHARED = sorted(PROFILES.glob("*/*.txt"))
assert SHARED, f"the shared profiles are required beside the checkout: {PROFILES}"


def _node(node_id: str, desc: str, fwd: float, bwd: float, act: str, params: float) -> str:
    return (
        f"{node_id} -- {desc} -- forward_compute_time={fwd}, backward_compute_time={bwd}, "
        f"activation_size={act}, parameter_size={params}"
    )


# A diamond with a skip from the input to the sink. node4 is listed before node3 so the
# tie-break (file order) puts it first: the order is node1, node2, node4, node3, node5.
BRANCHING = "\n".join(
    [
        _node("node1", "Input", 0, 0, "100", 0),
        _node("node2", "Stem -- with separator inside", 1.0, 2.0, "10", 4),
        _node("node4", "Right", 3.0, 4.0, "30", 16),
        _node("node3", "Left", 5.0, 6.0, "[20; 5]", 8),
        _node("node5", "Add", 0.5, 0.5, "40.0", 0) + "  ",
        "\tnode1 -- node2",
        " \tnode2 -- node3",  # amoeba-36-pbs-1 style indentation (space, then tab)
        "  node2 -- node4",
        "\tnode3 -- node5",
        "\tnode4 -- node5",
        "\tnode1 -- node5",
        "\tnode1 -- node5",  # a repeated edge changes nothing
    ]
)


def test_branching_graph_cut_bytes_match_hand_computation() -> None:
    profile = parse_graph_text(BRANCHING, name="diamond", profile_batch_size=4)
    assert profile.meta["nodes"] == ["node1", "node2", "node4", "node3", "node5"]
    assert [layer.name for layer in profile.layers] == ["Input", "Stem -- with separator inside", "Right", "Left", "Add"]
    # Crossing bytes after each position, by hand:
    #   after node1: node1 (consumed by node2, node5)                        = 100
    #   after node2: node1 + node2 (consumed by node4, node3)                = 110
    #   after node4: node1 + node2 (node3 still to come) + node4 (-> node5)  = 140
    #   after node3: node1 + node4 + node3 ([20; 5] summed)                  = 155
    #   after node5: nothing crosses; the model output (node5's own) is reported = 40
    assert [layer.output_bytes for layer in profile.layers] == [100, 110, 140, 155, 40]
    assert [layer.stash_bytes for layer in profile.layers] == [100, 10, 30, 25, 40]
    assert [layer.forward_ms for layer in profile.layers] == [0, 1.0, 3.0, 5.0, 0.5]
    assert [layer.backward_ms for layer in profile.layers] == [0, 2.0, 4.0, 6.0, 0.5]
    assert [layer.param_bytes for layer in profile.layers] == [0, 4, 16, 8, 0]
    assert profile.input_bytes == 100
    assert profile.micro_batch_size == 4
    assert "estimated" in profile.meta["stash_bytes"]


def test_chain_output_bytes_is_own_activation() -> None:
    text = "\n".join(
        [_node("node1", "a", 1, 1, "7", 0), _node("node2", "b", 1, 1, "9", 0), _node("node3", "c", 1, 1, "11", 0),
         "\tnode1 -- node2", "\tnode2 -- node3"]
    )
    profile = parse_graph_text(text, name="chain-pbs-3")
    assert profile.micro_batch_size == 3
    assert [layer.output_bytes for layer in profile.layers] == [7, 9, 11]


def test_duplicate_descriptions_get_node_id_prefix_and_long_ones_are_trimmed() -> None:
    long = "Conv2d(" + "x" * 200 + ")"
    text = "\n".join(
        [_node("node1", "ReLU()", 1, 1, "1", 0), _node("node2", "ReLU()", 1, 1, "1", 0), _node("node3", long, 1, 1, "1", 0),
         "\tnode1 -- node2", "\tnode2 -- node3"]
    )
    names = [layer.name for layer in parse_graph_text(text, profile_batch_size=1).layers]
    assert names[:2] == ["node1: ReLU()", "node2: ReLU()"]
    assert len(names[2]) <= 60 and names[2].startswith("Conv2d(")


def test_bert48_matches_file() -> None:
    profile = load_profile(PROFILES / "dapple" / "bert-48-pbs-2.txt")
    assert profile.num_layers == 53
    assert profile.micro_batch_size == 2
    layer0 = next(layer for layer in profile.layers if layer.name == "layer_0")
    assert layer0.forward_ms == pytest.approx(2.69)
    assert layer0.backward_ms == pytest.approx(4.47)
    assert layer0.param_bytes == 50384896


def test_amoeba36_space_tab_quirk_parses_with_skip_connections() -> None:
    path = PROFILES / "dapple" / "amoeba-36-pbs-1.txt"
    assert any(line.startswith(" \t") for line in path.read_text().splitlines())  # the quirk is really there
    profile = load_profile(path)
    assert profile.num_layers == 44
    assert profile.meta["nodes"] == [f"node{i}" for i in range(1, 45)]
    by_name = {layer.name: layer for layer in profile.layers}
    # Every cell feeds the next two, so a cut after cell_0 (node5) carries cell_stem_1's and cell_0's
    # outputs, plus the Input (node1 -> node26 carries the labels to the loss).
    expected = (2408448 * 2) + (6422528 * 2) + (602112 + 4004)
    assert by_name["cell_0"].output_bytes == expected


def test_data_input_sources_carry_no_compute() -> None:
    # PipeDream's profiler puts the host-to-device copy on the Input source; both planners
    # that published these files zero it. An 'Input...' node with a predecessor is an operator.
    text = "\n".join(
        [_node("node1", "Input", 17.0, 0.0, "4", 8), _node("node2", "Layer", 3.0, 5.0, "6", 2),
         _node("node3", "InputProjection", 2.0, 1.0, "6", 2), "\tnode1 -- node2", "\tnode2 -- node3"]
    )
    profile = parse_graph_text(text, profile_batch_size=1)
    assert [layer.forward_ms for layer in profile.layers] == [0.0, 3.0, 2.0]
    assert [layer.param_bytes for layer in profile.layers] == [0.0, 2, 2]
    assert profile.layers[0].output_bytes == 4 and profile.input_bytes == 4
    assert profile.meta["data_input_ms"] == {"Input": [17.0, 0.0]}
    xlnet = load_profile(PROFILES / "dapple" / "xlnet-36-pbs-1.txt")
    assert xlnet.layers[0].name == "Input" and xlnet.layers[0].forward_ms == 0.0
    assert xlnet.meta["data_input_ms"] == {"Input": [17.0, 0.0]}


@pytest.mark.parametrize("path", SHARED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_shared_profile_loads(path: Path) -> None:
    batch = None if "pbs-" in path.name else 64
    profile = load_profile(path, profile_batch_size=batch)
    nodes = sum(1 for line in path.read_text().splitlines() if line.strip() and "=" in line)
    assert profile.num_layers == nodes
    assert profile.micro_batch_size == (batch or int(path.name.split("pbs-")[1].split("-")[0].split(".")[0]))
    assert all(layer.output_bytes >= 0 for layer in profile.layers)
    assert sum(layer.forward_ms for layer in profile.layers) > 0


def test_missing_batch_size_asks_for_flag() -> None:
    with pytest.raises(DappleConfigError, match="--profile-batch-size"):
        load_profile(PROFILES / "pipedream" / "vgg16.graph.txt")


@pytest.mark.parametrize(
    ("text", "line", "words"),
    [
        (_node("node1", "a", 1, 1, "1", 0) + "\nnode2 garbage", 2, "' -- '"),
        (_node("node1", "a", 1, 1, "1", 0) + "\n" + _node("node2", "b", -1, 1, "1", 0), 2, "negative"),
        (_node("node1", "a", 1, 1, "[1; x]", 0), 1, "not a number"),
        ("node1 -- a -- forward_compute_time=1, backward_compute_time=1, activation_size=1", 1, "parameter_size"),
        (_node("node1", "a", 1, 1, "1", 0) + "\n\tnode1 -- node9", 2, "unknown node node9"),
        (_node("node1", "a", 1, 1, "1", 0) + "\n" + _node("node1", "b", 1, 1, "1", 0), 2, "defined again"),
        (
            "\n".join([_node(f"node{i}", "x", 1, 1, "1", 0) for i in (1, 2, 3)] + ["\tnode1 -- node2", "\tnode2 -- node3", "\tnode3 -- node2"]),
            5,
            "cycle",
        ),
        (_node("node1", "a", 1, 1, "1", 0) + "\n\tnode1 -- node1", 2, "cycle"),
    ],
)
def test_errors_name_the_line(text: str, line: int, words: str) -> None:
    with pytest.raises(DappleConfigError) as info:
        parse_graph_text(text, name="bad.txt", profile_batch_size=1)
    assert info.value.field == f"bad.txt line {line}"
    assert words in str(info.value)
    assert info.value.fix


def test_empty_text_is_an_error() -> None:
    with pytest.raises(DappleConfigError, match="no node lines"):
        parse_graph_text("\n\n", profile_batch_size=1)
