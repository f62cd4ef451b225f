"""OpenAI-compatible HTTP API (aiohttp): /v1/models, /v1/completions, /v1/chat/completions
(SSE streaming or one JSON answer), /health and /metrics. Errors use OpenAI's JSON shape."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.gateway.auth import check_bearer
from services.gateway.backend import Backend, ModelCard
from services.gateway.config import GatewayConfig
from services.gateway.dashboard import Dashboard
from services.gateway.errors import ErrorKind, GatewayError, quote
from services.gateway.openai_protocol import (
    SSE_DONE,
    ChoiceOutput,
    OpenAIRequest,
    full_response,
    parse_chat,
    parse_completion,
    parse_json_body,
    sse_event,
    stream_chunk,
    usage_chunk,
)
from services.gateway.schema import Event, Finish, TokenDelta, TokenLogprob, Usage, total_usage

log = structlog.get_logger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
REQUEST_ID = web.RequestKey("request_id", str)
_OPEN_PATHS = frozenset({"/health", "/metrics"})  # probes and scrapers carry no API key
# The dashboard checks admin keys itself (services/gateway/dashboard.py), not inference keys.
_DASHBOARD_PREFIX = "/dashboard"


def error_response(err: GatewayError, request_id: str | None = None) -> web.Response:
    headers = {"X-Request-Id": request_id} if request_id else {}
    headers.update(err.http_headers())
    if err.kind is ErrorKind.UNAUTHENTICATED:
        headers["WWW-Authenticate"] = "Bearer"
    return web.json_response(err.openai_body(), status=err.kind.http_status, headers=headers)


class HttpApi:
    """The aiohttp application and its site; `start()` binds and returns the port."""

    def __init__(self, backend: Backend, config: GatewayConfig) -> None:
        self.backend = backend
        self.config = config
        self._runner: web.AppRunner | None = None
        self.app = self._build_app()

    def _build_app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.config.max_body_bytes,
            middlewares=[self._errors_middleware, self._auth_middleware],
        )
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_get("/v1/models/{model:.+}", self.get_model)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        Dashboard(self.backend, self.config).add_routes(app)
        return app

    async def start(self) -> int:
        # handler_cancellation: a client that hangs up cancels its handler at once, which
        # cancels the worker call, instead of being noticed only at the next write.
        self._runner = web.AppRunner(
            self.app, handler_cancellation=True, access_log=None, shutdown_timeout=self.config.shutdown_grace_s
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.http_host, self.config.http_port)
        await site.start()
        port = int(self._runner.addresses[0][1])
        log.info("http_listening", host=self.config.http_host, port=port)
        return port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ---- middlewares -----------------------------------------------------------------------

    @web.middleware
    async def _errors_middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except GatewayError as e:
            return error_response(e, request.get(REQUEST_ID))
        except web.HTTPRequestEntityTooLarge as e:
            return error_response(_too_large(e.text or "", self.config.max_body_bytes))
        except web.HTTPException as e:
            if e.status < 400:
                raise
            kind = ErrorKind.NOT_FOUND if e.status == 404 else ErrorKind.INVALID
            err = GatewayError(kind, f"{e.reason}: {request.method} {quote(request.path)}")
            body = err.openai_body()
            return web.json_response(
                body, status=e.status, headers={k: v for k, v in e.headers.items() if k == "Allow"}
            )
        except Exception:
            log.exception("http_handler_crashed", path=request.path, request_id=request.get(REQUEST_ID))
            err = GatewayError(ErrorKind.INTERNAL, "internal error in the gateway; see its log")
            return error_response(err, request.get(REQUEST_ID))

    @web.middleware
    async def _auth_middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in _OPEN_PATHS and not request.path.startswith(_DASHBOARD_PREFIX):
            try:
                check_bearer(request.headers.get("Authorization"), self.config.api_keys, self.config.admin_api_keys)
            except GatewayError as e:
                self.backend.metrics.requests.labels("http", e.kind.metric_outcome).inc()
                raise
        return await handler(request)

    # ---- handlers --------------------------------------------------------------------------

    async def list_models(self, request: web.Request) -> web.Response:
        cards = await self.backend.list_models()
        return web.json_response({"object": "list", "data": [_model_json(c) for c in cards]})

    async def get_model(self, request: web.Request) -> web.Response:
        model = request.match_info["model"]
        for card in await self.backend.list_models():
            if card.model_id == model:
                return web.json_response(_model_json(card))
        raise GatewayError(
            ErrorKind.NOT_FOUND, f"The model {quote(model)} does not exist", param="model", code="model_not_found"
        )

    async def health(self, request: web.Request) -> web.Response:
        status = await self.backend.health()
        ok = all(v == "SERVING" for v in status.values())
        return web.json_response({"status": "ok" if ok else "unavailable", **status}, status=200 if ok else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.backend.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_completion, "cmpl-")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_chat, "chatcmpl-")

    async def _read_body(self, request: web.Request) -> bytes:
        length = request.content_length
        if length is not None and length > self.config.max_body_bytes:
            raise _too_large(f"{length} bytes", self.config.max_body_bytes)
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge as e:
            raise _too_large(e.text or "", self.config.max_body_bytes) from e

    async def _generate(
        self, request: web.Request, parse: Callable[[dict[str, Any], str], OpenAIRequest], id_prefix: str
    ) -> web.StreamResponse:
        response_id = id_prefix + uuid.uuid4().hex
        request[REQUEST_ID] = response_id
        raw = await self._read_body(request)
        try:
            oreq = parse(parse_json_body(raw), response_id)
        except GatewayError as e:
            self.backend.metrics.requests.labels("http", e.kind.metric_outcome).inc()
            raise
        created_s = int(time.time())
        events = self.backend.generate(oreq.inference)
        async with contextlib.aclosing(events):
            if oreq.stream:
                return await self._stream(request, oreq, events, response_id, created_s)
            return await self._collect(oreq, events, response_id, created_s)

    async def _collect(
        self, oreq: OpenAIRequest, events: AsyncIterator[Event], response_id: str, created_s: int
    ) -> web.Response:
        n = oreq.inference.n
        parts: list[list[str]] = [[] for _ in range(n)]
        logprobs: list[list[TokenLogprob]] = [[] for _ in range(n)]
        finishes: dict[int, Finish] = {}
        async for event in events:
            if isinstance(event, TokenDelta):
                parts[event.index].append(event.text)
                logprobs[event.index].extend(_chunk_logprobs(oreq, event) or ())
            elif isinstance(event, Finish):
                finishes[event.index] = event
                if len(finishes) == n:
                    choices = [
                        ChoiceOutput(
                            i, "".join(parts[i]), finishes[i].finish_reason, logprobs[i] if oreq.logprobs else None
                        )
                        for i in range(n)
                    ]
                    usage = total_usage([f.usage for f in finishes.values()])
                    body = full_response(oreq.kind, response_id, oreq.inference.model, created_s, choices, usage)
                    return web.json_response(body, headers={"X-Request-Id": response_id})
        raise GatewayError(
            ErrorKind.INTERNAL, f"request {response_id} ended with {len(finishes)} of {n} choices finished"
        )

    async def _stream(
        self,
        request: web.Request,
        oreq: OpenAIRequest,
        events: AsyncIterator[Event],
        response_id: str,
        created_s: int,
    ) -> web.StreamResponse:
        # The first event decides the status: until a token exists, errors are plain 4xx/5xx.
        try:
            first = await anext(events)
        except StopAsyncIteration:
            raise GatewayError(ErrorKind.INTERNAL, f"request {response_id} produced no events") from None
        resp = web.StreamResponse(headers={**_SSE_HEADERS, "X-Request-Id": response_id})
        await resp.prepare(request)
        model, kind, usage_on, n = oreq.inference.model, oreq.kind, oreq.include_usage, oreq.inference.n
        # continuous_usage_stats: each chunk carries its choice's usage so far, as vLLM does.
        prompt_tokens = first.prompt_tokens if isinstance(first, TokenDelta) else first.usage.prompt_tokens
        first_cached = first.cached_tokens if isinstance(first, TokenDelta) else first.usage.cached_tokens

        def chunk(
            index: int,
            text: str | None,
            completion_tokens: int,
            cached_tokens: int,
            finish: str | None = None,
            role: bool = False,
            logprobs: list[TokenLogprob] | None = None,
        ) -> bytes:
            so_far = Usage(prompt_tokens, completion_tokens, cached_tokens=cached_tokens)
            return sse_event(
                stream_chunk(
                    kind,
                    response_id,
                    model,
                    created_s,
                    text=text,
                    finish_reason=finish,
                    include_usage=usage_on,
                    role=role,
                    index=index,
                    logprobs=logprobs,
                    usage=so_far if oreq.continuous_usage else None,
                )
            )

        try:
            try:
                if kind == "chat":
                    for index in range(n):
                        await resp.write(chunk(index, "", 0, first_cached, role=True))
                usages: list[Usage] = []
                event: Event | None = first
                while event is not None:
                    if isinstance(event, TokenDelta):
                        logprobs = _chunk_logprobs(oreq, event)
                        if event.text or logprobs:
                            done = event.completion_tokens
                            await resp.write(
                                chunk(event.index, event.text, done, event.cached_tokens, logprobs=logprobs)
                            )
                    else:
                        text = None if kind == "chat" else ""
                        done = event.usage.completion_tokens
                        cached = event.usage.cached_tokens
                        await resp.write(chunk(event.index, text, done, cached, finish=event.finish_reason))
                        usages.append(event.usage)
                        if len(usages) == n:
                            if usage_on:
                                total = total_usage(usages)
                                await resp.write(sse_event(usage_chunk(kind, response_id, model, created_s, total)))
                            break
                    event = await anext(events, None)
            except GatewayError as e:
                # Headers are out: the failure travels in-band, then the stream ends cleanly.
                await resp.write(sse_event(e.openai_body()))
            await resp.write(SSE_DONE)
            await resp.write_eof()
        except ConnectionResetError:
            # The client hung up between writes; leaving `aclosing` cancels the worker call.
            log.info("client_disconnected", request_id=response_id)
        return resp


_SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # proxies must not hold SSE back
}


def _chunk_logprobs(oreq: OpenAIRequest, event: TokenDelta) -> list[TokenLogprob] | None:
    """The log-prob entries a delta shows: its tokens' (completions with echo: the prompt's
    first), or None when the request did not ask for log-probs."""
    if not oreq.logprobs:
        return None
    if oreq.kind == "completion":
        return [*event.prompt_logprobs, *event.logprobs]
    return list(event.logprobs)


def _too_large(detail: str, limit: int) -> GatewayError:
    got = f" ({detail.strip()})" if detail.strip() else ""
    return GatewayError(
        ErrorKind.TOO_LARGE,
        f"the request body is larger than max_body_bytes={limit}{got}",
        code="request_too_large",
    )


def _model_json(card: ModelCard) -> dict[str, Any]:
    return {
        "id": card.model_id,
        "object": "model",
        "created": card.created_unix_s,
        "owned_by": "blitzmesh",
        # vLLM's fields: `vllm bench serve` without --model reads the first model's root.
        "root": card.model_id,
        "parent": None,
        "max_model_len": card.max_context,
    }
