"""A minimal OpenAI-style HTTP endpoint over one local engine, for development.

``fairserve up`` serves this until the Ray Serve cluster (router, tenant queues, replicas)
takes its place: no tenants, no API keys, no queues — one engine in one process. It speaks
enough of OpenAI's API for the ``openai`` SDK and curl: ``/v1/models``,
``/v1/completions`` and ``/v1/chat/completions``, streamed (SSE) or not.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from replicas.engine.async_engine import TorchEngine
from replicas.engine.errors import InvalidRequestError
from replicas.engine.interface import Chunk, GenerateRequest
from replicas.engine.sampling_params import SamplingParams

SAMPLING_FIELDS = {"max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop", "n",
                   "stream", "model", "user", "stream_options"}
DEFAULT_MAX_TOKENS = 256


def build_app(engine: TorchEngine, model_name: str) -> FastAPI:
    app = FastAPI(title="fairserve (local engine)")

    @app.exception_handler(InvalidRequestError)
    async def _invalid(_: Request, exc: InvalidRequestError) -> JSONResponse:
        body = {"error": {"message": exc.message, "type": "invalid_request_error", "param": exc.param, "code": None}}
        return JSONResponse(body, status_code=400)

    @app.get("/health")
    async def health() -> dict:
        await engine.check_health()
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "fairserve"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _json_object(request)
        _reject_unknown(body, {"prompt"})
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise InvalidRequestError("prompt must be a string", "prompt")
        req = GenerateRequest(_new_id("cmpl"), _sampling(body), prompt=prompt)
        return await _respond(engine, req, body, model_name, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await _json_object(request)
        _reject_unknown(body, {"messages"})
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages must be a non-empty list", "messages")
        req = GenerateRequest(_new_id("chatcmpl"), _sampling(body), messages=tuple(messages))
        return await _respond(engine, req, body, model_name, chat=True)

    return app


def _reject_unknown(body: dict, extra: set[str]) -> None:
    unknown = sorted(set(body) - SAMPLING_FIELDS - extra)
    if unknown:
        raise InvalidRequestError(f"unsupported fields: {', '.join(unknown)}", unknown[0])
    if body.get("n", 1) != 1:
        raise InvalidRequestError("only n=1 is supported", "n")


async def _json_object(request: Request) -> dict:
    try:
        body = await request.json()
    except ValueError as exc:
        raise InvalidRequestError(f"the body is not valid JSON: {exc}", None) from exc
    if not isinstance(body, dict):
        raise InvalidRequestError("the body must be a JSON object", None)
    return body


def _sampling(body: dict) -> SamplingParams:
    stop = body.get("stop") or ()
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    return SamplingParams(
        max_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
        temperature=body.get("temperature", 1.0),
        top_p=body.get("top_p", 1.0),
        seed=body.get("seed"),
        stop=(stop,) if isinstance(stop, str) else tuple(stop),
    )


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def _respond(engine: TorchEngine, req: GenerateRequest, body: dict, model: str, chat: bool):
    stream = engine.generate(req)
    first = await stream.__anext__()  # raises InvalidRequestError before the response starts
    if body.get("stream"):
        return StreamingResponse(_sse(first, stream, req.request_id, model, chat), media_type="text/event-stream")
    chunks = [first] + [c async for c in stream]
    final = chunks[-1]
    assert final.finish_reason is not None, "a stream ends with its final chunk"
    text = "".join(c.text for c in chunks)
    choice: dict[str, object] = {"index": 0, "finish_reason": final.finish_reason.value}
    choice |= {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
    return {
        "id": req.request_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": _usage(final),
    }


async def _sse(first: Chunk, rest: AsyncGenerator[Chunk, None], rid: str, model: str, chat: bool):
    kind = "chat.completion.chunk" if chat else "text_completion"

    def event(chunk: Chunk, role: bool = False) -> str:
        finish = chunk.finish_reason.value if chunk.finish_reason else None
        if chat:
            delta = ({"role": "assistant"} if role else {}) | ({"content": chunk.text} if chunk.text or role else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": chunk.text, "finish_reason": finish}
        payload = {"id": rid, "object": kind, "created": int(time.time()), "model": model, "choices": [choice]}
        return f"data: {json.dumps(payload)}\n\n"

    try:
        yield event(first, role=True)
        async for chunk in rest:
            yield event(chunk)
        yield "data: [DONE]\n\n"
    finally:
        await rest.aclose()  # a client that hung up aborts its request and frees its blocks


def _usage(final: Chunk) -> dict:
    u = final.usage
    assert u is not None, "the final chunk carries usage"
    return {
        "prompt_tokens": u.num_prompt_tokens,
        "completion_tokens": u.num_output_tokens,
        "total_tokens": u.num_prompt_tokens + u.num_output_tokens,
        "prompt_tokens_details": {"cached_tokens": u.num_cached_tokens},
    }
