"""Opening one version for the manager: everything that must pass before it may serve.

This is invariant 2 of :mod:`agent.models.manager` in code: the folder's problem, the
signature (``[models.trust]``, before anything else reads the files), the checksum, the
backend's load, the fit with ``config.toml`` and with the version that
serves now, and a warm-up run. Any failure closes the session and raises
:class:`ModelLoadError` with one line, so the version is marked ``failed`` and the serving
one stays.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

from agent.models.audio_inputs import AudioNormalization, open_audio_normalization
from agent.models.backends.base import BackendOptions, ModelLoadError, Session
from agent.models.backends.registry import get_backend
from agent.models.decoder_layout import Generation, open_generation
from agent.models.defaults import default_arrays
from agent.models.image_processor import processor_preprocess
from agent.models.postprocess import Postprocessor, build_postprocess
from agent.models.preprocess import PreprocessConfig
from agent.models.records import ModelRecord
from agent.models.repository import VersionInfo, checksum_problem, verify_checksum
from agent.models.signature import check_signature, incompatibilities
from agent.models.text_inputs import TextInputs, open_text_inputs
from agent.models.trust import TrustPolicy
from agent.models.warmup import WARMUP_OK, run_warm_up

__all__ = ["OpenedVersion", "open_version", "verify_files"]

log = logging.getLogger(__name__)

TEXT_OPS = frozenset({"entities", "pool"})  # postprocess ops that read the request's text


@dataclass(frozen=True)
class OpenedVersion:
    """A version that passed every check, and what its requests need besides the session."""

    session: Session
    warmup: str  # the inventory's `warmup`: "ok", "off" or "skipped: ..."
    signed: dict[str, str] | None  # the inventory's `signed`, with [models.trust]
    postprocess: Postprocessor | None  # its [[postprocess]], labels read
    generation: Generation | None  # mode = "generate": the decoder's layout
    text: TextInputs | None  # a tokenizer.json beside a model of token ids: text in
    audio: AudioNormalization | None  # a speech encoder's samples normalised
    preprocess: PreprocessConfig | None  # no [preprocess]: its image processor's, if any


def verify_files(
    version: VersionInfo, trust: TrustPolicy | None, *, sha256: str | None = None
) -> dict[str, str] | None:
    """The version's signature (with ``trust``: who signed it) or else its checksum;
    ModelLoadError names what does not match. ``sha256``: the model file's digest, already
    computed (compared instead of hashing the file again)."""
    # A verified signature covers model.sha256 and the model file's bytes: no second read.
    signed = trust.verify(version.path) if trust is not None else None
    problem = None
    if signed is None:
        problem = verify_checksum(version) if sha256 is None else checksum_problem(version, sha256)
    if problem is not None:
        raise ModelLoadError(problem)
    return signed


def open_version(
    record: ModelRecord,
    version: VersionInfo,
    options: BackendOptions,
    *,
    warmup: bool,
    trust: TrustPolicy | None = None,
    engine: Path | None = None,
) -> OpenedVersion:
    """A checked, warmed-up session of ``version`` (``options``: the agent-wide ones), how
    the warm-up went, with ``trust`` who signed it, its ``[[postprocess]]`` checked against
    its outputs (labels read from the version folder), for `mode = "generate"` its decoder
    layout (agent.models.decoder_layout), for any other model of token ids with a
    `tokenizer.json` how text becomes its inputs (agent.models.text_inputs), and for a speech
    encoder whose feature extractor normalises, that (agent.models.audio_inputs), and an image
    model's processor as its `[preprocess]` (agent.models.image_processor). ``engine``: a plan
    the agent built from the version's ONNX file (agent.models.engine_builds), loaded
    instead of it once the version's own files passed."""
    if version.problem is not None:
        raise ModelLoadError(version.problem)
    if version.model_file is None or version.backend is None:
        raise ModelLoadError("no model file in the version folder")
    signed = verify_files(version, trust)
    backend = get_backend(version.backend)
    model_file = engine if engine is not None else version.model_file
    session_options = record.config.backend_options.apply(options)
    session = backend.load(model_file, session_options)
    generation: Generation | None = None
    try:
        problems = check_signature(record.config, session)
        serving = record.serving
        if serving is not None and record.config.policy.require_compatible:
            problems += incompatibilities(serving.session, session, serving.version)
        if problems:
            raise ModelLoadError("; ".join(problems))
        post = build_postprocess(
            record.config.postprocess,
            [spec.name for spec in session.outputs],
            version.model_file.parent,
        )
        folder = version.model_file.parent
        text = None
        if record.config.stream.mode == "generate":
            # An encoder-decoder's encoder_model.onnx, on ONNX Runtime (a plan is one engine)
            on_onnxruntime = version.backend == "onnxruntime" and engine is None
            opener = functools.partial(backend.load, options=session_options)
            open_encoder = opener if on_onnxruntime else None
            generation = open_generation(record.config.generate, session, folder, open_encoder)
            if record.config.batching.enabled:
                _check_generate_batching(generation, version.backend)
        else:
            text = open_text_inputs(session.inputs, folder, session.outputs)
        mode = record.config.stream.mode
        scan = record.config.scan
        scanned = scan.input if scan is not None else None
        audio = open_audio_normalization(session.inputs, folder, mode, scanned)
        preprocess = None
        if record.config.preprocess is None and generation is None:
            preprocess = processor_preprocess(session.inputs, folder)
        for op in record.config.postprocess:
            if op.op in TEXT_OPS:
                _check_text_op(op.op, text, mode)
        warmed = run_warm_up(
            session,
            record.config.warmup,
            folder,
            enabled=warmup,
            known=default_arrays(record.config.defaults, session.inputs),
            replacing=_warm_serving_version(record, version.version),
        )
        if warmup and warmed != "off" and generation is not None:
            _warm_encoder(generation, folder)
    except Exception as e:
        session.close()
        if generation is not None:
            generation.close()
        if isinstance(e, ModelLoadError):
            raise
        raise ModelLoadError(f"warm-up failed: {e}") from e
    return OpenedVersion(session, warmed, signed, post, generation, text, audio, preprocess)


def _warm_serving_version(record: ModelRecord, number: int) -> int | None:
    """The serving version, where its own warm-up ran (`ok`) and version `number`, newer,
    would replace it: then a guessed warm-up that fails fails `number` (`run_warm_up`)."""
    serving = record.serving
    if serving is None or number <= serving.version:
        return None
    entry = record.versions.get(serving.version)
    return serving.version if entry is not None and entry.warmup == WARMUP_OK else None


def _warm_encoder(generation: Generation, folder: Path) -> None:
    """An encoder-decoder's encoder run once at load, as its decoder was (a warning where it
    could not be)."""
    encoder, inputs = generation.encoder, generation.encoder_warm_up_inputs()
    if encoder is None or inputs is None:
        return
    failed = encoder.warm_up(inputs)
    if failed is not None:
        log.warning("%s: the encoder's warm-up failed, served cold: %s", folder, failed)


def _check_text_op(name: str, text: TextInputs | None, mode: str) -> None:
    """Ops that read a request's text (`entities`, `pool`), each text a row of the outputs."""
    if text is None:
        raise ModelLoadError(
            f"postprocess {name}: the version takes no text (it needs a tokenizer.json, the "
            "'text' extra and an integer input_ids)"
        )
    if mode != "whole":
        raise ModelLoadError(
            f'postprocess {name}: mode = "whole" only, where each text is a row of the '
            f'outputs (not "{mode}")'
        )


def _check_generate_batching(generation: Generation, backend: str | None) -> None:
    """`[batching]` of a generate model: its rows are left-padded (`Generation.batchable`),
    and a TensorRT engine's decoder profiles are built for one row."""
    if backend != "onnxruntime":
        raise ModelLoadError(
            f"[batching] of a generate model runs on ONNX Runtime: a {backend} engine's "
            "decoder profiles take one row"
        )
    if not generation.batchable:
        raise ModelLoadError(
            "[batching] of a generate model needs attention_mask and position_ids inputs "
            "(rows are left-padded; position_ids may be left out by ALiBi models, Bloom and "
            "MPT; an encoder-decoder's: encoder_attention_mask) and a cache "
            "(past_key_values.N.*) with a batch axis before each cache's past"
        )
