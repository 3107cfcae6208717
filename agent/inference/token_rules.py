"""What a generate model's config imposes on its next token, as `generate`'s logits
processors impose it: a forced token (`ForcedBOSTokenLogitsProcessor`,
`ForcedEOSTokenLogitsProcessor`) and tokens out of reach (`SuppressTokensLogitsProcessor`,
`SuppressTokensAtBeginLogitsProcessor`). The values are the version's
(`agent.models.decoder_layout.Generation`); the choice among the rest is the sampler's.

Imports only `agent.models.decoder_layout`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from agent.models.decoder_layout import Generation

__all__ = ["allowed", "forced"]


def forced(setup: Generation, made: int, max_new_tokens: int) -> int | None:
    """The token the config forces after `made` new tokens (`forced_bos_token_id` first,
    `forced_eos_token_id` last), or None."""
    if not made and setup.forced_bos is not None:
        return setup.forced_bos
    if made == max_new_tokens - 1 and setup.forced_eos is not None:
        return setup.forced_eos
    return None


def allowed(
    setup: Generation, made: int, one_token_start: bool, logits: np.ndarray[Any, Any]
) -> np.ndarray[Any, Any]:
    """The row of `logits` with the tokens the config suppresses after `made` new tokens at
    minus infinity (a copy; the row itself where none is): `suppress` at every step,
    `begin_suppress` at the first new token, or the second where the config forces the
    first after a one-token start (`one_token_start`), as `generate` counts it."""
    banned = setup.suppress
    begin = 1 if setup.forced_bos is not None and one_token_start else 0
    if setup.begin_suppress and made == begin:
        banned = banned + setup.begin_suppress
    if not banned:
        return logits
    row: np.ndarray[Any, Any] = logits.copy()
    row[list(banned)] = -np.inf
    return row
