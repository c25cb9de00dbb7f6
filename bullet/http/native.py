"""SGLang's native endpoints: /generate (single and batch, stream and not, logprobs,
max_new_tokens 0), /model_info, /server_info (and their get_ spellings), /health,
/health_generate, /flush_cache."""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from bullet import __version__
from bullet.http.errors import APIError, stream_error_event
from bullet.http.generation import ClientGone, Update, check_fits, follow, latency, run_all, run_to_completion, submit
from bullet.http.protocol import GenerateBody, parse_body
from bullet.http.sampling import build_sampling_params
from bullet.http.streaming import DONE, EventStream, merged_updates, sse
from engines.sampling_params import SamplingParams

router = APIRouter()
MAX_TOP_LOGPROBS = 20


def _item(body: GenerateBody, name: str, i: int, default=None):
    """Field `name` for batch item i: a per-item list, or one value for every item."""
    value = getattr(body, name)
    if isinstance(value, list):
        if i >= len(value):
            raise APIError(f"{name} is a list of {len(value)} entries, but the batch has more prompts; "
                           "give one entry per prompt", param=name)
        return value[i]
    return value if value is not None else default


def _prepare(rt, body: GenerateBody) -> tuple[list[dict], bool]:
    """The list of request items and whether the input was a batch."""
    if (body.text is None) == (body.input_ids is None):
        raise APIError("give exactly one of 'text' or 'input_ids' (the prompt)", param="text")
    field = "text" if body.text is not None else "input_ids"
    if body.text is not None:
        batch = isinstance(body.text, list)
        texts = body.text if batch else [body.text]
        if any(not t for t in texts):
            raise APIError("text is empty", param="text")
        prompts = [rt.tokenizer.encode(t) for t in texts]
    else:
        batch = bool(body.input_ids) and isinstance(body.input_ids[0], list)
        prompts = body.input_ids if batch else [body.input_ids]
    if not prompts:
        raise APIError(f"{field} is an empty list: the batch has no prompt", param=field)
    items = []
    for i, ids in enumerate(prompts):
        want_lp = bool(_item(body, "return_logprob", i, False))
        start = int(_item(body, "logprob_start_len", i, -1))
        top = int(_item(body, "top_logprobs_num", i, 0) or 0)
        if want_lp and not 0 <= top <= MAX_TOP_LOGPROBS:
            raise APIError(f"top_logprobs_num must lie in 0..{MAX_TOP_LOGPROBS}", param="top_logprobs_num")
        params = build_sampling_params(
            _item(body, "sampling_params", i, {}), logprobs=want_lp, top_logprobs_num=top if want_lp else 0,
            prompt_logprobs=want_lp and start >= 0)
        check_fits(rt, ids, params, prompt_field=field)
        items.append({"ids": ids, "params": params, "rid": _item(body, "rid", i), "logprob": want_lp,
                      "start": start, "top": top})
    return items, batch


def _entries(tok, lps, ids, with_text: bool) -> list:
    return [[lp, t, tok.id_to_text(t) if with_text else None] for lp, t in zip(lps, ids)]


def _response(rt, u: Update, item: dict, with_text: bool) -> dict:
    st = u.state
    meta = {"id": st.rid, "finish_reason": st.finish_json, "prompt_tokens": len(st.prompt_ids),
            "completion_tokens": len(st.output_ids), "cached_tokens": 0}
    if st.done:
        meta["e2e_latency"] = latency(st)
    if item["logprob"]:
        tok = rt.tokenizer
        start = min(max(item["start"], 0), len(st.prompt_ids))
        prompt_lps = st.prompt_logprobs or []
        meta["input_token_logprobs"] = (_entries(tok, prompt_lps[start:], st.prompt_ids[start:], with_text)
                                        if item["start"] >= 0 else [])
        meta["output_token_logprobs"] = _entries(tok, st.output_logprobs, st.output_ids, with_text)
        if item["top"]:
            meta["input_top_logprobs"] = [None] * len(meta["input_token_logprobs"])
            meta["output_top_logprobs"] = [
                [[lp, t, tok.id_to_text(t) if with_text else None] for t, lp in (top or [])]
                for top in st.output_top_logprobs]
    return {"text": u.text, "output_ids": list(st.output_ids), "meta_info": meta}


def _server_failure(u: Update) -> str | None:
    reason = u.state.finish_json or {}
    return reason.get("message") if reason.get("type") == "abort" else None


@router.post("/generate")
async def generate(request: Request):
    rt = request.app.state.runtime
    body = parse_body(await request.body(), GenerateBody)
    items, batch = _prepare(rt, body)
    states = []
    try:
        for item in items:
            states.append(await submit(rt, item["ids"], item["params"], item["rid"]))
    except APIError:
        for st in states:
            await rt.client.abort(st, "another item of the batch was rejected")
        raise
    with_text = body.return_text_in_logprobs
    if body.stream:
        return EventStream(_events(rt, items, states, batch, with_text), rt, states)
    try:
        finals = await run_all(request, rt, states)
    except ClientGone:
        return JSONResponse({"error": {"message": "client disconnected"}}, status_code=499)
    failed = [m for m in map(_server_failure, finals) if m]
    if failed:
        raise APIError(failed[0], status=503, type_="server_error")
    out = [_response(rt, u, item, with_text) for u, item in zip(finals, items)]
    return JSONResponse(out if batch else out[0])


async def _events(rt, items, states, batch: bool, with_text: bool):
    async with aclosing(merged_updates(rt, states)) as updates:
        async for i, u in updates:
            failure = _server_failure(u) if u.done else None
            if failure:
                yield sse(stream_error_event(failure, 503))
                continue
            event = _response(rt, u, items[i], with_text)
            if batch:
                event["index"] = i
            yield sse(event)
    yield DONE


def model_info(rt) -> dict:
    shared = rt.model
    return {"model_path": str(rt.args.model_path or rt.model_source), "tokenizer_path": shared.tokenizer_dir,
            "is_generation": True, "served_model_name": shared.model_name,
            "max_context_length": shared.config.max_position_embeddings, "weight_version": "default",
            "preferred_sampling_params": None}


@router.get("/model_info")
@router.get("/get_model_info")
async def get_model_info(request: Request):
    return model_info(request.app.state.runtime)


@router.get("/server_info")
@router.get("/get_server_info")
async def get_server_info(request: Request):
    rt = request.app.state.runtime
    info = rt.args.model_dump()
    info.pop("api_key", None)
    info.update(version=__version__, status=rt.status, internal_states=[rt.internal_state()])
    return info


@router.get("/health")
async def health(request: Request):
    rt = request.app.state.runtime
    if rt.healthy:
        return JSONResponse({"status": "ok"})
    return JSONResponse({"status": rt.status, "error": rt.last_failure}, status_code=503)


@router.get("/health_generate")
async def health_generate(request: Request):
    rt = request.app.state.runtime
    if not rt.healthy:
        return JSONResponse({"status": rt.status}, status_code=503)
    try:
        state = await submit(rt, [rt.model.config.bos_token_id or 1], SamplingParams(max_new_tokens=1, temperature=0))
        final = await asyncio.wait_for(run_to_completion(request, follow(rt, state)), timeout=60)
    except (APIError, asyncio.TimeoutError, ClientGone) as exc:
        return JSONResponse({"status": "unhealthy", "error": str(exc) or type(exc).__name__}, status_code=503)
    if _server_failure(final):
        return JSONResponse({"status": "unhealthy", "error": _server_failure(final)}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request):
    # No prefix cache is kept: every request's pages are freed when it finishes.
    return JSONResponse({"message": "Cache flushed.", "timestamp": time.time()})
