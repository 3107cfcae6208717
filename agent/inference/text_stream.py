"""A generation's text, streamed: each chunk's new text from its tokens alone.

Tokens do not map to whole characters (a byte-level BPE cuts a multi-byte character between
tokens), so the text comes from the `tokenizers` library's incremental decoder
(`agent.models.tokenizer.TokenStream`, its `DecodeStream`): each step decodes a short window
of recent tokens and gives the text they complete, holding back tokens that end inside a
character. A step's cost does not grow with the length of the generation (decoding all tokens
each time would be quadratic in it). On top of that, a tail that could be the start of a stop
string is held back, and a stop string cuts the text where it starts (it is not sent).

What every chunk sent, concatenated, equals the tokenizer's decode of all new tokens (cut before
the stop string, where one matched): at the end, tokens still held (a character never completed)
are flushed from one whole decode.
"""

from __future__ import annotations

from collections.abc import Sequence

from agent.models.tokenizer import TextCodec

__all__ = ["TextStream"]


class TextStream:
    """`push(tokens)` after each chunk's tokens gives that chunk's text; `finish()` the rest."""

    def __init__(self, codec: TextCodec, stops: Sequence[str] = ()) -> None:
        self._codec = codec
        self._decoder = codec.stream()
        self._stops = [s for s in stops if s]
        self._tokens: list[int] = []
        self._parts: list[str] = []  # what was sent, in order
        self._unsent = ""  # decoded, held back as a possible start of a stop string
        self.stopped = False  # a stop string matched: nothing more is sent

    @property
    def sent(self) -> str:
        """The text sent so far."""
        return "".join(self._parts)

    def push(self, tokens: Sequence[int]) -> str:
        """The new text that `tokens` complete (possibly empty)."""
        if self.stopped or not tokens:
            return ""
        self._tokens.extend(tokens)
        new = self._decoder.step(tokens)
        if not new:
            return ""
        if not self._stops:
            return self._send_all(new)
        self._unsent += new
        cut = self._stop_at(self._unsent)
        if cut is not None:
            self.stopped = True
            return self._send(cut)
        return self._send(self._safe_end(self._unsent))

    def finish(self) -> str:
        """What is left to send at the end of the generation."""
        if self.stopped:
            return ""
        if self._decoder.holding:  # tokens the decoder holds: their text from one whole decode
            # what the incremental decoder gave: all of it was sent or is held back
            text, decoded = self._codec.decode(self._tokens), self.sent + self._unsent
            if text.startswith(decoded):
                self._unsent += text[len(decoded) :]
        return self._send(len(self._unsent))

    def _send_all(self, new: str) -> str:
        self._parts.append(new)
        return new

    def _send(self, end: int) -> str:
        new, self._unsent = self._unsent[:end], self._unsent[end:]
        if new:
            self._parts.append(new)
        return new

    def _stop_at(self, text: str) -> int | None:
        """Where the first stop string starts in `text` (not sent yet), if one does.

        A stop string never starts in text already sent: the tail that could begin one is
        held back (`_safe_end`) until it is known not to.
        """
        found = [i for i in (text.find(s) for s in self._stops) if i >= 0]
        return min(found) if found else None

    def _safe_end(self, text: str) -> int:
        """`len(text)`, less a tail that could begin a stop string."""
        end = len(text)
        safe = end
        for stop in self._stops:
            for k in range(min(len(stop) - 1, end), 0, -1):
                if text.endswith(stop[:k]):
                    safe = min(safe, end - k)
                    break
        return safe
