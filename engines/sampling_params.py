"""Per-request generation settings, validated on construction so bad values fail with a message
that names the field (the HTTP layer turns these into 400s)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

MAX_STOP_STRINGS = 32
MAX_STOP_TOKEN_IDS = 256
MAX_COUNT = 1 << 30  # bound on every count a client sends: far above any context, far below int64
GREEDY_BELOW = 1e-5


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    max_new_tokens: int = Field(128, ge=0, le=MAX_COUNT, description="0 scores the prompt only (no token is generated)")
    min_new_tokens: int = Field(0, ge=0, le=MAX_COUNT)
    temperature: float = Field(1.0, ge=0.0, le=100.0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, le=MAX_COUNT, description="-1 or 0 = off")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, ge=0.01, le=10.0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # log-probabilities (natural log, of the model's raw distribution before temperature/top-k/top-p)
    logprobs: bool = False  # of each generated token
    prompt_logprobs: bool = False  # of each prompt token given the previous ones
    top_logprobs_num: int = Field(0, ge=0, le=20)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v):
        if v is None:
            return []
        if isinstance(v, str):
            return [v]
        return v

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v: list[str]):
        if len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not s for s in v):
            raise ValueError("stop strings must be non-empty")
        return v

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _stop_ids(cls, v):
        return [] if v is None else v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids_range(cls, v: list[int]):
        if any(not 0 <= t < MAX_COUNT for t in v):
            raise ValueError("stop_token_ids must be token ids (0 <= id < vocabulary size)")
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int):
        if v < -1:
            raise ValueError("top_k must be -1 (off), 0 (off) or a positive number of tokens")
        return v

    @model_validator(mode="after")
    def _consistent(self):
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(f"min_new_tokens ({self.min_new_tokens}) exceeds max_new_tokens ({self.max_new_tokens})")
        return self

    @property
    def greedy(self) -> bool:
        # below 1e-5 the scaled logits would overflow; SGLang treats such temperatures as greedy too
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0

    def check_vocab(self, vocab_size: int) -> None:
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids {bad[:3]} are outside the vocabulary (size {vocab_size})")


def validation_message(exc: ValidationError) -> str:
    """One line naming each bad field: 'temperature: Input should be greater than or equal to 0'."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "sampling_params"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)
