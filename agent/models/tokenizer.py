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
from typing import Any

from agent.models.backends.base import ModelLoadError

__all__ = ["TOKENIZER_FILE", "TextCodec", "TokenStream", "open_tokenizer", "tokenizers_installed"]

TOKENIZER_FILE = "tokenizer.json"
MAX_TOKENIZER_BYTES = 64 * 1024 * 1024


class TextCodec:
    """Text to token ids and back (special tokens skipped when decoding)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    @property
    def vocab_size(self) -> int:
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, *, special: bool = True) -> list[int]:
        """The ids of `text`; `special`: with the special tokens the tokenizer adds (none for
        a chat template's text, which holds its own)."""
        return list(self._tokenizer.encode(text, add_special_tokens=special).ids)

    def encode_with_types(self, text: str) -> tuple[list[int], list[int]]:
        """The ids of `text` and their token type ids (BERT's segment: 0 for one text)."""
        encoding = self._tokenizer.encode(text, add_special_tokens=True)
        return list(encoding.ids), list(encoding.type_ids)

    def token_id(self, token: str) -> int | None:
        """The id of `token` in the vocabulary, None where it has none."""
        found = self._tokenizer.token_to_id(token)
        return int(found) if found is not None else None

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
