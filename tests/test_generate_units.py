"""The pieces of `mode = "generate"` on their own: the streamed text across split multi-byte
characters and stop strings, sampling (seeded, top_k = 1 is greedy, repetition penalty), the
decoder layout read from real exports' signatures, and `[generate]` in config.toml."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from agent.inference import generate
from agent.inference.modes import Member, Run
from agent.inference.sampling import Sampler, SamplingParams, replayable
from agent.inference.text_stream import TextStream
from agent.models.backends.base import BackendOptions, ModelLoadError, TensorSpec
from agent.models.backends.onnxruntime import OnnxRuntimeBackend, OnnxSession
from agent.models.decoder_layout import Generation, open_generation, recognise
from agent.models.generate_config import GenerateConfig
from agent.models.loading import _check_generate_batching
from agent.models.model_config import ModelConfigError, StreamConfig, parse_model_config
from agent.models.tokenizer import open_tokenizer
from agent.protocol.errors import WireError
from tests.generate_helpers import DECODERS, REFERENCE, spy_on_bound_caches

TEXT = "日本語 café 🙂 naïve"


@pytest.fixture(scope="module")
def codec():  # type: ignore[no-untyped-def]
    found = open_tokenizer(DECODERS / "gpt2")
    assert found is not None
    return found


def test_text_across_split_characters_equals_the_decode(codec) -> None:  # type: ignore[no-untyped-def]
    ids = codec.encode(TEXT)
    assert len(ids) > len(TEXT.split())  # byte-level: characters cut between tokens
    stream = TextStream(codec)
    pieces = [stream.push([t]) for t in ids] + [stream.finish()]
    assert "".join(pieces) == codec.decode(ids) == TEXT
    assert all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize("per_chunk", [1, 3])
def test_random_tokens_stream_to_their_decode(codec, per_chunk: int) -> None:  # type: ignore[no-untyped-def]
    """Any ids (bytes that never make a character included), in chunks of any size."""
    for seed in range(20):
        ids = [int(t) for t in np.random.default_rng(seed).integers(0, codec.vocab_size, 40)]
        stream = TextStream(codec)
        chunks = [ids[i : i + per_chunk] for i in range(0, len(ids), per_chunk)]
        pieces = [stream.push(c) for c in chunks] + [stream.finish()]
        assert "".join(pieces) == stream.sent == codec.decode(ids)


def test_a_stop_string_split_between_chunks_is_not_sent(codec) -> None:  # type: ignore[no-untyped-def]
    ids = codec.encode("café au lait, café noir")
    stream = TextStream(codec, ["é n", "zzz"])
    pieces = [stream.push([t]) for t in ids]
    assert stream.stopped
    assert "".join(pieces) == stream.sent == "café au lait, caf"


def test_a_stop_string_is_held_back_and_not_sent(codec) -> None:  # type: ignore[no-untyped-def]
    ids = codec.encode("The little robot woke up")
    stream = TextStream(codec, ["robot w"])
    sent = ""
    for t in ids:
        sent += stream.push([t])
        if stream.stopped:
            break
    assert stream.stopped
    assert sent == "The little "
    assert stream.finish() == ""


def test_seeded_sampling_repeats_and_top_k_1_is_greedy() -> None:
    logits = np.random.default_rng(1).standard_normal((20, 50)).astype(np.float32)

    def draw(**params: object) -> list[int]:
        sampler = Sampler(SamplingParams.parse(params))
        return [sampler.choose(row, []) for row in logits]

    greedy = [int(np.argmax(row)) for row in logits]
    assert draw() == greedy
    assert draw(temperature=1.0, seed=7) == draw(temperature=1.0, seed=7)
    assert draw(temperature=1.0, seed=7) != draw(temperature=1.0, seed=8)
    assert draw(temperature=1.5, top_k=1, seed=3) == greedy
    assert draw(temperature=0.7, top_p=1e-9, seed=3) == greedy
    assert all(
        t in np.argsort(-row)[:5]
        for t, row in zip(draw(temperature=2.0, top_k=5, seed=1), logits, strict=True)
    )


def test_a_tiny_temperature_or_penalty_draws_without_nan() -> None:
    """Scores that overflow (5e-324 as the temperature, 1e-300 as the penalty) keep their
    order: the best token is drawn, as greedy picks it; a request asking so is not a
    model error (it failed every request run with it)."""
    logits = np.random.default_rng(2).standard_normal((10, 50)).astype(np.float32)
    greedy = [int(np.argmax(row)) for row in logits]
    tiny = Sampler(SamplingParams.parse({"temperature": 5e-324, "seed": 1}))
    assert [tiny.choose(row) for row in logits] == greedy
    both = {"temperature": 1e-300, "repetition_penalty": 1e-300, "seed": 1}
    penalised = Sampler(SamplingParams.parse(both))
    penalised.see([int(np.argmin(logits[0])), greedy[0]])
    assert 0 <= penalised.choose(logits[0]) < 50
    masked = np.full(50, -np.inf, dtype=np.float32)
    assert Sampler(SamplingParams.parse({"temperature": 1.0})).choose(masked) == 0


def test_a_sampling_request_without_a_seed_gets_one_from_its_id() -> None:
    sampled = {"temperature": 0.8}
    seeded = replayable(sampled, "r-1")
    assert seeded == {"temperature": 0.8, "seed": seeded["seed"]} == replayable(sampled, "r-1")
    assert 0 <= seeded["seed"] < 2**63 and seeded != replayable(sampled, "r-2")
    for params in ({}, {"temperature": 0}, {"temperature": True}, {"temperature": 1, "seed": 4}):
        assert replayable(params, "r-1") is params  # greedy, or a seed of its own


def test_repetition_penalty_lowers_seen_tokens() -> None:
    row = np.array([1.0, 0.9, -0.5], dtype=np.float32)
    sampler = Sampler(SamplingParams.parse({"repetition_penalty": 2.0}))
    assert sampler.choose(row, [0]) == 1


@pytest.mark.parametrize("params", [{"seed": -1}, {"top_k": 1.5}, {"temperature": True}])
def test_bad_sampling_params(params: dict[str, object]) -> None:
    with pytest.raises(WireError):
        SamplingParams.parse(params)


def _specs(args: list[ort.NodeArg]) -> list[TensorSpec]:
    dtypes = {"tensor(int64)": np.int64, "tensor(float)": np.float32}
    return [TensorSpec(a.name, np.dtype(dtypes[a.type]), tuple(a.shape)) for a in args]


@pytest.mark.parametrize(("arch", "heads"), [("gpt2", 4), ("llama", 2)])
def test_layouts_of_real_exports(arch: str, heads: int) -> None:
    session = ort.InferenceSession(str(DECODERS / arch / "model.onnx"))
    layout = recognise(
        _specs(session.get_inputs()), _specs(session.get_outputs()), GenerateConfig()
    )
    assert layout.attention_mask == "attention_mask"
    assert layout.position_ids == "position_ids"
    assert len(layout.cache) == 8 and layout.cache[0].past_axis == 2  # 4 layers, key and value
    assert layout.cache[0].empty(1).shape == (1, heads, 0, 32)


def test_a_model_that_is_no_decoder_is_refused() -> None:
    x = TensorSpec("x", np.dtype(np.float32), ("batch", 3))
    with pytest.raises(ModelLoadError, match="input_ids"):
        recognise([x], [x], GenerateConfig())


def test_generate_config_rules() -> None:
    config = parse_model_config('[stream]\nmode = "generate"\n[generate]\neos = [2, 3]\n', "c")
    assert config.generate is not None and config.generate.eos == [2, 3]
    with pytest.raises(ModelConfigError, match="generate"):
        parse_model_config("[generate]\ncontext = 5\n", "c")
    with pytest.raises(ModelConfigError, match="unknown key"):
        parse_model_config('[stream]\nmode = "generate"\n[generate]\nnope = 1\n', "c")


def test_the_bundled_writer_is_the_gpt2_fixture_in_generate_mode() -> None:
    """models/writer (the README's example) is the fixture the tests check, as a generate model."""
    bundled = DECODERS.parent.parent.parent.parent / "models" / "writer"
    for name in ("model.onnx", "tokenizer.json", "config.json", "generation_config.json"):
        assert (bundled / "1" / name).read_bytes() == (DECODERS / "gpt2" / name).read_bytes()
    config = parse_model_config((bundled / "config.toml").read_text(), "writer")
    assert config.stream.mode == "generate"


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_the_cache_stays_bound_on_a_device_session(
    arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU provider the cache is kept where ORT made it (IOBinding) and fed back as
    `OrtValue`s, never copied to the host. The same path, bound on the CPU here: greedy
    tokens equal Hugging Face's, and every step after the prefill feeds the cache as the
    runtime's own values."""
    session, folder = _session(arch), DECODERS / arch
    assert session.device == ("cpu", 0) and not session.keeps_on_device
    assert open_generation(None, session, folder).device_cache == ()  # the CPU: host arrays
    monkeypatch.setattr(OnnxSession, "keeps_on_device", property(lambda self: True))
    setup = open_generation(None, session, folder)
    assert len(setup.device_cache) == 8 and all(
        n.startswith("present.") for n in setup.device_cache
    )
    fed = spy_on_bound_caches(monkeypatch)
    ref = REFERENCE["models"][arch][0]
    (ask,) = _asks(setup, [ref], [24])
    run = Run(session, StreamConfig(mode="generate"), [Member({}, 1, generation=ask)])
    tokens = [
        int(t) for pieces in generate.generate(run) for p in pieces for t in p.outputs["tokens"]
    ]
    assert tokens == ref["greedy"]
    assert len(fed) == 24 and fed[0] == {np.ndarray}  # the prefill's empty cache
    assert all(kinds == {ort.OrtValue} for kinds in fed[1:])


@pytest.mark.parametrize(("arch", "bound"), [("gpt2", False), ("llama", False), ("gpt2", True)])
def test_members_of_one_run_step_in_lock_step(
    arch: str, bound: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three prompts of different lengths in one run: each prefill alone, then one run of the
    model a step for all (the shorter caches left-padded and masked), rows leaving as their
    limits come; every member's greedy tokens equal Hugging Face's. `bound`: the same with
    the cache kept as the runtime's values (a GPU provider's path, bound on the CPU)."""
    if bound:
        monkeypatch.setattr(OnnxSession, "keeps_on_device", property(lambda self: True))
    session = _session(arch)
    setup = open_generation(None, session, DECODERS / arch)
    assert setup.layout.batchable and bool(setup.device_cache) == bound
    cases, limits = REFERENCE["models"][arch], [24, 7, 15]
    asks = _asks(setup, cases, limits)
    assert len({len(a.prompt) for a in asks}) == 3  # three widths to line up
    run = Run(session, StreamConfig(mode="generate"), [Member({}, 1, generation=a) for a in asks])
    tokens: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for pieces in generate.generate(run):
        for piece in pieces:
            tokens[piece.member] += [int(t) for t in piece.outputs["tokens"]]
    for position, (case, n) in enumerate(zip(cases, limits, strict=True)):
        assert tokens[position] == case["greedy"][:n]
        assert asks[position].finish_reason == "length"
    assert run.runs == 3 + 23  # the prefills, then one run a step (alone: 24 + 7 + 15)


def test_a_layout_without_positions_is_not_batchable() -> None:
    session = ort.InferenceSession(str(DECODERS / "gpt2" / "model.onnx"))
    inputs = [s for s in _specs(session.get_inputs()) if s.name != "position_ids"]
    layout = recognise(inputs, _specs(session.get_outputs()), GenerateConfig())
    assert layout.position_ids is None and not layout.batchable


def test_a_member_cancelled_mid_lock_step_leaves_and_the_others_go_on() -> None:
    """`ROOT/cancel` of one row: its stream ends `cancelled` at the next step, its row leaves
    the batch; a stop of another (the agent stopping) takes it out without a piece; the third
    still gets all its greedy tokens."""
    session = _session("gpt2")
    setup = open_generation(None, session, DECODERS / "gpt2")
    cases = REFERENCE["models"]["gpt2"]
    asks = _asks(setup, cases, [24] * len(cases))
    members = [Member({}, 1, generation=a) for a in asks]
    run = Run(session, StreamConfig(mode="generate"), members)
    tokens: dict[int, list[int]] = {0: [], 1: [], 2: []}
    last: dict[int, bool] = {}
    for round_, pieces in enumerate(generate.generate(run)):
        for piece in pieces:
            tokens[piece.member] += [int(t) for t in piece.outputs["tokens"]]
            last[piece.member] = piece.last
        if round_ == 3:
            members[1].cancelled.set(by_request=True)
            members[2].cancelled.set()
    assert asks[1].finish_reason == "cancelled" and last[1]
    assert tokens[1] == cases[1]["greedy"][:4] and tokens[2] == cases[2]["greedy"][:4]
    assert 2 in run.failed and not last[2]  # stopped: answered by the runner, not a piece
    assert tokens[0] == cases[0]["greedy"] and asks[0].finish_reason == "length"


def test_a_beam_search_cancelled_ends_with_the_tokens_it_had_settled() -> None:
    """`ROOT/cancel` of a beam search: its last piece carries nothing new, its tokens are the
    ones its beams had settled (a prefix of the answer); the agent stopping takes another out
    without a piece."""
    session = _session("gpt2")
    setup = open_generation(None, session, DECODERS / "gpt2")
    cases = REFERENCE["models"]["gpt2"][:2]
    asks = [
        generate.ask_of(
            {"input_ids": np.array(case["ids"])}, {"max_new_tokens": 24, "num_beams": 3}, setup
        )
        for case in cases
    ]
    members = [Member({}, 1, generation=a) for a in asks]
    run = Run(session, StreamConfig(mode="generate"), members)
    tokens: dict[int, list[int]] = {0: [], 1: []}
    last: dict[int, bool] = {}
    for pieces in generate.generate(run):  # a yield where beams settled a token
        for piece in pieces:
            tokens[piece.member] += [int(t) for t in piece.outputs["tokens"]]
            last[piece.member] = piece.last
        if run.runs >= 12 and not members[0].cancelled.is_set():
            members[0].cancelled.set(by_request=True)
            members[1].cancelled.set()
    assert asks[0].finish_reason == "cancelled" and last[0]
    beam = cases[0]["beam"]["tokens"]
    assert 0 < len(tokens[0]) < len(beam) and tokens[0] == beam[: len(tokens[0])]
    assert tokens[0] == asks[0].tokens
    assert 1 in run.failed and not last.get(1, False)


def test_generate_batching_needs_onnxruntime_and_a_batchable_layout() -> None:
    """What a version with `[batching]` is refused for at load: a TensorRT engine (its
    decoder profiles take one row), a layout that cannot be left-padded (no positions, no
    cache)."""
    session = _session("gpt2")
    setup = open_generation(None, session, DECODERS / "gpt2")
    _check_generate_batching(setup, "onnxruntime")  # optimum's export: fine
    with pytest.raises(ModelLoadError, match="ONNX Runtime"):
        _check_generate_batching(setup, "tensorrt")
    no_positions = dataclasses.replace(setup.layout, position_ids=None)
    with pytest.raises(ModelLoadError, match="position_ids"):
        _check_generate_batching(dataclasses.replace(setup, layout=no_positions), "onnxruntime")
    no_cache = open_generation(None, _session("gpt2_nocache"), DECODERS / "gpt2_nocache")
    assert no_cache.layout.cache == () and not no_cache.layout.batchable
    with pytest.raises(ModelLoadError, match=r"a cache \(past_key_values"):
        _check_generate_batching(no_cache, "onnxruntime")


def _session(arch: str) -> OnnxSession:
    """A decoder fixture on ONNX Runtime's CPU provider, one thread."""
    return OnnxRuntimeBackend().load(DECODERS / arch / "model.onnx", BackendOptions(1))


def _asks(
    setup: Generation, cases: list[dict[str, Any]], limits: list[int]
) -> list[generate.GenerateAsk]:
    """A generation of each reference case's prompt, `limits` new tokens each."""
    return [
        generate.ask_of(
            {"prompt": np.array(case["prompt"], dtype=object)}, {"max_new_tokens": n}, setup
        )
        for case, n in zip(cases, limits, strict=True)
    ]
