"""A version's Hugging Face `tokenizer.json`, through the `tokenizers` library.

`tokenizers` is an optional extra (`pip install edge-stream-agent[text]`): it is imported only
when a version folder holds a `tokenizer.json` (a generate model's, or a text model's:
`agent.models.text_inputs`), and a version that has one but no library to read it fails to
load with a line that says what to install. The library, not
a hand-written BPE: the same Rust code Hugging Face's fast tokenizers run, so prompts are cut and
tokens decoded exactly as `transformers` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from agent.models.backends.base import ModelLoadError

__all__ = [
    "TOKENIZER_FILE",
    "Encoded",
    "TextCodec",
    "TokenStream",
    "open_tokenizer",
    "tokenizers_installed",
    "too_long",
]

TOKENIZER_FILE = "tokenizer.json"
# A text longer than this many characters a token the model takes is refused before it is cut:
# tokenizing the 4 MB a request may carry takes seconds of a worker. No real text comes near
# (English runs at about 4 characters a token; WordPiece cuts a word over 100 to one [UNK]).
MAX_CHARS_PER_TOKEN = 100
MAX_TOKENIZER_BYTES = 64 * 1024 * 1024


def too_long(text: str, most_tokens: int | None) -> str | None:
    """Why `text` is refused before it is cut (more characters than `most_tokens` tokens
    can hold, at `MAX_CHARS_PER_TOKEN` each), None where it may be cut."""
    if most_tokens is None or len(text) <= most_tokens * MAX_CHARS_PER_TOKEN:
        return None
    return (
        f"is {len(text)} characters: more than {most_tokens} tokens hold (at most "
        f"{most_tokens * MAX_CHARS_PER_TOKEN}, {MAX_CHARS_PER_TOKEN} a token)"
    )


class Encoded(NamedTuple):
    """One text as the tokenizer cut it, a value a token."""

    ids: tuple[int, ...]
    type_ids: tuple[int, ...]  # BERT's segment: 0 for one text
    offsets: tuple[tuple[int, int], ...]  # characters [start, end) of the text
    special: tuple[bool, ...]  # added by the tokenizer ([CLS], [SEP], ...)


class TextCodec:
    """Text to token ids and back (special tokens skipped when decoding)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._special: frozenset[int] | None = None  # `special_ids`, read on first use

    @property
    def vocab_size(self) -> int:
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, *, special: bool = True) -> list[int]:
        """The ids of `text`; `special`: with the special tokens the tokenizer adds (none for
        a chat template's text, which holds its own)."""
        return list(self._tokenizer.encode(text, add_special_tokens=special).ids)

    def encode_text(self, text: str, pair: str | None = None) -> Encoded:
        """`text` (and its `pair`: a cross-encoder's passage, the tokenizer's pair template
        joining them) cut as the model reads it, with what each token is (its type, where it
        is in its text, whether the tokenizer added it)."""
        encoding = self._tokenizer.encode(text, pair, add_special_tokens=True)
        return Encoded(
            tuple(encoding.ids),
            tuple(encoding.type_ids),
            tuple(encoding.offsets),
            tuple(bool(flag) for flag in encoding.special_tokens_mask),
        )

    @property
    def unknown_id(self) -> int | None:
        """The id of the unknown token (`[UNK]`), None for a tokenizer without one."""
        unknown = getattr(self._tokenizer.model, "unk_token", None)
        return self.token_id(unknown) if isinstance(unknown, str) else None

    @property
    def marks_word_pieces(self) -> bool:
        """Whether a token that continues a word is marked (WordPiece's `##`: the model's
        `continuing_subword_prefix`), as `transformers` tells a word-aware tokenizer."""
        return bool(getattr(self._tokenizer.model, "continuing_subword_prefix", None))

    def token(self, token_id: int) -> str:
        """The vocabulary's token of `token_id` ("" for none)."""
        return str(self._tokenizer.id_to_token(token_id) or "")

    def joined(self, tokens: Sequence[str]) -> str:
        """Tokens joined into text by the tokenizer's decoder (transformers'
        `convert_tokens_to_string`): a WordPiece's `##` pieces glued to their word."""
        decoder = self._tokenizer.decoder
        return str(decoder.decode(list(tokens))) if decoder is not None else " ".join(tokens)

    def token_id(self, token: str) -> int | None:
        """The id of `token` in the vocabulary, None where it has none."""
        found = self._tokenizer.token_to_id(token)
        return int(found) if found is not None else None

    def special_ids(self) -> frozenset[int]:
        """The ids of the tokenizer's special added tokens (`<|endoftext|>`, `[CLS]`, ...),
        read once (a Whisper's tokenizer adds some 1,600)."""
        if self._special is None:
            added = self._tokenizer.get_added_tokens_decoder()
            self._special = frozenset(int(i) for i, token in added.items() if token.special)
        return self._special

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=True))

    def stream(self) -> TokenStream:
        """An incremental decode of tokens given one chunk at a time."""
        from tokenizers.decoders import DecodeStream

        return TokenStream(self._tokenizer, DecodeStream(skip_special_tokens=True))


class TokenStream:
    """The library's `DecodeStream`: each step decodes a few recent tokens, not all of them.

    `step` gives the text that the tokens complete, or "" while the last one ends inside a
    character (the library holds it back until the character is whole); `holding` says so.
    """

    def __init__(self, tokenizer: Any, stream: Any) -> None:
        self._tokenizer = tokenizer
        self._stream = stream
        self.holding = False  # the last token gave no text yet

    def step(self, ids: Sequence[int]) -> str:
        texts = []
        for i in ids:  # one id a step: the list form of `step` is newer than 0.21
            text = self._stream.step(self._tokenizer, int(i))
            self.holding = text is None
            if text is not None:
                texts.append(str(text))
        return "".join(texts)


def tokenizers_installed() -> bool:
    """Whether the `tokenizers` library (the `text` extra) can be imported."""
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        return False
    return True


def open_tokenizer(folder: Path) -> TextCodec | None:
    """The folder's `tokenizer.json`, or None where it has none."""
    path = folder / TOKENIZER_FILE
    if not path.is_file():
        return None
    if path.stat().st_size > MAX_TOKENIZER_BYTES:
        raise ModelLoadError(f"{TOKENIZER_FILE} is larger than {MAX_TOKENIZER_BYTES} bytes")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ModelLoadError(
            f"the version has a {TOKENIZER_FILE}: install the 'text' extra "
            "(pip install 'edge-stream-agent[text]') to serve it"
        ) from None
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as e:  # the library raises its own exception type for a bad file
        raise ModelLoadError(f"{TOKENIZER_FILE} cannot be read: {e}") from e
    # As `transformers` calls it by default: a text is never cut short or padded silently
    # (a prompt too long for the model is refused; a batch's rows are padded by the caller).
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return TextCodec(tokenizer)
