"""Prompt lookup decoding: several greedy tokens a run, where the text repeats itself.

A summary, an extraction or an edit copies runs of its prompt, and a decoder's own output
repeats itself too. `params.prompt_lookup = k` (or `[generate] prompt_lookup`) has each step
look up the sequence's last two tokens (else its last one) where they stood before in the
prompt and the tokens so far, and guess the `k` tokens that followed them there. One run of
the model then reads the step's token and the guesses together; the guesses are kept for as
long as each is the token greedy search picks from the row before it, and the row after the
last one kept gives one more token. So a run gives 1 to k + 1 tokens, and they are the tokens
one run a token gives (Hugging Face's `prompt_lookup_num_tokens`, whose candidate search this
follows with the latest match first). The cache the run returned holds the guesses that were
not kept at its end: it is cut to the tokens kept.

Greedy only (a sampled token is not checked this way), one sequence (not beams), a decoder
alone whose cache can be cut (as numpy arrays on the host; on ONNX Runtime's GPU provider by
a Slice run on the device, `agent.models.backends.ort_cut`), in a run of its own (not in
lock-step). The strategy (`agent.inference.generate`) runs the checks; this module finds the
guesses and cuts the cache.

Imports only `agent.models` (the layout, the prefix cache's cut, the backends' protocols).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from agent.models.backends.base import DeviceCut
from agent.models.decoder_layout import DecoderLayout
from agent.models.prefix_cache import cut_past

__all__ = ["Lookup", "cut_cache"]

MAX_PAUSE = 16  # the most runs a request waits to guess again after guesses that missed


class Lookup:
    """One request's guessing: where each pair of tokens and each token stood last in the
    prompt and the tokens so far (kept as the tokens come: a look-up is two dict reads), how
    many tokens the next run guesses, and how long to wait after runs whose guesses missed."""

    def __init__(self, most: int, prompt: Sequence[int]) -> None:
        self.most = most
        self.size = most  # the next run's guesses, at most
        self._backoff = 0  # runs to wait after the next miss
        self._pause = 0  # runs still to wait before guessing again
        self._sequence: list[int] = []
        self._pairs: dict[tuple[int, int], int] = {}  # a pair -> where its second stood last
        self._ones: dict[int, int] = {}  # a token -> where it stood last
        self.push(prompt)

    def push(self, tokens: Sequence[int]) -> None:
        """The sequence goes on with `tokens`."""
        for token in tokens:
            self._note(len(self._sequence) - 1)  # the ending before it can now be found
            self._sequence.append(int(token))

    def guesses(self, room: int) -> list[int]:
        """Up to `room` tokens that followed the latest earlier place where the sequence's
        last two tokens (else its last one) stood; [] where they stood nowhere before, or
        while waiting after a miss."""
        if self._pause:
            self._pause -= 1
            return []
        most, seq = min(self.size, room), self._sequence
        if most < 1 or len(seq) < 2:
            return []
        end = self._pairs.get((seq[-2], seq[-1]))
        if end is None:
            end = self._ones.get(seq[-1])
        return [] if end is None else seq[end + 1 : end + 1 + most]

    def checked(self, guessed: int, right: int) -> None:
        """A run read `guessed` guesses, the first `right` of them right: twice as many next
        time after all right (up to `most`), as many as were right after a miss, and after a
        run of none right a wait of 1, 2, 4 ... MAX_PAUSE runs before the next guess."""
        if right == guessed:
            self.size, self._backoff = min(self.most, 2 * guessed), 0
            return
        self.size = max(1, right)
        if right:
            self._backoff = 0
            return
        self._backoff = min(max(1, 2 * self._backoff), MAX_PAUSE)
        self._pause = self._backoff

    def _note(self, end: int) -> None:
        """The pair and the token that end at `end` may be found from now on."""
        seq = self._sequence
        if end >= 0:
            self._ones[seq[end]] = end
        if end >= 1:
            self._pairs[(seq[end - 1], seq[end])] = end


def cut_cache(
    layout: DecoderLayout, outputs: Mapping[str, Any], tokens: int, device: DeviceCut | None
) -> dict[str, Any]:
    """`outputs` with every cache output cut to its first `tokens` along its past axis
    (`prefix_cache.cut_past`: on the device for a value kept there, by `device`)."""
    cut = dict(outputs)
    for slot in layout.cache:
        cut[slot.output] = cut_past(outputs[slot.output], slot.past_axis, tokens, device)
    return cut
