"""Per-request generation settings, validated on construction so bad values fail with a message
that names the field (the HTTP layer turns these into 400s)."""

from __future__ import annotations

import json
import math

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

MAX_STOP_STRINGS = 32
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 1024  # entries; OpenAI's bound on each value is +-100
CONSTRAINTS = ("regex", "json_schema", "ebnf", "structural_tag")
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
    # constrained decoding, at most one (engines.grammar): the output matches a regular expression, a
    # JSON schema (text), an EBNF grammar (xgrammar's dialect) or a structural tag (JSON text)
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    # token id -> a bias added to its logit before sampling (OpenAI's logit_bias; -100 bans a token)
    logit_bias: dict[int, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)

    @field_validator(*CONSTRAINTS, mode="before")
    @classmethod
    def _constraint_text(cls, v):
        if v is None or v == "":  # SGLang's clients send every field, unset ones as null
            return None
        if isinstance(v, dict):  # a schema or a structural tag given as an object, not as JSON text
            return json.dumps(v)
        return v

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias_keys(cls, v):
        if isinstance(v, dict):  # JSON object keys are strings: "50256" is token 50256
            return {int(k) if isinstance(k, str) and k.strip().lstrip("-").isdigit() else k: x for k, x in v.items()}
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_values(cls, v):
        if v:
            if any(not (isinstance(x, (int, float)) and math.isfinite(x) and -100 <= x <= 100) for x in v.values()):
                raise ValueError("logit_bias values must lie in [-100, 100]")
            if any(not 0 <= t < MAX_COUNT for t in v):
                raise ValueError("logit_bias keys must be token ids (0 <= id < vocabulary size)")
        return v or None

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
        given = [(kind, getattr(self, kind)) for kind in CONSTRAINTS if getattr(self, kind) is not None]
        if len(given) > 1:
            raise ValueError(f"at most one of {', '.join(CONSTRAINTS)} may be given, got {' and '.join(k for k, _ in given)}")
        return self

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(kind, text) of the grammar the output must follow, or None (asked for every request of
        every step: plain attribute reads, ~0.2 us when there is none)."""
        if self.regex is not None:
            return "regex", self.regex
        if self.json_schema is not None:
            return "json_schema", self.json_schema
        if self.ebnf is not None:
            return "ebnf", self.ebnf
        if self.structural_tag is not None:
            return "structural_tag", self.structural_tag
        return None

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
        bad = [t for t in self.logit_bias or () if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"logit_bias keys {bad[:3]} are outside the vocabulary (size {vocab_size})")


def validation_message(exc: ValidationError) -> str:
    """One line naming each bad field: 'temperature: Input should be greater than or equal to 0'."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "sampling_params"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)
