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

The eos ids come from `[generate] eos`, else `generation_config.json`, else `config.json` in the
version folder; the context length from `[generate] context`, else `config.json`
(`n_positions`, `max_position_embeddings`, ...), else unbounded. A `tokenizer.json` in the
folder lets requests send text (`agent.models.tokenizer`), and with a chat template beside it
a conversation (`agent.models.chat_template`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from agent.models.backends.base import DeviceBinding, ModelLoadError, Session, TensorSpec
from agent.models.chat_template import ChatTemplate, open_chat_template
from agent.models.generate_config import GenerateConfig
from agent.models.hf_files import context_of, read_json, whole_number
from agent.models.tokenizer import TextCodec, open_tokenizer

__all__ = [
    "DECODER_INPUTS",
    "PAST_INPUT",
    "CacheSlot",
    "DecoderLayout",
    "Generation",
    "context_in",
    "open_generation",
    "past_axis",
    "recognise",
]

PAST_INPUT = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")  # a cache input's name
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

    @property
    def batchable(self) -> bool:
        """Whether several generations can share runs, a row each
        (`agent.inference.generate_lockstep`): left padding needs the mask and explicit
        positions, a cache to pad, and every cache tensor a batch axis before its past axis."""
        return (
            self.attention_mask is not None
            and self.position_ids is not None
            and bool(self.cache)
            and all(slot.past_axis > 0 for slot in self.cache)
        )


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


def open_generation(config: GenerateConfig | None, session: Session, folder: Path) -> Generation:
    """The version's :class:`Generation`; ModelLoadError (one line) where the signature is not
    a decoder's or a file in the folder is unreadable."""
    config = config or GenerateConfig()
    layout = recognise(session.inputs, session.outputs, config)
    hf_config = read_json(folder / "config.json")
    generation_config = read_json(folder / "generation_config.json")
    if config.eos is not None:
        eos = frozenset(config.eos)
    else:
        eos = _eos_of(generation_config) or _eos_of(hf_config)
    context = config.context or context_of(hf_config)
    logits = next(spec for spec in session.outputs if spec.name == layout.logits)
    vocab = logits.shape[-1] if logits.shape and isinstance(logits.shape[-1], int) else None
    tokenizer = open_tokenizer(folder)
    on_device = isinstance(session, DeviceBinding) and session.keeps_on_device
    device_cache = tuple(slot.output for slot in layout.cache) if on_device else ()
    chat = open_chat_template(folder) if tokenizer is not None else None
    return Generation(
        layout, eos, context, config.max_new_tokens, tokenizer, vocab, device_cache, chat
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
    cache = tuple(_cache_slot(spec, outs) for spec in inputs if PAST_INPUT.match(spec.name))
    known = {input_ids, mask, positions, branch, *(slot.input for slot in cache)}
    unknown = [name for name in ins if name not in known]
    if unknown:
        raise ModelLoadError(
            f"generate: input(s) {', '.join(unknown[:5])} are not a decoder's (input_ids, "
            "attention_mask, position_ids, past_key_values.N.key/value, use_cache_branch)"
        )
    return DecoderLayout(input_ids, logits, mask, positions, branch, cache, ints)


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
    match = PAST_INPUT.match(spec.name)
    assert match is not None
    output = f"present.{match.group(1)}.{match.group(2)}"
    if output not in outputs:
        raise ModelLoadError(f"generate: input '{spec.name}' has no output '{output}'")
    fixed = tuple(d if isinstance(d, int) else None for d in spec.shape)
    past = past_axis([d is None for d in fixed])
    if not fixed or fixed[0] is not None or past is None:
        raise ModelLoadError(
            f"generate: cache input '{spec.name}' {spec.describe()} is not [batch, ..., past, "
            "...] with every other axis fixed"
        )
    return CacheSlot(spec.name, output, np.dtype(spec.dtype), fixed, past)


def past_axis(dynamic: Sequence[bool]) -> int | None:
    """A cache tensor's past axis, given which of its axes are dynamic: the one dynamic axis
    after the batch axis (0), None unless there is exactly one."""
    found = [axis for axis, flag in enumerate(dynamic) if flag and axis > 0]
    return found[0] if len(found) == 1 else None


def context_in(folder: Path) -> int | None:
    """The context length `config.json` in `folder` gives, if it is there and says one
    (ModelLoadError where it cannot be read); the TensorRT builder's decoder profile uses it."""
    return context_of(read_json(folder / "config.json"))


def _eos_of(data: dict[str, Any]) -> frozenset[int]:
    value = data.get("eos_token_id")
    values = value if isinstance(value, list) else [value]
    return frozenset(v for v in map(whole_number, values) if v is not None)
