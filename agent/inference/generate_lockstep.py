"""Lock-step generation: the members of one generate run share each run of the model.

A generate model with `[batching]` gets the requests queued together as one run
(`agent.inference.runner`). Each member's prompt is run alone first (the prefills differ in
length; `agent.inference.generate`), then :class:`LockstepBatch` lines their caches up and every
later step runs all of them at once, one row each, as Hugging Face's batched `generate` does
with left padding:

* the shorter caches are padded with zeros on the left of the past axis up to the longest,
  and those positions are masked (`attention_mask` 0), so no row attends to them;
* `position_ids` are each row's own (its prompt and tokens so far), not the padded index: the
  layout must have both inputs (`DecoderLayout.batchable`), else the members interleave; a
  model whose positions are ALiBi biases (Bloom, MPT) takes none, and needs none: the biases
  of the keys a row attends to are those of its own, unpadded, sequence;
* after a step the cache is the batch's `present.*` as it is, the mask one column longer;
* a member that finishes or leaves takes its row out of every input, and the padding no row
  needs any more (the longest row left) out of the mask and the caches.

An encoder-decoder's members line up differently: each decoder starts from the same start token,
so after the first step every row's own cache holds one token and they join as they are; what
differs is the length of each prompt, so the encoders' states, the cross-attention caches and
`encoder_attention_mask` are padded on the right to the longest prompt, the padding masked. A
speech recogniser's encoder reads a fixed window: its states are all one length, unpadded
(Whisper's decoder has no `encoder_attention_mask`); its decoders' prompts may differ in length,
and members whose caches differ interleave instead (`joins`).

A small decoder's step costs little more for four rows than for one (docs/decisions/0026:
1.15 and 1.39 times on the CPU for the two fixtures), so concurrent streams gain most of
their tokens a second. What each row's token is, its sampling, stop strings and pieces, stays
the member's own (`agent.inference.generate`). Imports numpy and the layout only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from agent.models.decoder_layout import DecoderLayout

__all__ = ["LockstepBatch", "on_host"]

Arrays = dict[str, Any]  # numpy arrays, or a device session's own values for the cache


class LockstepBatch:
    """The inputs of one step for several members, a row each (`positions`: their places in
    the run, in row order)."""

    def __init__(self, layout: DecoderLayout, positions: list[int], inputs: Arrays) -> None:
        self.layout = layout
        self.positions = positions
        self.inputs = inputs

    @staticmethod
    def joins(layout: DecoderLayout, pasts: Sequence[int]) -> bool:
        """Whether rows whose caches hold `pasts` tokens can share runs: a decoder's are
        left-padded to the longest; an encoder-decoder's decoders have no padding of their
        own, so theirs must hold as many (a Whisper's prompts differ in length where one
        request names a language and another a task alone: those interleave)."""
        return layout.cross is None or len(set(pasts)) == 1

    @classmethod
    def align(cls, layout: DecoderLayout, rows: Sequence[tuple[int, Arrays, int]]) -> LockstepBatch:
        """From each member's next one-token inputs (`(position, inputs, past)`, `past` the
        tokens its cache holds): the caches left-padded to the longest, the padding masked."""
        if layout.cross is not None:
            return cls._align_encoded(layout, rows)
        assert layout.attention_mask is not None
        width = max(past for _, _, past in rows)
        mask = np.zeros((len(rows), width + 1), dtype=layout.int_dtypes[layout.attention_mask])
        for row, (_, _, past) in enumerate(rows):
            mask[row, width - past :] = 1
        pasts = [[past] for _, _, past in rows]
        inputs: Arrays = {
            layout.input_ids: np.concatenate([on_host(i[layout.input_ids]) for _, i, _ in rows]),
            layout.attention_mask: mask,
        }
        if layout.position_ids is not None:
            dtype = layout.int_dtypes[layout.position_ids]
            inputs[layout.position_ids] = np.array(pasts, dtype=dtype)
        if layout.cache_branch is not None:
            inputs[layout.cache_branch] = rows[0][1][layout.cache_branch]
        for slot in layout.cache:
            inputs[slot.input] = np.concatenate(
                [_padded(on_host(i[slot.input]), slot.past_axis, width) for _, i, _ in rows]
            )
        return cls(layout, [position for position, _, _ in rows], inputs)

    @classmethod
    def _align_encoded(
        cls, layout: DecoderLayout, rows: Sequence[tuple[int, Arrays, int]]
    ) -> LockstepBatch:
        """An encoder-decoder's rows: the decoders' caches as they are (one length), the
        encoder's side padded on the right to the longest prompt and masked."""
        cross = layout.cross
        assert cross is not None
        if not cls.joins(layout, [past for _, _, past in rows]):
            raise ValueError("an encoder-decoder's rows join with caches of one length")
        width = max(int(i[cross.states].shape[1]) for _, i, _ in rows)
        inputs: Arrays = {
            layout.input_ids: np.concatenate([on_host(i[layout.input_ids]) for _, i, _ in rows]),
            cross.states: _joined([i[cross.states] for _, i, _ in rows], 1, width),
        }
        if cross.mask is not None:
            inputs[cross.mask] = _joined([i[cross.mask] for _, i, _ in rows], 1, width)
        elif any(i[cross.states].shape[1] != width for _, i, _ in rows):
            raise ValueError("encoder states of different lengths need encoder_attention_mask")
        if layout.cache_branch is not None:
            inputs[layout.cache_branch] = rows[0][1][layout.cache_branch]
        for slot in layout.cache:
            values = [i[slot.input] for _, i, _ in rows]
            inputs[slot.input] = (
                _joined(values, slot.past_axis, width)
                if slot.fixed
                else np.concatenate([on_host(v) for v in values])
            )
        return cls(layout, [position for position, _, _ in rows], inputs)

    def advance(self, outputs: Arrays, tokens: Sequence[int]) -> None:
        """The next step's inputs after a run: the rows' new tokens, the cache from
        `present.*`, the mask one column longer, each position one further (an
        encoder-decoder: its encoder's side as it was)."""
        layout, inputs = self.layout, self.inputs
        ids = inputs[layout.input_ids]
        inputs[layout.input_ids] = np.array(tokens, dtype=ids.dtype).reshape(len(tokens), 1)
        if layout.cross is not None:
            for slot in layout.cache:
                if not slot.fixed:
                    inputs[slot.input] = outputs[slot.output]
            return
        assert layout.attention_mask is not None
        mask = inputs[layout.attention_mask]
        ones = np.ones((mask.shape[0], 1), dtype=mask.dtype)
        inputs[layout.attention_mask] = np.concatenate([mask, ones], axis=1)
        if layout.position_ids is not None:
            inputs[layout.position_ids] = inputs[layout.position_ids] + 1
        for slot in layout.cache:
            inputs[slot.input] = outputs[slot.output]

    def keep(self, positions: Sequence[int]) -> None:
        """Only the rows of `positions` (in their order) from now on."""
        if list(positions) == self.positions:
            return
        rows = [self.positions.index(p) for p in positions]
        branch = self.layout.cache_branch
        self.inputs = {
            name: value if name == branch else on_host(value)[rows]
            for name, value in self.inputs.items()
        }
        self.positions = list(positions)
        if positions:
            self._trim()

    def _trim(self) -> None:
        """Drop the padding no row needs any more (the longest row left): the leading
        cache positions masked in every row."""
        layout, inputs = self.layout, self.inputs
        if layout.attention_mask is None:  # an encoder-decoder: its padding is the encoder's
            return
        mask = inputs[layout.attention_mask]
        used = np.flatnonzero(mask.any(axis=0))
        unused = int(used[0]) if used.size else 0
        if unused == 0:
            return
        inputs[layout.attention_mask] = mask[:, unused:]
        for slot in layout.cache:
            cut = [slice(None)] * inputs[slot.input].ndim
            cut[slot.past_axis] = slice(unused, None)
            inputs[slot.input] = np.ascontiguousarray(inputs[slot.input][tuple(cut)])


def on_host(value: Any) -> np.ndarray[Any, Any]:
    """A numpy array of `value` (a device session's own value copied to the host)."""
    if isinstance(value, np.ndarray):
        return value
    host: np.ndarray[Any, Any] = value.numpy()
    return host


def _joined(values: Sequence[Any], axis: int, width: int) -> np.ndarray[Any, Any]:
    """Rows of different lengths along `axis`, each padded with zeros on the right to `width`,
    as one array (zeros: masked out by `encoder_attention_mask`)."""
    return np.concatenate([_padded(on_host(v), axis, width, left=False) for v in values])


def _padded(
    cache: np.ndarray[Any, Any], axis: int, width: int, *, left: bool = True
) -> np.ndarray[Any, Any]:
    """`cache` with zeros before (`left`) or after its entries along `axis`, `width` long."""
    missing = width - cache.shape[axis]
    pad = [
        ((missing, 0) if left else (0, missing)) if a == axis else (0, 0) for a in range(cache.ndim)
    ]
    padded: np.ndarray[Any, Any] = np.pad(cache, pad)
    return padded
