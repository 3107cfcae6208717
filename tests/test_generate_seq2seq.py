"""`mode = "generate"` with encoder-decoders exported by optimum (`text2text-generation-with-
past`: a T5 with relative positions and a BART whose config forces its first new token), as a
user copies optimum's folder (`encoder_model.onnx`, the merged decoder as `model.onnx`, the
configs and the tokenizer): greedy tokens equal to Hugging Face's `generate(do_sample=False)`,
text equal to the tokenizer's decode, finish reasons and usage, token ids in, concurrent
requests, and the versions that cannot serve refused at load. The fixtures and references come
from `scripts/make_seq2seq.py`."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from agent.client import AgentClient, AgentError
from agent.demo.broker import EmbeddedBroker
from agent.inference import generate as generate_mode
from agent.inference.modes import Member, Run
from agent.models.backends.base import BackendOptions, ModelLoadError, TensorSpec
from agent.models.backends.onnxruntime import OnnxRuntimeBackend, OnnxSession
from agent.models.decoder_layout import ENCODER_FILE, open_generation, recognise
from agent.models.generate_config import GenerateConfig
from agent.models.model_config import StreamConfig
from agent.service.agent import Agent
from tests.generate_helpers import spy_on_bound_caches, streamed, tokens_by_member, tokens_of
from tests.test_batching import batches_run

pytest.importorskip("tokenizers")

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "real" / "seq2seq"
REFERENCE: dict[str, Any] = json.loads((FIXTURES / "reference.json").read_text(encoding="utf-8"))
N = int(REFERENCE["new_tokens"])
CASES = [
    (arch, k) for arch in ("t5", "bart") for k in range(len(REFERENCE["models"][arch]["cases"]))
]
GENERATE = '[stream]\nmode = "generate"\n'
# Requests queued within 0.3 s share runs: their steps in lock-step, a row each.
BATCHING = "[batching]\nmax_batch = 4\nmax_queue_delay_us = 300000\n"
MODELS = {  # name: (fixture, config.toml after GENERATE, files left out)
    "t5": ("t5", "", ()),
    "bart": ("bart", "", ()),
    "bart_short": ("bart", "[generate]\ncontext = 12\n", ()),
    "bart_batched": ("bart", BATCHING, ()),
    "t5_batched": ("t5", BATCHING, ()),
    "t5_alone": ("t5", "", (ENCODER_FILE,)),
    "t5_torn": ("t5", "", ()),  # its encoder_model.onnx cut short below
    "t5_ruled": ("t5", "", ()),  # generation_config.json with the reference's `ruled` below
    "bart_ruled": ("bart", "", ()),
    "bart_beams": ("bart", "", ()),  # generation_config.json's num_beams = 4 below
    "t5_tuned": ("t5", "", ()),  # generation_config.json with the reference's `tuned_beam`
    "bart_tuned": ("bart", "", ()),
}


@pytest.fixture(scope="module")
def agent_client(
    broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Agent, AgentClient]]:
    from tests.conftest import agent_config, serve_agent

    tmp = tmp_path_factory.mktemp("seq2seq")
    root = tmp / "models"
    for name, (fixture, extra, left_out) in MODELS.items():
        shutil.copytree(
            FIXTURES / fixture, root / name / "1", ignore=shutil.ignore_patterns(*left_out)
        )
        (root / name / "config.toml").write_text(GENERATE + extra)
    torn = root / "t5_torn" / "1" / ENCODER_FILE
    torn.write_bytes(torn.read_bytes()[:5000])
    beams = root / "bart_beams" / "1" / "generation_config.json"
    beams.write_text(json.dumps({**json.loads(beams.read_text()), "num_beams": 4}))
    for arch in ("t5", "bart"):
        for kind, key in (("ruled", "ruled"), ("tuned", "tuned_beam")):
            settings = root / f"{arch}_{kind}" / "1" / "generation_config.json"
            given = REFERENCE["models"][arch][key]
            settings.write_text(json.dumps({**json.loads(settings.read_text()), **given}))
    yield from serve_agent(broker, agent_config(tmp, broker, root), 20)


def test_the_exports_load_and_the_broken_ones_say_why(
    agent_client: tuple[Agent, AgentClient],
) -> None:
    agent, _ = agent_client
    versions = {name: m["versions"]["1"] for name, m in agent.models.inventory()["models"].items()}
    for name in ("t5", "bart", "bart_short", "bart_batched", "t5_batched"):
        assert versions[name]["state"] == "ready", (name, versions[name])
    assert versions["t5_alone"]["state"] == "failed"
    assert (
        f"its encoder, {ENCODER_FILE}, is not in the version folder"
        in (versions["t5_alone"]["error"])
    )
    assert versions["t5_torn"]["state"] == "failed"
    torn = r"cannot load \S+/encoder_model\.onnx: .*INVALID_PROTOBUF"
    assert re.search(torn, versions["t5_torn"]["error"]), versions["t5_torn"]["error"]


@pytest.mark.parametrize(("arch", "case"), CASES)
def test_greedy_tokens_and_text_equal_hugging_face(
    agent_client: tuple[Agent, AgentClient], arch: str, case: int
) -> None:
    """The prompt to the encoder (with the tokenizer's `</s>`), the decoder from its start
    token, BART's forced first token: Hugging Face's tokens, text, finish reason."""
    _, client = agent_client
    ref = REFERENCE["models"][arch]["cases"][case]
    reply, chunks = streamed(client, arch, {"prompt": ref["prompt"]}, max_new_tokens=N)
    assert tokens_of(chunks) == ref["greedy"]
    assert "".join(c.text for c in chunks) == ref["text"]
    assert reply.end.finish_reason == ref["finish"]
    assert reply.end.usage == {
        "prompt_tokens": len(ref["ids"]),
        "completion_tokens": len(ref["greedy"]),
    }


@pytest.mark.parametrize(("arch", "case"), CASES)
def test_the_configs_ngram_ban_penalty_and_minimum_lengths_as_generate_applies_them(
    agent_client: tuple[Agent, AgentClient], arch: str, case: int
) -> None:
    """generation_config.json's `no_repeat_ngram_size`, `repetition_penalty` and `min_length`
    (T5's: a 2-gram ban and 10 decoder ids, its start token counted, before an eos; BART's:
    a 3-gram ban and a penalty of 1.5): Hugging Face's tokens, text and finish under the same
    settings."""
    _, client = agent_client
    ref = REFERENCE["models"][arch]["cases"][case]
    reply, chunks = streamed(client, f"{arch}_ruled", {"prompt": ref["prompt"]}, max_new_tokens=N)
    assert tokens_of(chunks) == ref["ruled"]["greedy"]
    assert "".join(c.text for c in chunks) == ref["ruled"]["text"]
    assert reply.end.finish_reason == ref["ruled"]["finish"]


@pytest.mark.parametrize(("arch", "case"), CASES)
def test_beam_search_equals_hugging_face_and_streams_what_the_beams_agree_on(
    agent_client: tuple[Agent, AgentClient], arch: str, case: int
) -> None:
    """`params.num_beams = 4`: `generate(num_beams=4)`'s tokens, text and finish; the chunks
    before the last carry tokens every beam had settled, so together they are the answer."""
    _, client = agent_client
    ref = REFERENCE["models"][arch]["cases"][case]
    inputs = {"prompt": ref["prompt"]}
    reply, chunks = streamed(client, arch, inputs, max_new_tokens=N, num_beams=4)
    assert tokens_of(chunks) == ref["beam"]["greedy"]
    assert "".join(c.text for c in chunks) == ref["beam"]["text"]
    assert reply.end.finish_reason == ref["beam"]["finish"]
    assert reply.end.usage["completion_tokens"] == len(ref["beam"]["greedy"])


@pytest.mark.parametrize(("arch", "case"), CASES)
def test_a_summarisers_search_settings_as_generate_applies_them(
    agent_client: tuple[Agent, AgentClient], arch: str, case: int
) -> None:
    """generation_config.json's `num_beams`, `length_penalty` and `early_stopping` (T5: 4
    beams, 0.6, "never"; BART: 3 beams, 2.0, true, with a 3-gram ban and a penalty of 1.5
    on each beam): Hugging Face's answer, the request asking nothing."""
    _, client = agent_client
    ref = REFERENCE["models"][arch]["cases"][case]
    reply, chunks = streamed(client, f"{arch}_tuned", {"prompt": ref["prompt"]}, max_new_tokens=N)
    assert tokens_of(chunks) == ref["tuned_beam"]["greedy"]
    assert reply.end.finish_reason == ref["tuned_beam"]["finish"]


def test_beams_settle_before_the_end_and_follow_the_models_config(
    agent_client: tuple[Agent, AgentClient],
) -> None:
    """BART's beams agree on their first tokens long before the search ends: those come in
    chunks of their own. A config's `num_beams` is the default; a request that samples
    samples; beams with sampling or stop strings are refused."""
    _, client = agent_client
    ref = REFERENCE["models"]["bart"]["cases"][1]
    inputs = {"prompt": ref["prompt"]}
    _, chunks = streamed(client, "bart", inputs, max_new_tokens=N, num_beams=4)
    assert len(chunks) > 2 and len(tokens_of(chunks[:1])) < len(ref["beam"]["greedy"])
    _, by_config = streamed(client, "bart_beams", inputs, max_new_tokens=N)
    assert tokens_of(by_config) == ref["beam"]["greedy"] != ref["greedy"]
    _, greedy = streamed(client, "bart_beams", inputs, max_new_tokens=N, num_beams=1)
    assert tokens_of(greedy) == ref["greedy"]
    _, sampled = streamed(client, "bart_beams", inputs, max_new_tokens=4, temperature=1.0)
    assert len(tokens_of(sampled)) == 4
    for refused in ({"temperature": 1.0}, {"stop": ["x"]}):
        with pytest.raises(AgentError, match=r"params\.num_beams > 1 is a greedy search"):
            streamed(client, "bart", inputs, num_beams=2, **refused)


def test_the_ruled_references_differ_where_each_rule_bites() -> None:
    """Each setting changes a path: the n-gram bans end the repeats, and T5's fourth prompt,
    which ends by its eos at 8 new tokens alone, runs on past its minimum of 10."""
    for arch in ("t5", "bart"):
        cases = REFERENCE["models"][arch]["cases"]
        assert all(c["ruled"]["greedy"] != c["greedy"] for c in cases[1:])
        n = REFERENCE["models"][arch]["ruled"]["no_repeat_ngram_size"]
        for c in cases:
            grams = [tuple(c["ruled"]["greedy"][k : k + n]) for k in range(N - n + 1)]
            assert len(set(grams)) == len(grams)
    t5 = REFERENCE["models"]["t5"]["cases"][3]
    assert t5["finish"] == "eos" and len(t5["greedy"]) < 10 < len(t5["ruled"]["greedy"])


def test_the_fixture_ends_both_ways_and_forces_barts_first_token() -> None:
    """What the references above are worth: each model has a generation ended by eos and one
    by length, and every BART generation starts with its forced token."""
    for arch in ("t5", "bart"):
        finishes = {case["finish"] for case in REFERENCE["models"][arch]["cases"]}
        assert finishes == {"eos", "length"}, arch
    bart = REFERENCE["models"]["bart"]
    assert bart["forced_bos_token_id"] is not None
    assert {case["greedy"][0] for case in bart["cases"]} == {bart["forced_bos_token_id"]}


def test_token_ids_in_and_fewer_new_tokens(agent_client: tuple[Agent, AgentClient]) -> None:
    _, client = agent_client
    ref = REFERENCE["models"]["t5"]["cases"][1]
    ids = np.array([ref["ids"]], dtype=np.int64)
    reply, chunks = streamed(client, "t5", {"input_ids": ids}, max_new_tokens=5)
    assert tokens_of(chunks) == ref["greedy"][:5]
    assert reply.end.finish_reason == "length"
    result = client.request("t5", {"input_ids": ids}, params={"max_new_tokens": 5}, stream=False)
    assert result.collect()["tokens"].tolist() == ref["greedy"][:5]


def test_a_text_model_refuses_a_speech_prompts_params(
    agent_client: tuple[Agent, AgentClient],
) -> None:
    _, client = agent_client
    with pytest.raises(AgentError, match=r"takes no params\.language nor params\.task"):
        streamed(client, "t5", {"prompt": "Hello"}, language="en")


@pytest.mark.parametrize(
    ("model", "arch"), [("bart", "bart"), ("bart_batched", "bart"), ("t5_batched", "t5")]
)
def test_concurrent_requests_each_get_their_own_tokens(
    agent_client: tuple[Agent, AgentClient], model: str, arch: str
) -> None:
    """Requests at once, each its own tokens: a request at a time, or (`[batching]`) in
    lock-step, a row each, the prompts' encoder states padded to the longest and masked;
    the rows leave as they end (eos, length)."""
    agent, client = agent_client
    refs = REFERENCE["models"][arch]["cases"]
    got: dict[int, list[int]] = {}
    before = batches_run(agent, model)

    def ask(k: int) -> None:
        inputs = {"prompt": refs[k]["prompt"]}
        got[k] = tokens_of(streamed(client, model, inputs, max_new_tokens=N)[1])

    threads = [threading.Thread(target=ask, args=(k,), name=f"ask-{k}") for k in range(len(refs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert got == {k: ref["greedy"] for k, ref in enumerate(refs)}
    if model.endswith("_batched"):
        runs, requests = (a - b for a, b in zip(batches_run(agent, model), before, strict=True))
        assert requests == len(refs) and runs < len(refs)  # they shared runs


def test_beam_searches_share_a_batched_run_with_greedy_requests(
    agent_client: tuple[Agent, AgentClient],
) -> None:
    """Under `[batching]`, two beam searches queued with two greedy requests: the beams run
    as rows of their own runs, the greedy ones interleave with them; each answer its own."""
    _, client = agent_client
    refs = REFERENCE["models"]["bart"]["cases"]
    got: dict[int, list[int]] = {}

    def ask(k: int) -> None:
        params = {"num_beams": 4} if k % 2 else {}
        inputs = {"prompt": refs[k]["prompt"]}
        got[k] = tokens_of(streamed(client, "bart_batched", inputs, max_new_tokens=N, **params)[1])

    threads = [threading.Thread(target=ask, args=(k,), name=f"ask-{k}") for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    want = {k: ref["beam"]["greedy"] if k % 2 else ref["greedy"] for k, ref in enumerate(refs)}
    assert got == want


def test_a_prompt_longer_than_the_encoder_takes_is_refused(
    agent_client: tuple[Agent, AgentClient],
) -> None:
    _, client = agent_client
    ref = REFERENCE["models"]["bart"]["cases"][0]
    with pytest.raises(AgentError, match=r"bad_request.*the encoder takes at most 12"):
        streamed(client, "bart_short", {"prompt": ref["prompt"]})
    reply, chunks = streamed(client, "bart_short", {"input_ids": np.array([[0, 5, 2]])})
    assert len(tokens_of(chunks)) == 11  # its start token takes one of the 12 positions
    assert reply.end.finish_reason == "length"


def test_a_t5_is_bounded_by_its_tokenizers_model_max_length(
    agent_client: tuple[Agent, AgentClient],
) -> None:
    """A T5's config.json names no context (relative positions); its tokenizer_config.json's
    `model_max_length` bounds the prompt, so a long prompt is refused, not run through an
    encoder whose attention grows with its square."""
    _, client = agent_client
    with pytest.raises(AgentError, match=r"bad_request.*the encoder takes at most 64"):
        streamed(client, "t5", {"input_ids": np.ones((1, 65), np.int64)})
    with pytest.raises(AgentError, match=r"bad_request.*characters: more than 64 tokens hold"):
        streamed(client, "t5", {"prompt": "x" * 6401})


class _Signature:
    """Just the signature of a session: what `recognise` and `open_generation` read."""

    def __init__(self, reference: dict[str, Any]) -> None:
        dtypes = {"tensor(int64)": np.int64, "tensor(float)": np.float32, "tensor(bool)": np.bool_}
        self.inputs, self.outputs = (
            [TensorSpec(a["name"], np.dtype(dtypes[a["type"]]), tuple(a["shape"])) for a in args]
            for args in (reference["inputs"], reference["outputs"])
        )


def test_the_decoders_layout() -> None:
    """The cross-attention's cache is fixed after the first run; the decoder's own grows."""
    signature = _Signature(REFERENCE["models"]["t5"]["decoder"])
    layout = recognise(signature.inputs, signature.outputs, GenerateConfig())
    assert layout.cross is not None and layout.cross.states == "encoder_hidden_states"
    assert layout.cross.mask == "encoder_attention_mask"
    fixed = {slot.input for slot in layout.cache if slot.fixed}
    assert fixed == {f"past_key_values.{n}.encoder.{kv}" for n in (0, 1) for kv in ("key", "value")}
    assert {s.output for s in layout.cache if not s.fixed} == {
        f"present.{n}.decoder.{kv}" for n in (0, 1) for kv in ("key", "value")
    }
    assert layout.cache_branch == "use_cache_branch" and layout.batchable
    unmasked = dataclasses.replace(layout.cross, mask=None, mask_dtype=None)
    assert not dataclasses.replace(layout, cross=unmasked).batchable  # padding unmaskable


def test_an_encoder_decoder_needs_onnx_runtime_and_its_start_token(tmp_path: Path) -> None:
    signature = _Signature(REFERENCE["models"]["t5"]["decoder"])
    folder = tmp_path / "t5"
    shutil.copytree(FIXTURES / "t5", folder)
    with pytest.raises(ModelLoadError, match="runs on ONNX Runtime"):
        open_generation(None, signature, folder, None)  # type: ignore[arg-type]
    for name in ("generation_config.json", "config.json"):
        data = json.loads((folder / name).read_text())
        data.pop("decoder_start_token_id", None)
        (folder / name).write_text(json.dumps(data))
    with pytest.raises(ModelLoadError, match="needs decoder_start_token_id"):
        open_generation(None, signature, folder, None)  # type: ignore[arg-type]


def test_generation_settings_the_agent_does_not_apply_are_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A summariser's banned words and sampling by default: the version loads, with a
    warning; its beam search, n-gram ban and minimum length are applied, not named."""
    signature = _Signature(REFERENCE["models"]["bart"]["decoder"])
    folder = tmp_path / "bart"
    shutil.copytree(FIXTURES / "bart", folder)
    settings = json.loads((folder / "generation_config.json").read_text())
    settings |= {"num_beams": 4, "no_repeat_ngram_size": 3, "min_length": 9}
    settings |= {"bad_words_ids": [[5]], "length_penalty": 2.0, "do_sample": True}
    (folder / "generation_config.json").write_text(json.dumps(settings))
    with pytest.raises(ModelLoadError, match="runs on ONNX Runtime"):
        open_generation(None, signature, folder, None)  # type: ignore[arg-type]
    warned = [r.getMessage() for r in caplog.records if "generation_config.json" in r.getMessage()]
    assert len(warned) == 1 and "sets do_sample = true, bad_words_ids = [[5]];" in warned[0]


@pytest.mark.parametrize("arch", ["t5", "bart"])
def test_the_caches_stay_bound_on_a_device_session(
    arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU provider every cache output stays where ONNX Runtime made it (IOBinding): the
    decoder's own, fed back each step, and the cross-attention's, kept from the first step.
    The same path, bound on the CPU here: Hugging Face's greedy tokens, every step after the
    first fed the runtime's own values."""
    backend, options = OnnxRuntimeBackend(), BackendOptions(1)
    session = backend.load(FIXTURES / arch / "model.onnx", options)
    monkeypatch.setattr(OnnxSession, "keeps_on_device", property(lambda self: True))
    setup = open_generation(None, session, FIXTURES / arch, lambda f: backend.load(f, options))
    assert len(setup.device_cache) == 8  # two layers' decoder and encoder keys and values
    fed = spy_on_bound_caches(monkeypatch)
    ref = REFERENCE["models"][arch]["cases"][1]
    prompt = {"prompt": np.array(ref["prompt"], dtype=object)}
    ask = generate_mode.ask_of(prompt, {"max_new_tokens": N}, setup)
    run = Run(session, StreamConfig(mode="generate"), [Member({}, 1, generation=ask)])
    try:
        pieces = list(generate_mode.generate(run))
    finally:
        setup.close()
        session.close()
    assert [int(t) for group in pieces for p in group for t in p.outputs["tokens"]] == ref["greedy"]
    assert fed[0] == {np.ndarray} and all(kinds == {ort.OrtValue} for kinds in fed[1:])


def test_the_encoder_is_warmed_up_at_load(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """One run of the encoder at load (a first request then finds it warm); where that run
    fails, a warning, and the version still serves."""
    from agent.models.loading import _warm_encoder

    backend, options = OnnxRuntimeBackend(), BackendOptions(1)
    session = backend.load(FIXTURES / "t5" / "model.onnx", options)
    setup = open_generation(None, session, FIXTURES / "t5", lambda f: backend.load(f, options))
    assert setup.encoder is not None
    runs: list[dict[str, Any]] = []
    real_run = setup.encoder.session.run
    monkeypatch.setattr(setup.encoder.session, "run", lambda i: runs.append(i) or real_run(i))
    try:
        _warm_encoder(setup, FIXTURES / "t5")
        assert len(runs) == 1 and runs[0]["input_ids"].tolist() == [[0, 0, 0, 0]]

        def refuse(inputs: dict[str, Any]) -> Any:
            raise RuntimeError("no such shape")

        monkeypatch.setattr(setup.encoder.session, "run", refuse)
        _warm_encoder(setup, FIXTURES / "t5")
    finally:
        setup.close()
        session.close()
    assert "the encoder's warm-up failed, served cold: no such shape" in caplog.text


@pytest.mark.parametrize(("arch", "bound"), [("t5", False), ("bart", False), ("bart", True)])
def test_members_of_one_run_step_in_lock_step(
    arch: str, bound: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four prompts of different lengths in one run: each encoder and first step alone, then
    one run of the decoder a step for all (the encoders' side padded on the right and
    masked), rows leaving as they end; every member's greedy tokens equal Hugging Face's.
    `bound`: the caches kept as the runtime's values (a GPU provider's path, on the CPU)."""
    if bound:
        monkeypatch.setattr(OnnxSession, "keeps_on_device", property(lambda self: True))
    backend, options = OnnxRuntimeBackend(), BackendOptions(1)
    session = backend.load(FIXTURES / arch / "model.onnx", options)
    setup = open_generation(None, session, FIXTURES / arch, lambda f: backend.load(f, options))
    cases = REFERENCE["models"][arch]["cases"]
    assert setup.layout.batchable and len({len(c["ids"]) for c in cases}) > 1
    asks = [
        generate_mode.ask_of({"input_ids": np.array(c["ids"])}, {"max_new_tokens": N}, setup)
        for c in cases
    ]
    try:
        run, tokens = tokens_by_member(session, asks)
    finally:
        setup.close()
        session.close()
    assert tokens == {k: case["greedy"] for k, case in enumerate(cases)}
    longest = max(len(case["greedy"]) for case in cases)
    # the encoders and first steps alone, then one run a step for all the rows left
    assert run.runs == 2 * len(cases) + longest - 1
