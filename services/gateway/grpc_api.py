"""gRPC front end of the gateway for the SDK: `Inference` (streaming and unary generation on the
shared backend) and `Admin` (models from the parameter manager; cluster, scaling and policy
forwarded to the global manager). Failures are gRPC status codes with a readable details string.

`Admin.ListModels` is an inference call (it is GET /v1/models); every other Admin call changes or
reveals the cluster and passes `check_admin`: an admin key, or a loopback peer while none is set."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, NoReturn, TypeVar

import grpc
import structlog

from blitzmesh import convert
from blitzmesh import types as sdk
from blitzmesh.convert import finish_reason_to_proto
from blitzmesh.v1 import admin_pb2, admin_pb2_grpc, common_pb2, inference_pb2, inference_pb2_grpc
from services.gateway.auth import check_admin, check_bearer
from services.gateway.backend import Backend
from services.gateway.config import GatewayConfig
from services.gateway.errors import GatewayError, invalid
from services.gateway.schema import (
    SLO,
    ChatMessage,
    Finish,
    InferenceRequest,
    TokenDelta,
    TokenLogprob,
    Usage,
    total_usage,
    validate_request,
)

log = structlog.get_logger(__name__)

T = TypeVar("T")


def request_from_proto(msg: inference_pb2.GenerateRequest) -> InferenceRequest:
    """Proto -> internal request, validated; raises GatewayError(INVALID) quoting the value."""
    try:
        sampling = convert.sampling_from_proto(msg.sampling)  # the SDK's converter: one per wire type
    except ValueError as e:
        raise invalid(str(e)) from e
    ttft_s, tpot_s = convert.request_slo_from_proto(msg.slo)
    req = InferenceRequest(
        model=msg.model,
        request_id=msg.request_id or "gen-" + uuid.uuid4().hex,
        sampling=sampling,
        # proto3 cannot tell "" from unset; an empty prompt counts as not given.
        prompt=msg.prompt or None,
        messages=tuple(ChatMessage(m.role, m.content) for m in msg.messages),
        prompt_token_ids=tuple(msg.prompt_token_ids),
        return_token_ids=msg.return_token_ids,
        api="grpc",
        n=msg.n or 1,  # proto3: 0 is "unset"
        echo=msg.echo,
        slo=SLO(ttft_s, tpot_s),  # validate_request checks the values
    )
    validate_request(req)
    return req


def logprobs_to_proto(entries: Sequence[TokenLogprob]) -> list[common_pb2.TokenLogprob]:
    """The gateway's log-prob entries on the public wire: token ids and log-probs (no text)."""
    return [
        convert.token_logprob_to_proto(
            sdk.TokenLogprob(e.token_id, e.logprob, tuple(sdk.TopLogprob(t.token_id, t.logprob) for t in e.top))
        )
        for e in entries
    ]


def usage_to_proto(usage: Usage) -> common_pb2.Usage:
    msg = common_pb2.Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
        cached_tokens=usage.cached_tokens,
    )
    if usage.slo is not None:
        msg.slo.CopyFrom(convert.slo_attainment_to_proto(usage.slo))
    return msg


async def _abort(context: grpc.aio.ServicerContext, err: GatewayError) -> NoReturn:
    await context.abort(err.kind.grpc_code, err.message, trailing_metadata=err.grpc_trailing_metadata())
    raise AssertionError("context.abort returned")  # it always raises


def _authorization(context: grpc.aio.ServicerContext) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key.lower() == "authorization":
            return value if isinstance(value, str) else value.decode("latin-1")
    return None


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    def __init__(self, backend: Backend, config: GatewayConfig) -> None:
        self.backend = backend
        self.config = config

    async def _admit(
        self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> InferenceRequest:
        try:
            check_bearer(_authorization(context), self.config.api_keys, self.config.admin_api_keys)
            return request_from_proto(request)
        except GatewayError as e:
            self.backend.metrics.requests.labels("grpc", e.kind.metric_outcome).inc()
            await _abort(context, e)

    async def Generate(
        self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        req = await self._admit(request, context)
        events = self.backend.generate(req)
        async with contextlib.aclosing(events):
            try:
                async for event in events:
                    if isinstance(event, TokenDelta):
                        yield inference_pb2.GenerateResponse(
                            request_id=req.request_id,
                            text=event.text,
                            token_ids=event.token_ids if req.return_token_ids else (),
                            instance_id=event.instance_id,
                            index=event.index,
                            logprobs=logprobs_to_proto(event.logprobs),
                            prompt_logprobs=logprobs_to_proto(event.prompt_logprobs),
                        )
                    elif isinstance(event, Finish):
                        yield inference_pb2.GenerateResponse(
                            request_id=req.request_id,
                            finish_reason=finish_reason_to_proto(event.finish_reason),
                            usage=usage_to_proto(event.usage),
                            instance_id=event.instance_id,
                            index=event.index,
                        )
            except GatewayError as e:
                await _abort(context, e)

    async def Complete(
        self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.CompleteResponse:
        req = await self._admit(request, context)
        choices = [inference_pb2.Choice(index=i) for i in range(req.n)]
        prompt_logprobs: list[common_pb2.TokenLogprob] = []
        usages: list[Usage] = []
        events = self.backend.generate(req)
        async with contextlib.aclosing(events):
            try:
                async for event in events:
                    choice = choices[event.index]
                    if isinstance(event, TokenDelta):
                        choice.text += event.text
                        if req.return_token_ids:
                            choice.token_ids.extend(event.token_ids)
                        choice.logprobs.extend(logprobs_to_proto(event.logprobs))
                        if event.index == 0 and event.prompt_logprobs:
                            prompt_logprobs = logprobs_to_proto(event.prompt_logprobs)
                    elif isinstance(event, Finish):
                        choice.finish_reason = finish_reason_to_proto(event.finish_reason)
                        choice.instance_id = event.instance_id
                        usages.append(event.usage)
                        if len(usages) == req.n:
                            first = choices[0]
                            return inference_pb2.CompleteResponse(
                                request_id=req.request_id,
                                text=first.text,
                                token_ids=first.token_ids,
                                finish_reason=first.finish_reason,
                                usage=usage_to_proto(total_usage(usages)),
                                instance_id=first.instance_id,
                                choices=choices,
                                prompt_logprobs=prompt_logprobs,
                            )
            except GatewayError as e:
                await _abort(context, e)
        await context.abort(grpc.StatusCode.INTERNAL, f"request {req.request_id} ended without a finish event")
        raise AssertionError("unreachable")


class AdminServicer(admin_pb2_grpc.AdminServicer):
    """Thin forwarder: the managers own the answers; upstream status codes pass through."""

    def __init__(self, backend: Backend, config: GatewayConfig) -> None:
        self.backend = backend
        self.config = config

    async def _auth_inference(self, context: grpc.aio.ServicerContext) -> None:
        try:
            check_bearer(_authorization(context), self.config.api_keys, self.config.admin_api_keys)
        except GatewayError as e:
            await _abort(context, e)

    async def _auth_admin(self, method: str, context: grpc.aio.ServicerContext) -> None:
        try:
            check_admin(
                _authorization(context),
                context.peer(),
                admin_api_keys=self.config.admin_api_keys,
                api_keys=self.config.api_keys,
                allow_loopback=self.config.admin_allow_loopback,
            )
        except GatewayError as e:
            log.warning("admin_call_refused", method=method, peer=context.peer(), code=e.kind.grpc_code.name)
            await _abort(context, e)

    async def _forward(
        self,
        target: str,
        method: Callable[..., Awaitable[T]],
        request: Any,
        context: grpc.aio.ServicerContext,
        timeout_s: float | None,
    ) -> T:
        # Keep the caller's own deadline when it set one (Scale with wait=true can be long).
        remaining_s = context.time_remaining()
        if remaining_s is not None and (timeout_s is None or remaining_s < timeout_s):
            timeout_s = remaining_s
        try:
            return await method(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            await context.abort(e.code(), f"{target}: {e.details()}")
            raise AssertionError("unreachable") from e

    async def ListModels(
        self, request: admin_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ListModelsResponse:
        await self._auth_inference(context)
        assert self.backend.pm is not None
        return await self._forward(
            "param manager", self.backend.pm.ListModels, request, context, self.config.rpc_timeout_s
        )

    async def GetCluster(
        self, request: admin_pb2.GetClusterRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ClusterState:
        await self._auth_admin("GetCluster", context)
        assert self.backend.gm is not None
        return await self._forward(
            "global manager", self.backend.gm.GetCluster, request, context, self.config.rpc_timeout_s
        )

    async def Scale(
        self, request: admin_pb2.ScaleRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ScaleResponse:
        await self._auth_admin("Scale", context)
        assert self.backend.gm is not None
        timeout_s = None if request.wait else self.config.rpc_timeout_s
        return await self._forward("global manager", self.backend.gm.Scale, request, context, timeout_s)

    async def SetPolicy(
        self, request: admin_pb2.SetPolicyRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.SetPolicyResponse:
        await self._auth_admin("SetPolicy", context)
        assert self.backend.gm is not None
        return await self._forward(
            "global manager", self.backend.gm.SetPolicy, request, context, self.config.rpc_timeout_s
        )

    async def WatchEvents(
        self, request: admin_pb2.WatchEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[admin_pb2.ClusterEvent]:
        await self._auth_admin("WatchEvents", context)
        assert self.backend.gm is not None
        call = self.backend.gm.WatchEvents(request)
        try:
            async for event in call:
                yield event
        except grpc.aio.AioRpcError as e:
            await context.abort(e.code(), f"global manager: {e.details()}")
        finally:
            # The SDK client went away (or we failed): stop the upstream watch too.
            call.cancel()
