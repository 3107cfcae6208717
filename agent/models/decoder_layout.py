"""What a `mode = "generate"` version needs besides its session: the decoder's layout.

Recognised from the signature alone, as real exporters write it: optimum's
`text-generation-with-past` export and a plain `torch.onnx.export` of a Hugging Face model name
their tensors `input_ids`, `attention_mask`, optional `position_ids`,
`past_key_values.N.key/value` in and `present.N.key/value` out, `logits`, and (optimum's older
merged decoders) a `use_cache_branch` flag. A cache tensor is `[batch, heads, past, head_dim]`:
its batch axis is the first, its past axis the symbolic one after it; every other axis must be
fixed. A decoder exported without its cache (optimum's `text-generation`: no
`past_key_values.*`) is recognised too and run as Hugging Face's `generate(use_cache=False)`:
every step the whole sequence again. `[generate]` overrides the names, the eos ids and the
context length.

An encoder-decoder (optimum's `text2text-generation-with-past`: T5, BART, Marian) is recognised
from its decoder's signature too: `encoder_hidden_states` and `encoder_attention_mask` in, and a
cache of `past_key_values.N.decoder.*` (grown by each run) and `past_key_values.N.encoder.*`
(the cross-attention's, made by the first run and fed unchanged after it). Its version folder
holds the decoder as `model.onnx` (optimum's `decoder_model_merged.onnx`) and the encoder as
`encoder_model.onnx` beside it, opened on the same backend (`agent.models.encoders`, which
says what the encoder reads: text, a Whisper's recording, an image-to-text model's picture);
the decoder starts from `decoder_start_token_id`. What the configs impose on the tokens
(forced, suppressed, n-grams, minimum lengths, beams) is `Generation.token_settings`
(`agent.models.token_settings`).

The eos ids come from `[generate] eos`, else `generation_config.json`, else `config.json` in the
version folder; the context length from `[generate] context`, else `config.json` (`n_positions`,
`max_position_embeddings`, ...), else `tokenizer_config.json`'s `model_max_length` (a T5's
config names none), else unbounded. Where the folder holds neither Hugging Face file, ONNX
Runtime GenAI's `genai_config.json` stands in for both, and names the tensors
(`agent.models.genai_config`). A `tokenizer.json` in the folder lets requests send text
(`agent.models.tokenizer`), and with a chat template beside it a conversation
(`agent.models.chat_template`).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from agent.models.backends.base import (
    DeviceBinding,
    DeviceCut,
    ModelLoadError,
    Session,
    TensorSpec,
)
from agent.models.chat_template import ChatTemplate, open_chat_template
from agent.models.encoders import ENCODER_FILE, FEATURES, Encoder, encoder_reads
from agent.models.genai_config import GENAI_CONFIG, GenaiConfig, read_genai_config
from agent.models.generate_config import GenerateConfig
from agent.models.hf_files import (
    alibi_positions,
    context_of,
    model_max_length,
    read_json,
    whole_number,
)
from agent.models.log_mel import LogMel
from agent.models.prefix_cache import PrefixCache
from agent.models.preprocess import PreprocessConfig, preprocess
from agent.models.speech_prompt import SpeechPrompt
from agent.models.token_settings import TokenSettings, first_number, token_settings_of, unapplied
from agent.models.tokenizer import TextCodec, open_tokenizer

__all__ = [
    "DECODER_INPUTS",
    "ENCODER_FILE",
    "PAST_INPUT",
    "CacheSlot",
    "CrossInputs",
    "DecoderLayout",
    "Encoder",
    "Generation",
    "context_in",
    "open_generation",
    "past_axis",
    "recognise",
]

log = logging.getLogger(__name__)

PAST_INPUT = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")  # a cache input's name
# An encoder-decoder's decoder: its own cache (`decoder`) and the cross-attention's (`encoder`).
CROSS_PAST_INPUT = re.compile(r"^past_key_values\.(\d+)\.(decoder|encoder)\.(key|value)$")
ENCODER_STATES = "encoder_hidden_states"  # the decoder's input of the encoder's output
ENCODER_MASK = "encoder_attention_mask"
# A decoder's other inputs, as exporters name them (`[generate]` may rename the first three).
DECODER_INPUTS = frozenset({"input_ids", "attention_mask", "position_ids", "use_cache_branch"})


@dataclass(frozen=True)
class CacheSlot:
    """One cache tensor: fed from `output` into `input` at every step."""

    input: str
    output: str
    dtype: np.dtype[Any]
    shape: tuple[int | None, ...]  # None: the batch axis (0) and the past axis
    past_axis: int
    fixed: bool = False  # the cross-attention's: made by the first run, then fed unchanged

    def empty(self, batch: int) -> np.ndarray[Any, Any]:
        """The cache of a prefill: past length 0."""
        dims = [
            batch if axis == 0 else 0 if axis == self.past_axis else int(d or 0)
            for axis, d in enumerate(self.shape)
        ]
        return np.zeros(dims, dtype=self.dtype)


@dataclass(frozen=True)
class DecoderLayout:
    """The names a decoder's loop drives, read from its signature."""

    input_ids: str
    logits: str
    attention_mask: str | None
    position_ids: str | None
    cache_branch: str | None  # optimum's merged decoders: `use_cache_branch` (bool [1])
    cache: tuple[CacheSlot, ...]
    int_dtypes: dict[str, np.dtype[Any]]  # input_ids, attention_mask, position_ids
    # An encoder-decoder's decoder: its `encoder_attention_mask` input, where it has one
    # (`ENCODER_STATES` is its other input of the encoder's run); None: a decoder alone.
    cross: CrossInputs | None = None
    # Positions made inside the graph as ALiBi biases, which padding on the left leaves as
    # they are (`config.json`: `hf_files.alibi_positions`): rows pad without `position_ids`.
    alibi: bool = False

    @property
    def batchable(self) -> bool:
        """Whether several generations can share runs, a row each
        (`agent.inference.generate_lockstep`): left padding needs the mask and explicit
        positions (or ALiBi's, which padding leaves as they are), a cache to pad, and every
        cache tensor a batch axis before its past axis.
        An encoder-decoder's decoders all start from one token, so their own caches line up
        as they are; their encoders' outputs are padded on the right and masked, which needs
        the decoder's `encoder_attention_mask`."""
        if self.cross is not None:
            return self.cache_pads and self.cross.mask is not None
        positioned = self.position_ids is not None or self.alibi
        return self.cache_pads and self.attention_mask is not None and positioned

    @property
    def cache_pads(self) -> bool:
        """Whether there is a cache and each of its tensors has a batch axis before its past
        axis (rows of different lengths can be padded to one)."""
        return bool(self.cache) and all(slot.past_axis > 0 for slot in self.cache)


@dataclass(frozen=True)
class CrossInputs:
    """An encoder-decoder's decoder inputs that come from the encoder's run."""

    states: str  # encoder_hidden_states
    mask: str | None  # encoder_attention_mask
    mask_dtype: np.dtype[Any] | None


@dataclass(frozen=True)
class Generation:
    """A generate version's layout, stopping rules and tokenizer."""

    layout: DecoderLayout
    eos: frozenset[int]
    context: int | None  # prompt + new tokens, at most; None: unbounded
    max_new_tokens: int  # the config's cap of `params.max_new_tokens`
    tokenizer: TextCodec | None
    vocab: int | None  # the logits' last axis, where fixed
    # The cache outputs kept on the session's device between steps (IOBinding, a GPU
    # provider): never copied to the host. Empty on the CPU, where a host copy is the value.
    device_cache: tuple[str, ...] = ()
    chat: ChatTemplate | None = None  # with a tokenizer: conversations in (`inputs.messages`)
    encoder: Encoder | None = None  # an encoder-decoder's encoder (its session is owned here)
    decoder_start: int | None = None  # an encoder-decoder: the decoder's first input token
    # What the configs impose on the tokens: forced, suppressed, n-grams, minimum lengths.
    token_settings: TokenSettings = field(default_factory=TokenSettings)
    log_mel: LogMel | None = None  # a speech encoder's features (Whisper)
    speech: SpeechPrompt | None = None  # a Whisper decoder's prompt rules
    image: PreprocessConfig | None = None  # an image encoder's preprocessing (TrOCR, captioners)
    # Recent generations' caches for prompts that begin the same way (`[generate]
    # prefix_cache_mb`; a decoder alone, its cache on the host).
    prefix_cache: PrefixCache | None = None
    prompt_lookup: int = 0  # `[generate] prompt_lookup`: the default of `params.prompt_lookup`
    # Where the cache stays on the device: the session, where it can cut the cache there
    # (ONNX Runtime; prompt lookup cuts it to the tokens kept). None: on the host, or not.
    device_cut: DeviceCut | None = None

    @property
    def cuttable(self) -> bool:
        """Whether the loop can cut this model's cache to fewer tokens: a decoder alone whose
        cache is on the host, or on a device that can cut it (prompt lookup's guesses)."""
        layout = self.layout
        alone = layout.cross is None and bool(layout.cache)
        return alone and (not self.device_cache or self.device_cut is not None)

    @property
    def batchable(self) -> bool:
        """Whether requests can step in lock-step (`DecoderLayout.batchable`). A speech
        recogniser's encoder reads a fixed window, so its outputs are all one length and need
        no mask: its decoders join without `encoder_attention_mask` (Whisper has none)."""
        if self.log_mel is not None or self.image is not None:
            return self.layout.cache_pads
        return self.layout.batchable

    def encoder_warm_up_inputs(self) -> dict[str, Any] | None:
        """What the encoder runs on at load: silence, or a few start tokens."""
        if self.encoder is None:
            return None
        if self.log_mel is not None:
            return {FEATURES: self.log_mel.features(np.zeros(0, dtype=np.float32))}
        if self.image is not None:
            blank = np.zeros((32, 32, 3), dtype=np.uint8)
            return {self.encoder.input.name: preprocess(blank, self.image)}
        if self.decoder_start is None:
            return None
        return self.encoder.inputs([self.decoder_start] * 4)

    def close(self) -> None:
        """Closes the encoder's session (the decoder's is the version's) and drops the kept
        caches."""
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        if self.encoder is not None:
            self.encoder.close()


def open_generation(
    config: GenerateConfig | None,
    session: Session,
    folder: Path,
    open_encoder: Callable[[Path], Session] | None = None,
) -> Generation:
    """The version's :class:`Generation`; ModelLoadError (one line) where the signature is not
    a decoder's or a file in the folder is unreadable. `open_encoder`: how an encoder-decoder's
    `encoder_model.onnx` is opened (the version's backend); None where it cannot be."""
    genai = read_genai_config(folder)
    config = _named_by(config or GenerateConfig(), genai)
    layout = recognise(session.inputs, session.outputs, config)
    hf_config = read_json(folder / "config.json") or genai.hf_config
    if layout.position_ids is None and alibi_positions(hf_config):
        layout = dataclasses.replace(layout, alibi=True)
    generation_file = "generation_config.json"
    generation_config = read_json(folder / generation_file)
    if not generation_config and genai.generation_config:
        generation_file, generation_config = GENAI_CONFIG, genai.generation_config
    if config.eos is not None:
        eos = frozenset(config.eos)
    else:
        eos = _eos_of(generation_config) or _eos_of(hf_config)
    context = config.context or _context(hf_config, folder)
    logits = next(spec for spec in session.outputs if spec.name == layout.logits)
    vocab = logits.shape[-1] if logits.shape and isinstance(logits.shape[-1], int) else None
    tokenizer = open_tokenizer(folder)
    on_device = isinstance(session, DeviceBinding) and session.keeps_on_device
    device_cache = tuple(slot.output for slot in layout.cache) if on_device else ()
    chat = open_chat_template(folder) if tokenizer is not None else None
    not_applied = unapplied(generation_config)
    if not_applied:
        log.warning(
            "%s: %s sets %s; the agent decodes greedily unless a request's params sample, "
            "and does not apply them",
            folder,
            generation_file,
            ", ".join(not_applied),
        )
    configs = (generation_config, hf_config)
    generation = Generation(
        layout,
        eos,
        context,
        config.max_new_tokens,
        tokenizer,
        vocab,
        device_cache,
        chat,
        token_settings=token_settings_of(configs, vocab, generation_file),
    )
    if device_cache and isinstance(session, DeviceCut):
        generation = dataclasses.replace(generation, device_cut=session)
    store = _prefix_cache(config, generation)
    if store is not None:
        generation = dataclasses.replace(generation, prefix_cache=store)
    if config.prompt_lookup and not generation.cuttable:
        log.warning("[generate] prompt_lookup is not applied: %s", _not_host_cache(layout))
    elif config.prompt_lookup:
        generation = dataclasses.replace(generation, prompt_lookup=config.prompt_lookup)
    if layout.cross is None:
        return generation
    return _with_encoder(generation, folder, configs, open_encoder)


def _prefix_cache(config: GenerateConfig, generation: Generation) -> PrefixCache | None:
    """The version's prefix cache, where `[generate] prefix_cache_mb` asks one and the model
    can keep and cut its cache (`Generation.cuttable`: the arrays the CPU provider returns
    and the values a GPU provider keeps are each run's own, never written again)."""
    if not config.prefix_cache_mb:
        return None
    if not generation.cuttable:
        log.warning(
            "[generate] prefix_cache_mb is not applied: %s", _not_host_cache(generation.layout)
        )
        return None
    slots = {s.input: (s.past_axis, s.dtype.itemsize) for s in generation.layout.cache}
    return PrefixCache(config.prefix_cache_mb << 20, slots, generation.device_cut)


def _not_host_cache(layout: DecoderLayout) -> str:
    """Why a model's cache cannot be kept or cut on the host."""
    if layout.cross is not None:
        return "an encoder-decoder reads its prompt in its encoder"
    if not layout.cache:
        return "the decoder was exported without its cache"
    return "the cache stays on the device (a GPU provider or TensorRT) and is not cut there"


def _named_by(config: GenerateConfig, genai: GenaiConfig) -> GenerateConfig:
    """`config` with the tensor names `genai_config.json` gives where `[generate]` names none."""
    names = {key: name for key, name in genai.names.items() if getattr(config, key) is None}
    return config.model_copy(update=names) if names else config


def _with_encoder(
    generation: Generation,
    folder: Path,
    configs: tuple[dict[str, Any], dict[str, Any]],
    open_encoder: Callable[[Path], Session] | None,
) -> Generation:
    """An encoder-decoder's `generation`: its encoder opened, its start token read from
    `configs` (generation_config.json, then config.json)."""
    start = first_number(configs, "decoder_start_token_id")
    if start is None:
        raise ModelLoadError(
            "an encoder-decoder needs decoder_start_token_id in generation_config.json or "
            "config.json"
        )
    if not (folder / ENCODER_FILE).is_file():
        raise ModelLoadError(
            f"the decoder takes {ENCODER_STATES}: its encoder, {ENCODER_FILE}, is not in the "
            "version folder (copy optimum's export folder, decoder_model_merged.onnx as "
            "model.onnx)"
        )
    if open_encoder is None:
        raise ModelLoadError('an encoder-decoder runs on ONNX Runtime (backend = "onnxruntime")')
    session = open_encoder(folder / ENCODER_FILE)
    try:
        encoder = Encoder(session)
    except BaseException:
        session.close()
        raise
    return dataclasses.replace(
        generation,
        encoder=encoder,
        decoder_start=start,
        **encoder_reads(encoder, folder, configs, start),
    )


def recognise(
    inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec], config: GenerateConfig
) -> DecoderLayout:
    """The decoder layout of a signature (see the module docstring)."""
    ins = {spec.name: spec for spec in inputs}
    outs = {spec.name: spec for spec in outputs}
    input_ids = _named(ins, config.input_ids, "input_ids", "input")
    logits = _named(outs, config.logits, "logits", "output")
    mask = _optional(ins, config.attention_mask, "attention_mask")
    positions = _optional(ins, config.position_ids, "position_ids")
    branch = "use_cache_branch" if "use_cache_branch" in ins else None
    ints = {}
    for name in (input_ids, mask, positions):
        if name is not None:
            dtype = np.dtype(ins[name].dtype)
            if dtype.kind not in "iu":
                raise ModelLoadError(f"generate: input '{name}' is {dtype}, not an integer tensor")
            ints[name] = dtype
    cross = _cross_inputs(ins)
    names = PAST_INPUT if cross is None else CROSS_PAST_INPUT
    cache = tuple(_cache_slot(spec, outs) for spec in inputs if names.match(spec.name))
    known = {input_ids, mask, positions, branch, *(slot.input for slot in cache)}
    if cross is not None:
        known |= {cross.states, cross.mask}
    unknown = [name for name in ins if name not in known]
    if unknown:
        raise ModelLoadError(
            f"generate: input(s) {', '.join(unknown[:5])} are not a decoder's (input_ids, "
            "attention_mask, position_ids, past_key_values.N.key/value, use_cache_branch; "
            "an encoder-decoder's encoder_hidden_states, encoder_attention_mask, "
            "past_key_values.N.decoder/encoder.key/value)"
        )
    return DecoderLayout(input_ids, logits, mask, positions, branch, cache, ints, cross)


def _cross_inputs(ins: dict[str, TensorSpec]) -> CrossInputs | None:
    """An encoder-decoder's inputs of the encoder's run, where the decoder takes them."""
    if ENCODER_STATES not in ins:
        return None
    mask = ins.get(ENCODER_MASK)
    mask_dtype = np.dtype(mask.dtype) if mask is not None else None
    if mask_dtype is not None and mask_dtype.kind not in "iu":
        raise ModelLoadError(f"generate: input '{ENCODER_MASK}' is {mask_dtype}, not integers")
    return CrossInputs(ENCODER_STATES, ENCODER_MASK if mask is not None else None, mask_dtype)


def _named(specs: dict[str, TensorSpec], override: str | None, default: str, kind: str) -> str:
    name = override or default
    if name not in specs:
        raise ModelLoadError(
            f"generate: the model has no {kind} '{name}' (set it in [generate] {default})"
        )
    return name


def _optional(specs: dict[str, TensorSpec], override: str | None, default: str) -> str | None:
    if override is not None:
        return _named(specs, override, default, "input")
    return default if default in specs else None


def _cache_slot(spec: TensorSpec, outputs: dict[str, TensorSpec]) -> CacheSlot:
    output = "present" + spec.name[len("past_key_values") :]  # present.N[.decoder].key
    if output not in outputs:
        raise ModelLoadError(f"generate: input '{spec.name}' has no output '{output}'")
    fixed = tuple(d if isinstance(d, int) else None for d in spec.shape)
    past = past_axis([d is None for d in fixed])
    if not fixed or fixed[0] is not None or past is None:
        raise ModelLoadError(
            f"generate: cache input '{spec.name}' {spec.describe()} is not [batch, ..., past, "
            "...] with every other axis fixed"
        )
    cross_attention = ".encoder." in spec.name  # an encoder-decoder's: fixed after the first run
    return CacheSlot(spec.name, output, np.dtype(spec.dtype), fixed, past, cross_attention)


def past_axis(dynamic: Sequence[bool]) -> int | None:
    """A cache tensor's past axis, given which of its axes are dynamic: the one dynamic axis
    after the batch axis (0), None unless there is exactly one."""
    found = [axis for axis, flag in enumerate(dynamic) if flag and axis > 0]
    return found[0] if len(found) == 1 else None


def context_in(folder: Path) -> int | None:
    """The context length the files in `folder` give, if they say one (ModelLoadError where
    one cannot be read); the TensorRT builder's decoder profile uses it."""
    hf_config = read_json(folder / "config.json") or read_genai_config(folder).hf_config
    return _context(hf_config, folder)


def _context(hf_config: dict[str, Any], folder: Path) -> int | None:
    """`config.json`'s context (`hf_config`), else `tokenizer_config.json`'s
    `model_max_length` (a T5's config names none), else None: unbounded."""
    found = context_of(hf_config)
    if found is None:
        found = model_max_length(read_json(folder / "tokenizer_config.json"))
    return found


def _eos_of(data: dict[str, Any]) -> frozenset[int]:
    value = data.get("eos_token_id")
    values = value if isinstance(value, list) else [value]
    return frozenset(v for v in map(whole_number, values) if v is not None)
