"""The `[generate]` table of a model's config.toml (kept apart from
`agent.models.model_config`, which imports it).

A `mode = "generate"` model is recognised from its signature alone
(`agent.models.decoder_layout`); `[generate]` overrides what cannot be read from it: the
tensor names, the eos token ids (else `generation_config.json` / `config.json` in the version
folder), the context length (else `config.json`), the most new tokens a request may ask, and
the size of the prefix cache (`agent.models.prefix_cache`), and how many tokens prompt lookup
guesses (`agent.inference.prompt_lookup`).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["MAX_LOOKUP", "MAX_NEW_TOKENS", "GenerateConfig"]

MAX_NEW_TOKENS = 1 << 20  # the largest cap a config may set
MAX_LOOKUP = 32  # the most tokens prompt lookup guesses a run


class GenerateConfig(BaseModel):
    """`[generate]`: overrides of what the decoder's signature and files say."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    input_ids: str | None = Field(default=None, min_length=1)
    attention_mask: str | None = Field(default=None, min_length=1)
    position_ids: str | None = Field(default=None, min_length=1)
    logits: str | None = Field(default=None, min_length=1)
    eos: list[int] | None = None  # token ids that end a generation
    context: int | None = Field(default=None, ge=1)  # prompt + new tokens, at most
    max_new_tokens: int = Field(default=256, ge=1, le=MAX_NEW_TOKENS)  # cap of params'
    # Recent generations' caches kept for prompts that begin the same way (0: off; a decoder
    # alone on the CPU: `agent.models.prefix_cache`).
    prefix_cache_mb: int = Field(default=0, ge=0, le=1 << 20)
    # Tokens guessed from the text so far and checked in one run (0: off; the default of
    # `params.prompt_lookup`: `agent.inference.prompt_lookup`).
    prompt_lookup: int = Field(default=0, ge=0, le=MAX_LOOKUP)

    @field_validator("eos")
    @classmethod
    def _token_ids(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and any(t < 0 for t in v):
            raise ValueError("token ids are >= 0")
        return v
