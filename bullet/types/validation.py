"""Whether a tokenized request can be served at all, checked where it enters (the HTTP frontend,
the offline API) so that a worker never receives one it would have to reject."""

from __future__ import annotations

from engines.sampling_params import SamplingParams


class RequestError(ValueError):
    """A request that cannot be served as given (the message says why)."""


def validate_prompt(prompt_ids: list[int], params: SamplingParams, vocab_size: int, max_context: int,
                    pool_tokens: int) -> None:
    if not prompt_ids:
        raise RequestError("the prompt is empty")
    if any(not 0 <= t < vocab_size for t in prompt_ids):
        raise RequestError(f"prompt token ids must lie in [0, {vocab_size})")
    if len(prompt_ids) >= max_context:
        raise RequestError(f"the prompt has {len(prompt_ids)} tokens; the model's context length is {max_context}")
    if len(prompt_ids) + 1 > pool_tokens:
        raise RequestError(f"the prompt has {len(prompt_ids)} tokens; the KV pool holds {pool_tokens}")
    # a request stops at the model's context: beyond that its budget never needs KV
    needed = min(len(prompt_ids) + params.max_new_tokens, max_context)
    if needed > pool_tokens:
        raise RequestError(f"the prompt ({len(prompt_ids)} tokens) and max_new_tokens ({params.max_new_tokens}) need "
                           f"{needed} tokens of KV cache, but the pool holds {pool_tokens}: it could never run")
    try:
        params.check_vocab(vocab_size)
    except ValueError as exc:
        raise RequestError(str(exc)) from exc
