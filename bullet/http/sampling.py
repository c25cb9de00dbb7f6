"""Client sampling fields → SamplingParams, with a 400 that names the bad field.

SGLang's own frontend sends a few fields we have nothing to do with (spaces_between_special_tokens,
no_stop_trim, …): accepted and ignored. Constrained decoding (regex, json_schema, ebnf) would change
the output, so asking for it is an error rather than being silently ignored."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from bullet.http.errors import APIError
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
    n = fields.pop("n", 1)
    if n not in (None, 1):
        raise APIError(f"{where}.n: only n=1 is supported here (send one request per sample)", param="n")
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
