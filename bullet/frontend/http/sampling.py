"""Client sampling fields → SamplingParams, with a 400 that names the bad field.

SGLang's own frontend sends a few fields we have nothing to do with (spaces_between_special_tokens,
no_stop_trim, …): accepted and ignored. Constrained decoding (regex, json_schema, ebnf) would change
the output, so asking for it is an error rather than being silently ignored."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from bullet.frontend.http.errors import APIError
from engines.sampling_params import SamplingParams, validation_message

IGNORED = {"spaces_between_special_tokens", "no_stop_trim", "stream_interval", "custom_params", "lora_path"}
CONSTRAINED = ("regex", "json_schema", "ebnf", "structural_tag")
MAX_N = 8


def build_sampling_params(fields: dict[str, Any] | None, *, where: str = "sampling_params",
                          **overrides: Any) -> SamplingParams:
    if fields is None:
        fields = {}
    if not isinstance(fields, dict):
        raise APIError(f"{where} must be a JSON object")
    fields = {k: v for k, v in {**fields, **overrides}.items() if k not in IGNORED}
    for key in CONSTRAINED:
        if fields.pop(key, None) not in (None, "", {}):
            raise APIError(f"{where}.{key}: constrained decoding is not supported by this server", param=key)
    fields.pop("n", None)  # the number of samples is the caller's (sample_count), not the sampler's
    if fields.get("stop_token_ids") is None:
        fields.pop("stop_token_ids", None)
    try:
        # strict: "5" is not an integer and true is not a number (pydantic would quietly convert them)
        # (tiny temperatures and penalties that would overflow the logits are the sampler's to
        # handle: SamplingParams bounds them, and greedy covers temperatures below 1e-5)
        return SamplingParams.model_validate(fields, strict=True)
    except ValidationError as exc:
        raise APIError(f"invalid {where}: {validation_message(exc)}") from exc
    except TypeError as exc:
        raise APIError(f"invalid {where}: {exc}") from exc


def sample_count(n: Any, where: str = "sampling_params.n") -> int:
    """The number of samples a request asks for (SGLang's and OpenAI's `n`), 1..MAX_N."""
    if n is None:
        return 1
    if type(n) is not int or not 1 <= n <= MAX_N:  # noqa: E721 (bool is not a count)
        raise APIError(f"{where} must be an integer in 1..{MAX_N}, got {n!r}"[:200], param="n")
    return n


def per_sample(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The params of each of n samples of one prompt. They run as n requests (the prompt is
    prefilled once per sample: there is no prefix cache to share it yet). A seeded request's samples
    get seeds seed, seed+1, ...: reproducible, and n different samples rather than n copies of one."""
    if n == 1 or params.seed is None:
        return [params] * n
    return [params.model_copy(update={"seed": (params.seed + j) % 2**63}) for j in range(n)]
