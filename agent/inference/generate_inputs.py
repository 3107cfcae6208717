"""The inputs of a generate member's first run (`agent.inference.generate`): the decoder's ids
after an empty past or after a cache, an encoder-decoder's encoder run on the prompt, a
Whisper's prompt after its language detection's run, a prompt's beginning from the version's
prefix cache (`agent.models.prefix_cache`).

Imports `modes`, `generate_ask` and the models' layout and prefix cache.
"""

from __future__ import annotations

import numpy as np

from agent.inference.generate_ask import GenerateAsk
from agent.inference.modes import Arrays, Run
from agent.models.decoder_layout import DecoderLayout
from agent.models.prefix_cache import PrefixCache

__all__ = [
    "USE_CACHE",
    "cached_prefill",
    "continued",
    "encoded",
    "prefill_inputs",
    "sequence_inputs",
]

USE_CACHE = np.ones((1,), dtype=np.bool_)  # `use_cache_branch` after the prefill


def prefill_inputs(ask: GenerateAsk) -> Arrays:
    """The decoder's first ids whole, with an empty past."""
    return sequence_inputs(ask.setup.layout, ask.decoder_ids)


def cached_prefill(ask: GenerateAsk, store: PrefixCache, prefill: Arrays) -> Arrays:
    """The first run's inputs where the prefix cache holds the prompt's beginning: the rest,
    after that cache (`prefill` where it holds none). Looked up at the run, not before: an
    earlier member of the same run may have just kept the beginning they share."""
    hit = store.longest(ask.decoder_ids)
    if hit is None:
        return prefill
    ask.cached_tokens = hit.tokens
    rest = ask.decoder_ids[hit.tokens :]
    return {**sequence_inputs(ask.setup.layout, rest, past=hit.tokens), **hit.cache}


def continued(ask: GenerateAsk, detected: Arrays, cross: Arrays) -> Arrays:
    """The first run's inputs where the language detection's run already read the prompt's
    start token: the rest of the prompt, after that run's cache. Its cross-attention cache
    joins `cross`, fed unchanged from now on (later runs return placeholders for it)."""
    layout = ask.setup.layout
    inputs = sequence_inputs(layout, ask.decoder_ids[1:], past=1)
    for slot in layout.cache:
        if slot.fixed:
            cross[slot.input] = detected[slot.output]
        else:
            inputs[slot.input] = detected[slot.output]
    return {**inputs, **cross}


def encoded(run: Run, ask: GenerateAsk) -> Arrays:
    """An encoder-decoder's decoder inputs from its encoder's run on the prompt (nothing for a
    decoder alone)."""
    encoder, cross = ask.setup.encoder, ask.setup.layout.cross
    if encoder is None or cross is None:
        return {}
    if ask.encoder_input is not None:
        encoder_inputs = {encoder.input.name: ask.encoder_input}
    else:
        encoder_inputs = encoder.inputs(ask.prompt)
    states = run.other(encoder.session, encoder_inputs)[encoder.output]
    made: Arrays = {cross.states: states}
    if cross.mask is not None and cross.mask_dtype is not None:
        made[cross.mask] = np.ones((1, states.shape[1]), dtype=cross.mask_dtype)
    return made


def sequence_inputs(layout: DecoderLayout, ids: list[int], past: int = 0) -> Arrays:
    """`ids` whole after `past` tokens: with an empty past, a prefill or every run of a
    decoder without a cache; after a past, the caller gives the cache that holds it."""
    inputs: Arrays = {layout.input_ids: np.array([ids], dtype=layout.int_dtypes[layout.input_ids])}
    if layout.attention_mask is not None:
        dtype = layout.int_dtypes[layout.attention_mask]
        inputs[layout.attention_mask] = np.ones((1, past + len(ids)), dtype=dtype)
    if layout.position_ids is not None:
        dtype = layout.int_dtypes[layout.position_ids]
        inputs[layout.position_ids] = np.arange(past, past + len(ids), dtype=dtype)[None, :]
    if layout.cache_branch is not None:
        inputs[layout.cache_branch] = USE_CACHE if past else np.zeros((1,), dtype=np.bool_)
    if not past:
        for slot in layout.cache:
            inputs[slot.input] = slot.empty(1)
    return inputs
