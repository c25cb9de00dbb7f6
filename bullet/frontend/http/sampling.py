"""Client sampling fields → SamplingParams, with a 400 that names the bad field.

SGLang's clients send every field they know, unset ones as null or at their default. The fields we
do not implement (`fields.SAMPLING`'s REFUSED ones: custom logit processors, no_stop_trim, ...) are
accepted at those values and refused by name otherwise — never silently ignored, since they would
change the output. Constrained decoding (regex, json_schema, ebnf, structural_tag: at most one) is checked here
too: a grammar xgrammar cannot parse is a 400 that names the field and gives xgrammar's message."""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import ValidationError

from bullet.frontend.http.errors import APIError
from bullet.frontend.http.fields import Kind, names, refuse
from bullet.frontend.http.generation import require_tokenizer
from engines.grammar import GrammarError, check, checked
from engines.sampling_params import CONSTRAINTS, SamplingParams, validation_message

CONSTRAINED = CONSTRAINTS
REFUSED_SAMPLING = frozenset(names("sampling_params", Kind.REFUSED))  # read, refused or dropped
MAX_N = 8


def build_sampling_params(fields: dict[str, Any] | None, *, where: str = "sampling_params",
                          **overrides: Any) -> SamplingParams:
    if fields is None:
        fields = {}
    if not isinstance(fields, dict):
        raise APIError(f"{where} must be a JSON object")
    clash = sorted(k for k in overrides if k in fields)
    if clash:  # these are the request's (return_logprob, ...): a value here would be overruled unseen
        raise APIError(f"{where}.{clash[0]}: not a sampling parameter here; it is set by the request's own "
                       "fields (return_logprob, top_logprobs_num, logprob_start_len)", param=clash[0])
    fields = {**fields, **overrides}
    refuse(fields, "sampling_params", f"{where}.")
    fields = {k: v for k, v in fields.items() if k not in REFUSED_SAMPLING}
    for key in CONSTRAINED:
        value = fields.get(key)
        if value is not None and not isinstance(value, str) and not (isinstance(value, dict) and key in (
                "json_schema", "structural_tag")):
            raise APIError(f"{where}.{key} must be a string" + (" or a JSON object" if key in (
                "json_schema", "structural_tag") else ""), param=key)
    given = [key for key in CONSTRAINED if fields.get(key) not in (None, "")]
    if len(given) > 1:
        raise APIError(f"{where}: give at most one of {', '.join(CONSTRAINED)}; got {' and '.join(given)}",
                       param=given[-1])
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


async def check_constraint(rt, params: SamplingParams, where: str = "sampling_params",
                           field: str | None = None) -> None:
    """400 for a grammar that cannot be used: on a server without a tokenizer (the vocabulary is what
    a grammar is compiled against), or one xgrammar cannot parse (its message, naming the field).
    A grammar seen before is answered from a cache; a new one is parsed in a thread (xgrammar's
    first import takes a second, and a large schema takes a while to convert)."""
    if params.constraint is None:
        return
    kind, text = params.constraint
    name = field or f"{where}.{kind}"
    require_tokenizer(rt, f"a grammar is compiled against the model's vocabulary; leave {name} unset", field or kind)
    try:
        if checked(kind, text):
            check(kind, text)
        else:
            await asyncio.to_thread(check, kind, text)
    except GrammarError as exc:
        what = {"regex": "regular expression", "json_schema": "JSON schema", "ebnf": "EBNF grammar",
                "structural_tag": "structural tag"}[kind]
        raise APIError(f"{name}: invalid {what}: {exc}", param=field or kind) from None


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
