"""The streaming modes as strategies of one run (agent.inference.modes), on real ONNX Runtime
sessions of small hand-built graphs: a single request is a run of one member, a batch a run
of several, with one decode loop, one emit rule and one stop check for both."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from agent.inference import modes
from agent.inference.job import CancelFlag, Cancelled
from agent.models.backends.base import BackendOptions, InferenceError, Session
from agent.models.backends.registry import get_backend
from agent.models.model_config import StreamConfig
from agent.protocol.errors import WireError


def _session(tmp_path: Path, graph: onnx.GraphProto) -> Session:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    return get_backend("onnxruntime").load(path, BackendOptions(intra_op_threads=1))


def _counter(tmp_path: Path) -> Session:
    """`next = count + 1` (int64 [batch, 1]) and `total`, a scalar sum: no batch axis."""
    graph = helper.make_graph(
        [
            helper.make_node("Add", ["count", "one"], ["next"]),
            helper.make_node("ReduceSum", ["next"], ["total"], keepdims=0),
        ],
        "counter",
        [helper.make_tensor_value_info("count", TensorProto.INT64, ["batch", 1])],
        [
            helper.make_tensor_value_info("next", TensorProto.INT64, ["batch", 1]),
            helper.make_tensor_value_info("total", TensorProto.INT64, []),
        ],
        [helper.make_tensor("one", TensorProto.INT64, [], [1])],
    )
    return _session(tmp_path, graph)


def _adder(tmp_path: Path) -> Session:
    """`next = count + 1` alone: every output has the batch axis, so runs can be joined."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["count", "one"], ["next"])],
        "adder",
        [helper.make_tensor_value_info("count", TensorProto.INT64, ["batch", 1])],
        [helper.make_tensor_value_info("next", TensorProto.INT64, ["batch", 1])],
        [helper.make_tensor("one", TensorProto.INT64, [], [1])],
    )
    return _session(tmp_path, graph)


def _steps_config(**extra: object) -> StreamConfig:
    return StreamConfig(mode="steps", feed={"count": "next"}, max_steps=10, **extra)  # type: ignore[arg-type]


def _collect(run: modes.Run) -> list[list[modes.Piece]]:
    return list(run.pieces())


def test_a_single_request_runs_as_given_with_no_batch_axis_needed(tmp_path: Path) -> None:
    session = _counter(tmp_path)
    member = modes.Member({"count": np.array([[4], [5]], np.int64)})
    runs = _collect(modes.Run(session, StreamConfig(), [member]))
    assert len(runs) == 1 and len(runs[0]) == 1
    piece = runs[0][0]
    assert (piece.member, piece.index, piece.last) == (0, 0, True)
    assert piece.outputs["next"].tolist() == [[5], [6]]
    assert int(piece.outputs["total"]) == 11  # a scalar output: fine for a run of one


def test_a_joined_run_refuses_an_output_without_the_batch_axis(tmp_path: Path) -> None:
    session = _counter(tmp_path)
    members = [modes.Member({"count": np.array([[1]], np.int64)}) for _ in range(2)]
    with pytest.raises(InferenceError, match="'total' has shape"):
        _collect(modes.Run(session, StreamConfig(), members))


def test_steps_stop_on_the_condition_or_at_max_steps(tmp_path: Path) -> None:
    session = _counter(tmp_path)
    config = _steps_config(stop={"output": "next", "value": 3}, emit=["next"])
    run = modes.Run(session, config, [modes.Member({"count": np.array([[0]], np.int64)}, 10)])
    pieces = [p for run_pieces in _collect(run) for p in run_pieces]
    assert [p.outputs["next"].tolist() for p in pieces] == [[[1]], [[2]], [[3]]]
    assert [p.index for p in pieces] == [0, 1, 2]
    assert [p.last for p in pieces] == [False, False, True]
    assert run.runs == 3

    short = modes.Run(
        session, _steps_config(), [modes.Member({"count": np.zeros((1, 1), np.int64)}, 2)]
    )
    assert [p.last for r in _collect(short) for p in r] == [False, True]


def test_joined_members_leave_the_run_at_their_own_step(tmp_path: Path) -> None:
    session = _adder(tmp_path)
    config = _steps_config(stop={"output": "next", "value": 3}, emit=["next"])
    early = modes.Member({"count": np.array([[1]], np.int64)}, 10)  # reaches 3 at step 1
    late = modes.Member({"count": np.array([[-3], [-3]], np.int64)}, 4)  # max_steps first
    run = modes.Run(session, config, [early, late])
    runs = _collect(run)
    assert [[(p.member, p.last) for p in r] for r in runs] == [
        [(0, False), (1, False)],
        [(0, True), (1, False)],
        [(1, False)],
        [(1, True)],
    ]
    assert runs[3][0].outputs["next"].tolist() == [[1], [1]]  # only its own rows, fed on


def test_a_cancelled_member_leaves_before_the_next_run(tmp_path: Path) -> None:
    session = _adder(tmp_path)
    flag = CancelFlag()
    stays = modes.Member({"count": np.array([[0]], np.int64)}, 3)
    goes = modes.Member({"count": np.array([[0]], np.int64)}, 3, flag)
    run = modes.Run(session, _steps_config(emit=["next"]), [stays, goes])
    pieces = run.pieces()
    assert [p.member for p in next(pieces)] == [0, 1]
    flag.set()
    assert [p.member for p in next(pieces)] == [0]
    assert isinstance(run.failed[1], Cancelled)
    assert [p.last for p in next(pieces)] == [True]


def test_feeding_an_output_of_another_shape_is_a_model_error(tmp_path: Path) -> None:
    session = _counter(tmp_path)
    config = StreamConfig(mode="steps", feed={"count": "total"}, max_steps=3)
    run = modes.Run(session, config, [modes.Member({"count": np.zeros((1, 1), np.int64)}, 3)])
    with pytest.raises(InferenceError, match="cannot feed output 'total'"):
        _collect(run)


def test_batch_mode_slices_the_leading_axis(tmp_path: Path) -> None:
    session = _adder(tmp_path)
    config = StreamConfig(mode="batch", micro_batch=2)
    member = modes.Member({"count": np.arange(5, dtype=np.int64).reshape(5, 1)})
    pieces = [p for r in _collect(modes.Run(session, config, [member])) for p in r]
    assert [(p.index, p.last) for p in pieces] == [(0, False), (2, False), (4, True)]
    merged = modes.merge_pieces("batch", [(p.index, p.outputs) for p in pieces])
    assert merged["next"].ravel().tolist() == [1, 2, 3, 4, 5]
    empty = modes.Member({"count": np.zeros((0, 1), np.int64)})
    assert _collect(modes.Run(session, config, [empty])) == []  # the runner still ends it


def test_batch_mode_needs_one_leading_axis(tmp_path: Path) -> None:
    graph = helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["y"])],
        "add",
        [
            helper.make_tensor_value_info("a", TensorProto.FLOAT, ["n"]),
            helper.make_tensor_value_info("b", TensorProto.FLOAT, ["n"]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])],
    )
    session = _session(tmp_path, graph)
    member = modes.Member({"a": np.zeros(2, np.float32), "b": np.zeros(3, np.float32)})
    with pytest.raises(WireError, match="same leading axis"):
        _collect(modes.Run(session, StreamConfig(mode="batch"), [member]))


def test_every_mode_is_a_strategy_of_the_one_run() -> None:
    import agent.inference.generate  # noqa: F401  (registers itself, as the runner imports it)

    assert set(modes.STRATEGIES) == {"whole", "batch", "steps", "scan", "generate"}
