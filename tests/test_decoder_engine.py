"""TensorRT engines of decoders: the default optimization profile covers past length 0 up to
the context, so the generate loop runs on the engine from the prefill to the context's end.

Runs against the tensorrt/pycuda test doubles (tests/fakes), which check every run's shapes
against the engine's profile as TensorRT does; not on a GPU.
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agent.inference import generate, generate_inputs
from agent.inference.modes import Member, Run
from agent.models.backends import cuda
from agent.models.backends.base import BackendOptions, InferenceError
from agent.models.backends.tensorrt import TensorRTBackend
from agent.models.decoder_layout import open_generation
from agent.models.engine_builder import BuildOptions, EngineBuildError, ShapeRange, build_engine
from agent.models.engine_builds import build_options
from agent.models.model_config import StreamConfig
from tests import fakes
from tests.fakes import FakeGPU
from tests.generate_helpers import DECODERS, REFERENCE

fake_gpu = fakes.fake_gpu  # the fixture: fresh fakes in sys.modules per test

CONTEXT = 128  # both fixtures' config.json (n_positions, max_position_embeddings)


def decoder_version(tmp_path: Path, arch: str, *, config: bool = True) -> Path:
    """models/writer/1/ holding the fixture's model.onnx (and its config.json)."""
    folder = tmp_path / "models" / "writer" / "1"
    folder.mkdir(parents=True)
    shutil.copy(DECODERS / arch / "model.onnx", folder / "model.onnx")
    if config:
        shutil.copy(DECODERS / arch / "config.json", folder / "config.json")
    return folder / "model.onnx"


def build(tmp_path: Path, onnx: Path, **options: Any) -> Path:
    return build_engine(
        onnx, onnx.parent.parent, BuildOptions(cache_dir=tmp_path / "cache", **options)
    )


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_decoders_profiles_cover_past_0_to_the_context(
    fake_gpu: FakeGPU, tmp_path: Path, arch: str
) -> None:
    plan = build(tmp_path, decoder_version(tmp_path, arch))
    session = TensorRTBackend().load(plan, BackendOptions())
    try:
        prefill, steps = session.profiles
        half = CONTEXT // 2
        assert prefill["input_ids"] == ((1, 1), (1, half), (1, CONTEXT))
        assert steps["input_ids"] == ((1, 1), (1, 1), (1, 1))
        for profile in (prefill, steps):
            assert profile["attention_mask"][0::2] == ((1, 1), (1, CONTEXT))
        pasts = [name for name in steps if name.startswith("past_key_values.")]
        assert pasts
        for name in pasts:
            for profile, want in [(prefill, (0, 0, 0)), (steps, (0, half, CONTEXT - 1))]:
                low, opt, high = profile[name]
                assert (low[2], opt[2], high[2]) == want
                assert low[:2] == high[:2] and low[3:] == high[3:]  # heads, head dim fixed
    finally:
        session.close()


def test_a_decoder_without_a_cache_gets_the_prefills_profile_and_runs(
    fake_gpu: FakeGPU, tmp_path: Path
) -> None:
    """Every step of a cache-less decoder is the whole sequence so far: one profile of 1 to
    the context (64: its config.json) tokens covers the loop, to Hugging Face's tokens."""
    onnx = decoder_version(tmp_path, "gpt2_nocache")
    session = TensorRTBackend().load(build(tmp_path, onnx), BackendOptions())
    try:
        (profile,) = session.profiles
        assert profile["input_ids"] == ((1, 1), (1, 32), (1, 64))
        assert profile["attention_mask"] == ((1, 1), (1, 32), (1, 64))
        setup = open_generation(None, session, onnx.parent)
        case = REFERENCE["models"]["gpt2_nocache"][1]
        ask = generate.ask_of({"input_ids": np.array(case["ids"])}, {}, setup)
        run = Run(session, StreamConfig(mode="generate"), [Member({}, 1, generation=ask)])
        for _ in generate.generate(run):
            pass
        assert ask.tokens[: len(case["greedy"])] == case["greedy"]
        assert ask.finish_reason == "length" and len(case["ids"]) + len(ask.tokens) == 64
    finally:
        session.close()


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_the_generate_loop_runs_on_the_engine_to_the_end_of_the_context(
    fake_gpu: FakeGPU, tmp_path: Path, arch: str
) -> None:
    onnx = decoder_version(tmp_path, arch)
    plan = build(tmp_path, onnx)
    session = TensorRTBackend().load(plan, BackendOptions())
    try:
        setup = open_generation(None, session, onnx.parent)
        case = REFERENCE["models"][arch][0]
        room = CONTEXT - len(case["ids"])
        ask = generate.ask_of({"input_ids": np.array(case["ids"])}, {}, setup)
        assert ask.max_new_tokens == room
        run = Run(session, StreamConfig(mode="generate"), [Member({}, 1, generation=ask)])
        for _ in generate.generate(run):
            pass
        assert ask.tokens[: len(case["greedy"])] == case["greedy"]  # the HF reference
        assert ask.finish_reason == "length" or ask.tokens[-1] == REFERENCE["eos"]
        if ask.finish_reason == "length":
            assert len(ask.tokens) == room  # past CONTEXT - 1 in the last run: in the profile
        too_long: dict[str, Any] = {  # a past of the whole context: outside the profile
            slot.input: np.zeros(
                [
                    CONTEXT if axis == slot.past_axis else d or 1
                    for axis, d in enumerate(slot.shape)
                ],
                slot.dtype,
            )
            for slot in setup.layout.cache
        }
        too_long["input_ids"] = np.zeros((1, 1), np.int64)
        too_long["attention_mask"] = np.ones((1, CONTEXT + 1), np.int64)
        if setup.layout.position_ids is not None:
            too_long["position_ids"] = np.full((1, 1), CONTEXT, np.int64)
        with pytest.raises(InferenceError):
            session.run(too_long)
    finally:
        session.close()


def test_the_context_comes_from_the_options_where_config_json_is_missing(
    fake_gpu: FakeGPU, tmp_path: Path
) -> None:
    onnx = decoder_version(tmp_path, "gpt2", config=False)
    with pytest.raises(EngineBuildError, match="--context"):
        build(tmp_path, onnx)
    plan = build(tmp_path, onnx, context=32)
    session = TensorRTBackend().load(plan, BackendOptions())
    try:
        prefill, steps = session.profiles
        assert prefill["input_ids"][2] == (1, 32)
        assert steps["past_key_values.0.key"][2][2] == 31
    finally:
        session.close()
    assert BuildOptions(context=32).key_fields()["context"] == 32
    assert "context" not in BuildOptions().key_fields()  # other builds keep their keys


def test_explicit_profiles_still_win_over_the_decoders_default(
    fake_gpu: FakeGPU, tmp_path: Path
) -> None:
    onnx = decoder_version(tmp_path, "gpt2")
    cache = {"past_key_values.0.key": ShapeRange((1, 4, 0, 16), (1, 4, 8, 16), (1, 4, 15, 16))}
    with pytest.raises(EngineBuildError, match="no shapes for dynamic input"):
        build(tmp_path, onnx, profiles=(cache,))


def test_the_agents_build_options_take_a_context() -> None:
    extra = {"tensorrt": {"build": {"context": 64}}}
    assert build_options(BackendOptions(extra=extra)).context == 64
    with pytest.raises(Exception, match="context"):
        build_options(BackendOptions(extra={"tensorrt": {"build": {"context": 0}}}))
    # a model's [generate] context where tensorrt.build.context is not set; the latter wins
    assert build_options(BackendOptions(), context=96).context == 96
    assert build_options(BackendOptions(extra=extra), context=96).context == 64


def _greedy(session: Any, setup: Any, ids: list[int], tokens: int) -> list[int]:
    ask = generate.ask_of({"input_ids": np.array(ids)}, {"max_new_tokens": tokens}, setup)
    run = Run(session, StreamConfig(mode="generate"), [Member({}, 1, generation=ask)])
    for _ in generate.generate(run):
        pass
    return list(ask.tokens)


def _copied_bytes(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Bytes the fake driver copies host to device and back, counted from now on."""
    import pycuda.driver as driver  # the fake (the fixture put it in sys.modules)

    counts = {"htod": 0, "dtoh": 0}
    for kind, name in (("htod", "memcpy_htod_async"), ("dtoh", "memcpy_dtoh_async")):
        real = getattr(driver, name)

        def counted(dest: Any, src: Any, stream: Any = None, _real: Any = real, _k: str = kind):
            host = src if _k == "htod" else dest
            counts[_k] += int(np.asarray(host).nbytes)
            _real(dest, src, stream)

        monkeypatch.setattr(driver, name, counted)
    return counts


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_the_cache_stays_on_the_device_from_token_to_token(
    fake_gpu: FakeGPU, tmp_path: Path, arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent's TensorRT session keeps `present.*` on the device and reads them back as the
    next step's past: the same greedy tokens as with the cache on the host, a fraction of
    the bytes copied between host and device, and its memory reused, then freed at close."""
    onnx = decoder_version(tmp_path, arch)
    session = TensorRTBackend().load(build(tmp_path, onnx), BackendOptions())
    try:
        setup = open_generation(None, session, onnx.parent)
        assert setup.device_cache == tuple(slot.output for slot in setup.layout.cache)
        case = REFERENCE["models"][arch][0]
        copied = _copied_bytes(monkeypatch)
        on_device = _greedy(session, setup, case["ids"], 40)
        device_traffic = copied["htod"] + copied["dtoh"]
        copied.update(htod=0, dtoh=0)
        on_host = _greedy(session, replace(setup, device_cache=()), case["ids"], 40)
        host_traffic = copied["htod"] + copied["dtoh"]
        assert on_device == on_host and on_device[: len(case["greedy"])] == case["greedy"]
        assert device_traffic * 4 < host_traffic, (device_traffic, host_traffic)
        held = session.device_bytes
        assert _greedy(session, setup, case["ids"], 40) == on_device
        assert session.device_bytes == held  # the second request reused the first's memory
    finally:
        session.close()
    leaked = [r for r in fake_gpu.live("device") if r.label == "mem_alloc"]
    assert not leaked, leaked


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_context_stages_no_cache_and_logits_only_as_long_as_its_prompts(
    fake_gpu: FakeGPU, tmp_path: Path, arch: str
) -> None:
    """With the cache kept on the device, the context stages the step's own tensors (ids,
    mask, positions, logits), the prefill's empty `past_key_values.*` (a smallest buffer
    each) and no `present.*`; the logits' buffer is sized by the longest prompt run, not by
    a whole context's."""
    onnx = decoder_version(tmp_path, arch)
    session = TensorRTBackend().load(build(tmp_path, onnx), BackendOptions())
    try:
        setup = open_generation(None, session, onnx.parent)
        case = REFERENCE["models"][arch][0]
        assert _greedy(session, setup, case["ids"], 40)[: len(case["greedy"])] == case["greedy"]
        staged = sorted(r.nbytes for r in fake_gpu.live("pinned"))
        presents = len(setup.layout.cache)
        assert len(staged) == len(session.inputs) + len(session.outputs) - presents
        assert staged[:presents] == [cuda.ALIGNMENT] * presents
        (logits,) = (s for s in session.outputs if s.name == "logits")
        vocab = logits.shape[-1]
        assert isinstance(vocab, int)
        assert staged[-1] == cuda.size_class(len(case["ids"]) * vocab * 4) < CONTEXT * vocab * 4
    finally:
        session.close()
    assert fake_gpu.pinned_bytes == 0


def test_a_kept_array_goes_only_to_the_session_that_made_it(
    fake_gpu: FakeGPU, tmp_path: Path
) -> None:
    onnx = decoder_version(tmp_path, "gpt2")
    plan = build(tmp_path, onnx)
    first = TensorRTBackend().load(plan, BackendOptions())
    second = TensorRTBackend().load(plan, BackendOptions())
    try:
        setup = open_generation(None, first, onnx.parent)
        inputs = generate_inputs.prefill_inputs(
            generate.ask_of({"input_ids": np.array([1, 2, 3])}, {}, setup)
        )
        outputs = first.run_keeping(inputs, setup.device_cache)
        slot = setup.layout.cache[0]
        kept = outputs[slot.output]
        assert not isinstance(kept, np.ndarray) and kept.shape[slot.past_axis] == 3
        host = first.run(inputs)[slot.output]
        np.testing.assert_array_equal(kept.numpy(), host)  # what lock-step batching reads
        step = {name: value for name, value in inputs.items()}
        step[slot.input] = kept
        with pytest.raises(InferenceError, match="kept by another session"):
            second.run(step)
    finally:
        first.close()
        second.close()
