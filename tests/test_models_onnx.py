"""The demo models and the ONNX Runtime backend, run for real on the CPU."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
import pytest

from agent.demo import models as demo_models
from agent.models.backends.base import BackendOptions, InferenceError, ModelLoadError, Session
from agent.models.backends.onnxruntime import OnnxRuntimeBackend, OnnxSession, select_providers
from agent.models.backends.registry import BACKENDS, backend_for_file, get_backend
from agent.models.repository import scan_repository, verify_checksum
from agent.models.warmup import synthetic_inputs, warm_up

REPO_ROOT = Path(__file__).resolve().parent.parent
CPU = BackendOptions()


def load(tmp_path: Path, model: onnx.ModelProto, options: BackendOptions = CPU) -> OnnxSession:
    path = demo_models.save(model, tmp_path / "model.onnx")
    return OnnxRuntimeBackend().load(path, options)


def decode(session: Session, steps: int, first: int = 5) -> list[int]:
    """Greedy decoding the way the agent's steps mode does it."""
    hidden = next(s for s in session.inputs if s.name == "h").shape[1]
    assert isinstance(hidden, int)
    token = np.array([[first]], dtype=np.int64)
    h = np.zeros((1, hidden), dtype=np.float32)
    tokens = []
    for _ in range(steps):
        out = session.run({"token": token, "h": h})
        token, h = out["next_token"], out["h_out"]
        tokens.append(int(token[0, 0]))
    return tokens


# --------------------------------------------------------------------------- builders


@pytest.mark.parametrize("build", [demo_models.mlp, demo_models.gru_decoder, demo_models.conv_net])
def test_builders_are_valid_small_and_deterministic(build: Any) -> None:
    model = build()
    onnx.checker.check_model(model, full_check=True)
    assert model.ir_version == demo_models.IR_VERSION <= 9
    assert [(o.domain, o.version) for o in model.opset_import] == [("", 17)]
    data = demo_models.to_bytes(model)
    assert len(data) < 100_000
    assert data == demo_models.to_bytes(build())
    assert data != demo_models.to_bytes(build(seed=1))


def test_mlp_shapes(tmp_path: Path) -> None:
    session = load(tmp_path, demo_models.mlp(inputs=16, hidden=64, outputs=8))
    assert [s.describe() for s in session.inputs] == ["x: float32[?,16]"]
    assert session.inputs[0].shape == ("batch", 16)
    out = session.run({"x": np.ones((5, 16), dtype=np.float32)})
    assert list(out) == ["y"]
    assert out["y"].shape == (5, 8) and out["y"].dtype == np.float32


def test_conv_net_shapes(tmp_path: Path) -> None:
    session = load(tmp_path, demo_models.conv_net(classes=10))
    assert session.inputs[0].shape == ("batch", 3, 32, 32)
    image = np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32)
    scores = session.run({"image": image})["scores"]
    assert scores.shape == (2, 10) and scores.dtype == np.float32
    assert not np.allclose(scores[0], scores[1])


def test_decoder_signature_and_argmax(tmp_path: Path) -> None:
    session = load(tmp_path, demo_models.gru_decoder(vocab=32, hidden=32))
    assert {s.name: (s.dtype.name, s.shape) for s in session.inputs} == {
        "token": ("int64", ("batch", 1)),
        "h": ("float32", ("batch", 32)),
    }
    assert [s.name for s in session.outputs] == ["next_token", "logits", "h_out"]
    token = np.array([[1], [2], [3]], dtype=np.int64)
    h = np.random.default_rng(0).standard_normal((3, 32)).astype(np.float32)
    out = session.run({"token": token, "h": h})
    assert out["next_token"].shape == (3, 1) and out["next_token"].dtype == np.int64
    assert out["logits"].shape == (3, 32)
    assert out["h_out"].shape == (3, 32)
    np.testing.assert_array_equal(out["next_token"][:, 0], out["logits"].argmax(axis=1))
    assert not np.allclose(out["h_out"], h)  # the state really moves


def test_decoder_default_never_emits_token_zero(tmp_path: Path) -> None:
    session = load(tmp_path, demo_models.gru_decoder())
    for first in range(1, 32):
        assert 0 not in decode(session, 32, first=first)
    assert len(set(decode(session, 32))) > 1  # not stuck on one token


def test_decoder_without_avoid_token_keeps_raw_logits(tmp_path: Path) -> None:
    avoided = load(tmp_path / "a", demo_models.gru_decoder(avoid_token=3))
    raw = load(tmp_path / "b", demo_models.gru_decoder(avoid_token=None))
    feed = {"token": np.array([[4]], dtype=np.int64), "h": np.zeros((1, 32), np.float32)}
    a, b = avoided.run(feed)["logits"], raw.run(feed)["logits"]
    assert a[0, 3] < -1000 and b[0, 3] > -1000
    np.testing.assert_allclose(np.delete(a, 3, axis=1), np.delete(b, 3, axis=1))
    with pytest.raises(ValueError, match="avoid_token"):
        demo_models.gru_decoder(avoid_token=32)


def test_save_is_atomic_and_leaves_no_temporary_files(tmp_path: Path) -> None:
    target = tmp_path / "deep" / "model.onnx"
    demo_models.save(demo_models.mlp(), target)
    demo_models.save(demo_models.mlp(seed=3), target)
    assert onnx.load(str(target)).graph.doc_string.endswith("seed 3")
    assert [p.name for p in target.parent.iterdir()] == ["model.onnx"]


# --------------------------------------------------------------------------- backend


def test_providers_come_from_the_session(tmp_path: Path) -> None:
    session = load(tmp_path, demo_models.mlp())
    assert tuple(session.providers) == ("CPUExecutionProvider",)
    assert isinstance(session, Session)


def test_missing_provider_falls_back_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    options = BackendOptions(providers=("NoSuchExecutionProvider", "CPUExecutionProvider"))
    with caplog.at_level(logging.WARNING, logger="agent.models.backends.onnxruntime"):
        session = load(tmp_path, demo_models.mlp(), options)
    assert tuple(session.providers) == ("CPUExecutionProvider",)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1
    assert "NoSuchExecutionProvider is not available" in lines[0] and "\n" not in lines[0]


def test_select_providers_keeps_order_and_puts_cpu_last() -> None:
    available = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    assert (
        select_providers(
            ["CPUExecutionProvider", "TensorrtExecutionProvider", "CUDAExecutionProvider"],
            available,
        )
        == available
    )
    assert select_providers(["CUDAExecutionProvider"], available) == [
        "CUDAExecutionProvider",
        "CPUExecutionProvider",
    ]
    assert select_providers([], available) == ["CPUExecutionProvider"]


def test_options_reach_the_session(tmp_path: Path) -> None:
    options = BackendOptions(
        intra_op_threads=2,
        extra={"provider_options": {"CPUExecutionProvider": {}}},
    )
    session = load(tmp_path, demo_models.mlp(), options)
    assert session.run({"x": np.zeros((1, 16), np.float32)})["y"].shape == (1, 8)
    with pytest.raises(ModelLoadError, match="provider_options"):
        load(tmp_path, demo_models.mlp(), BackendOptions(extra={"provider_options": "x"}))
    with pytest.raises(ModelLoadError, match="intra_op_threads"):
        load(tmp_path, demo_models.mlp(), BackendOptions(intra_op_threads=-1))


@pytest.mark.parametrize(
    "content",
    [
        pytest.param(b"this is not a model\n" * 10, id="garbage"),
        pytest.param(demo_models.to_bytes(demo_models.conv_net())[:3000], id="truncated"),
        pytest.param(b"", id="empty"),
    ],
)
def test_unloadable_file_is_a_one_line_model_load_error(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "model.onnx"
    path.write_bytes(content)
    with pytest.raises(ModelLoadError) as info:
        OnnxRuntimeBackend().load(path, CPU)
    assert "\n" not in str(info.value) and str(path) in str(info.value)


def test_invalid_graph_is_a_model_load_error(tmp_path: Path) -> None:
    model = demo_models.mlp()
    model.graph.node[0].input[1] = "no_such_tensor"
    path = tmp_path / "model.onnx"
    path.write_bytes(model.SerializeToString())
    with pytest.raises(ModelLoadError, match="no_such_tensor"):
        OnnxRuntimeBackend().load(path, CPU)


def test_missing_file_is_a_model_load_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError):
        OnnxRuntimeBackend().load(tmp_path / "absent.onnx", CPU)


def test_missing_onnxruntime_is_a_model_load_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # makes `import onnxruntime` fail
    with pytest.raises(ModelLoadError, match=r"pip install 'edge-stream-agent\[cpu\]'"):
        OnnxRuntimeBackend().load(tmp_path / "model.onnx", CPU)


@pytest.mark.parametrize(
    "feed",
    [
        pytest.param({"x": np.zeros((1, 15), np.float32)}, id="wrong-shape"),
        pytest.param({"x": np.zeros((1, 16), np.int64)}, id="wrong-dtype"),
        pytest.param({"z": np.zeros((1, 16), np.float32)}, id="wrong-name"),
        pytest.param({}, id="missing"),
    ],
)
def test_bad_input_is_a_one_line_inference_error(
    tmp_path: Path, feed: dict[str, npt.NDArray[Any]]
) -> None:
    session = load(tmp_path, demo_models.mlp())
    with pytest.raises(InferenceError) as info:
        session.run(feed)
    assert "\n" not in str(info.value) and str(info.value)


def test_out_of_range_token_is_an_inference_error(tmp_path: Path) -> None:
    session = load(tmp_path, demo_models.gru_decoder(vocab=32))
    feed = {"token": np.array([[99]], np.int64), "h": np.zeros((1, 32), np.float32)}
    with pytest.raises(InferenceError):
        session.run(feed)


def test_close_then_run_is_an_inference_error(tmp_path: Path) -> None:
    session = load(tmp_path, demo_models.mlp())
    session.close()
    session.close()  # idempotent
    assert session.closed
    with pytest.raises(InferenceError, match="session closed"):
        session.run({"x": np.zeros((1, 16), np.float32)})


def test_concurrent_runs_give_equal_results(tmp_path: Path) -> None:
    session = load(tmp_path, demo_models.conv_net())
    image = np.random.default_rng(1).standard_normal((3, 3, 32, 32)).astype(np.float32)
    expected = session.run({"image": image})["scores"]
    results: list[npt.NDArray[Any]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    start = threading.Barrier(4)

    def worker() -> None:
        try:
            start.wait(timeout=10)
            for _ in range(25):
                scores = session.run({"image": image})["scores"]
                with lock:
                    results.append(scores)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, name=f"run-{i}") for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert len(results) == 100
    for scores in results:
        np.testing.assert_array_equal(scores, expected)


# --------------------------------------------------------------------------- registry


def test_registry_and_suffixes(tmp_path: Path) -> None:
    assert set(BACKENDS) == {"onnxruntime", "tensorrt"}
    assert get_backend("onnxruntime").name == "onnxruntime"
    assert backend_for_file(Path("m/1/model.onnx")) == "onnxruntime"
    assert backend_for_file("model.plan") == backend_for_file("model.ENGINE") == "tensorrt"
    with pytest.raises(ModelLoadError, match="no backend"):
        backend_for_file("model.pt")
    with pytest.raises(ModelLoadError, match="unknown backend 'torch'"):
        get_backend("torch")


def test_tensorrt_without_its_module_is_a_model_load_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "agent.models.backends.tensorrt", None)
    with pytest.raises(ModelLoadError, match="backend 'tensorrt' is not available in this build"):
        get_backend("tensorrt")


def test_warm_up_runs_synthetic_inputs_with_a_batch_of_one(tmp_path: Path) -> None:
    session = load(tmp_path, demo_models.gru_decoder())
    feed = synthetic_inputs(session)
    assert {k: (v.shape, v.dtype.name) for k, v in feed.items()} == {
        "token": ((1, 1), "int64"),
        "h": ((1, 32), "float32"),
    }
    warm_up(session)
    session.close()
    with pytest.raises(InferenceError):
        warm_up(session)


# --------------------------------------------------------------------------- example repository


def test_example_repository_loads_and_runs() -> None:
    repo = scan_repository(REPO_ROOT / "models")
    assert set(repo) == {"classifier", "decoder", "mlp", "writer"}
    assert repo["decoder"].config is not None and repo["decoder"].config.stream.mode == "steps"
    assert repo["writer"].config is not None and repo["writer"].config.stream.mode == "generate"
    assert repo["mlp"].config is not None and repo["mlp"].config.stream.micro_batch == 4
    for name, model in repo.items():
        assert model.config_error is None
        version = model.versions[1]
        assert version.problem is None and version.model_file is not None
        assert verify_checksum(version) is None
        # small, the writer "a few MB" (the decoder fixture of the generate issue)
        assert version.model_file.stat().st_size < (4_000_000 if name == "writer" else 1_000_000)
        warm_up(get_backend(str(version.backend)).load(version.model_file, CPU))
    assert repo["mlp"].versions[1].sha256_expected is not None
