"""Clients of the Blitzmesh gateway: `AsyncClient` (asyncio) and `Client` (blocking).

Both speak the gateway's gRPC services `Inference` and `Admin`. `Client` runs an `AsyncClient`
on a private event loop in a background thread, so the two share every line of call logic:
deadlines, retries, error mapping and validation.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import math
import os
import random
import reprlib
import threading
import time
import uuid
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Iterator,
    Mapping,
    Sequence,
)
from typing import Any, Concatenate, ParamSpec, TypeVar

import grpc
import grpc.aio

from blitzmesh import convert
from blitzmesh._version import __version__
from blitzmesh.errors import InternalError, RequestCancelledError, from_rpc_error
from blitzmesh.types import (
    ChatMessage,
    ClusterEvent,
    ClusterState,
    Completion,
    InstanceRole,
    ModelInfo,
    PolicyState,
    SamplingParams,
    ScaleResult,
    TokenChunk,
    check_slo_s,
)
from blitzmesh.v1 import admin_pb2, admin_pb2_grpc, inference_pb2, inference_pb2_grpc

__all__ = ["ADMIN_API_KEY_ENV", "DEFAULT_TARGET", "AsyncClient", "Client", "MessageLike"]

DEFAULT_TARGET = "127.0.0.1:50051"
ADMIN_API_KEY_ENV = "BLITZMESH_ADMIN_API_KEY"
"""Environment variable read for the admin key when `admin_api_key` is not passed."""

MessageLike = ChatMessage | Mapping[str, str]
"""A chat turn: a `ChatMessage` or a mapping with ``"role"`` and ``"content"``."""

_P = ParamSpec("_P")
_T = TypeVar("_T")
_Msg = TypeVar("_Msg")

_INT32_MAX = 2**31 - 1
MAX_N = 128
"""Most choices one request may ask for (OpenAI's limit; a gateway may allow fewer)."""


# --- validation -------------------------------------------------------------------------------


def _short(value: object) -> str:
    # Errors quote the offending value, but a 100k-token prompt must not flood the traceback.
    return reprlib.repr(value)


def _check_timeout(name: str, value: float | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value <= 0:
        raise ValueError(f"{name} must be a number > 0 (math.inf: no deadline), got {value!r}")


def _check_key(name: str, value: object) -> None:
    if isinstance(value, str) and value and value == value.strip():
        return
    # Never quote a secret: describe it instead.
    shape = f"a str of length {len(value)}" if isinstance(value, str) else f"a {type(value).__name__}"
    raise ValueError(f"{name} must be a non-empty string without surrounding whitespace, got {shape}")


def _bearer(key: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),) if key is not None else ()


def _check_name(name: str, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string, got {_short(value)}")


def _chat_message(value: object) -> ChatMessage:
    if isinstance(value, ChatMessage):
        message = value
    elif isinstance(value, Mapping) and set(value) == {"role", "content"}:
        message = ChatMessage(role=value["role"], content=value["content"])
    else:
        raise ValueError(
            f"messages must hold ChatMessage objects or mappings with exactly 'role' and 'content', got {_short(value)}"
        )
    if not isinstance(message.role, str) or not message.role:
        raise ValueError(f"a message role must be a non-empty string, got {_short(value)}")
    if not isinstance(message.content, str):
        raise ValueError(f"a message content must be a string, got {_short(value)}")
    return message


def _generate_request(
    *,
    prompt: str | None,
    messages: Sequence[MessageLike] | None,
    prompt_token_ids: Sequence[int] | None,
    model: str,
    sampling: SamplingParams,
    request_id: str | None,
    return_token_ids: bool,
    n: int = 1,
    echo: bool = False,
    ttft_slo_s: float | None = None,
    tpot_slo_s: float | None = None,
) -> inference_pb2.GenerateRequest:
    """Validate the inputs of generate/complete and build the wire request."""
    given = {
        name: value
        for name, value in (
            ("prompt", prompt),
            ("messages", messages),
            ("prompt_token_ids", prompt_token_ids),
        )
        if value is not None
    }
    if len(given) != 1:
        quoted = ", ".join(f"{k}={_short(v)}" for k, v in given.items()) or "none"
        raise ValueError(f"pass exactly one of prompt, messages, prompt_token_ids; got {quoted}")
    _check_name("model", model)
    chat: list[ChatMessage] | None = None
    if prompt is not None:
        _check_name("prompt", prompt)
    if messages is not None:
        # A bare string or mapping is a sequence too; catch it before it is read as turns.
        if isinstance(messages, (str, bytes, Mapping)) or not messages:
            raise ValueError(f"messages must be a non-empty list of turns, got {_short(messages)}")
        chat = [_chat_message(m) for m in messages]
    if prompt_token_ids is not None:
        if isinstance(prompt_token_ids, (str, bytes)) or not prompt_token_ids:
            raise ValueError(f"prompt_token_ids must be a non-empty list of ints, got {_short(prompt_token_ids)}")
        for tid in prompt_token_ids:
            if isinstance(tid, bool) or not isinstance(tid, int) or not 0 <= tid <= _INT32_MAX:
                raise ValueError(
                    f"prompt_token_ids must hold ints >= 0, got {_short(tid)} in {_short(prompt_token_ids)}"
                )
    if request_id is None:
        # Made here rather than by the gateway so that every retry of a request carries the
        # same id and an error can name it.
        request_id = uuid.uuid4().hex
    _check_name("request_id", request_id)
    if not isinstance(return_token_ids, bool):
        raise ValueError(f"return_token_ids must be a bool, got {return_token_ids!r}")
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise ValueError(f"n must be an int in [1, {MAX_N}], got {n!r}")
    if not isinstance(echo, bool):
        raise ValueError(f"echo must be a bool, got {echo!r}")
    if echo and messages is not None:
        raise ValueError("echo=True needs a prompt or prompt_token_ids; chat messages have no prompt text to echo")
    check_slo_s("ttft_slo_s", ttft_slo_s)
    check_slo_s("tpot_slo_s", tpot_slo_s)
    return convert.generate_request_to_proto(
        model=model,
        prompt=prompt,
        messages=chat,
        prompt_token_ids=prompt_token_ids,
        sampling=sampling,
        request_id=request_id,
        return_token_ids=return_token_ids,
        n=n,
        echo=echo,
        ttft_slo_s=ttft_slo_s,
        tpot_slo_s=tpot_slo_s,
    )


def _stop_sequences(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    return tuple(stop)


def _parse(to_sdk: Callable[[_Msg], _T], msg: _Msg, request_id: str | None = None) -> _T:
    """Convert a reply; a reply that breaks the protocol is the server's fault, not the
    caller's, so it surfaces as InternalError rather than ValueError."""
    try:
        return to_sdk(msg)
    except ValueError as e:
        raise InternalError(f"malformed reply from the gateway: {e}", code="INTERNAL", request_id=request_id) from e


# --- async client -----------------------------------------------------------------------------


class AsyncClient:
    """Asyncio client of a Blitzmesh gateway.

    Use it as an async context manager (or call `close`). The gRPC channel is opened on the
    first call, on the running event loop; use one client from one event loop.

    Args:
        target: gateway gRPC address, ``host:port``.
        api_key: sent as ``authorization: Bearer <key>`` metadata with inference calls
            (`generate`, `complete`, `list_models`), and with admin calls when no `admin_api_key`
            is set.
        admin_api_key: sent the same way with the admin calls that change or reveal the cluster
            (`cluster`, `scale`, `set_policy`, `watch_events`). ``None`` reads the environment
            variable ``BLITZMESH_ADMIN_API_KEY`` (unset or empty: no admin key). A gateway with
            no admin keys configured takes admin calls from its own machine (loopback) without
            one, so a local `make up` needs none; from anywhere else, or once the gateway has
            admin keys, it refuses them without a valid admin key (PERMISSION_DENIED or
            UNAUTHENTICATED, raised as AuthenticationError). An inference key never passes.
        timeout_s: deadline of every call (a whole stream included) unless a call overrides it;
            ``None`` or ``math.inf``: no deadline. `watch_events` has no deadline by default.
        max_retries: how many times a call failing with UNAVAILABLE is tried again. A stream is
            retried only before its first message; once a token was yielded the error is raised.
        retry_backoff_s: wait before the first retry; doubled for each further one, with jitter.
        credentials: TLS channel credentials; ``None`` opens a plaintext channel.

    Raises:
        ValueError: for an invalid argument, quoting it.
    """

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        timeout_s: float | None = 60.0,
        max_retries: int = 2,
        retry_backoff_s: float = 0.2,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        _check_name("target", target)
        _check_timeout("timeout_s", timeout_s)
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"max_retries must be an int >= 0, got {max_retries!r}")
        if (
            isinstance(retry_backoff_s, bool)
            or not isinstance(retry_backoff_s, (int, float))
            or not 0 <= retry_backoff_s < math.inf
        ):
            raise ValueError(f"retry_backoff_s must be a finite number >= 0, got {retry_backoff_s!r}")
        if api_key is not None:
            _check_key("api_key", api_key)
        if admin_api_key is not None:
            _check_key("admin_api_key", admin_api_key)
        else:
            admin_api_key = os.environ.get(ADMIN_API_KEY_ENV) or None
            if admin_api_key is not None:
                _check_key(f"the environment variable {ADMIN_API_KEY_ENV}", admin_api_key)
        self._target = target
        self._timeout_s = timeout_s
        self._max_retries = max_retries
        self._retry_backoff_s = float(retry_backoff_s)
        self._credentials = credentials
        self._metadata = _bearer(api_key)
        # Without an admin key the inference key goes along, so that a gateway with admin keys
        # can answer "that is an inference key" rather than "no key".
        self._admin_metadata = _bearer(admin_api_key) if admin_api_key is not None else self._metadata
        self._channel: grpc.aio.Channel | None = None
        self._inference: inference_pb2_grpc.InferenceStub | None = None
        self._admin: admin_pb2_grpc.AdminStub | None = None
        self._closed = False

    @property
    def target(self) -> str:
        """The gateway address this client talks to."""
        return self._target

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the channel; calls still in flight are cancelled. Closing twice is fine."""
        self._closed = True
        channel, self._channel = self._channel, None
        self._inference = self._admin = None
        if channel is not None:
            await channel.close()

    # --- inference ----------------------------------------------------------------------------

    def generate(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[MessageLike] | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        model: str,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        stop: str | Sequence[str] | None = None,
        seed: int | None = None,
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        repetition_penalty: float | None = None,
        logit_bias: Mapping[int, float] | None = None,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        n: int = 1,
        echo: bool = False,
        ttft_slo_s: float | None = None,
        tpot_slo_s: float | None = None,
        return_token_ids: bool = False,
        request_id: str | None = None,
        timeout_s: float | None = None,
    ) -> AsyncIterator[TokenChunk]:
        """Stream a completion as text deltas.

        Give exactly one of `prompt`, `messages` (chat turns) or `prompt_token_ids`. Sampling
        arguments left as ``None`` take the gateway's defaults. The last chunk carries
        `finish_reason` and `usage`. Arguments are checked at once, before any network call.

        `n` > 1 streams n independent choices, their chunks interleaved and told apart by
        `TokenChunk.index`; each choice's last chunk has its finish_reason and usage. With a
        `seed`, choice i samples with ``seed + i``, so it is reproducible (and choice 0 equals the
        n=1 answer). `logprobs=k` adds each token's log-prob and the k most likely alternatives
        (`TokenChunk.logprobs`), `prompt_logprobs=k` the same for the prompt (on each choice's
        first chunk); `echo` prepends the prompt text to each choice. The penalties and
        `logit_bias` follow OpenAI (presence/frequency over generated tokens, -2..2; bias
        -100..100 per token id) and vLLM (`repetition_penalty` over prompt + output, > 0).

        `ttft_slo_s` / `tpot_slo_s` are latency objectives in seconds (time to the first token,
        from the gateway accepting the request; mean time per output token after it); unset ones
        take the deployment's defaults. The last chunk's `usage.slo` says whether each was met.
        A request no instance can serve within its objective is refused before its first token
        with SLOUnattainableError (an OverloadedError carrying `retry_after_s`).

        Leaving the loop early cancels the request on the server; wrap the iterator in
        `contextlib.aclosing` to have that happen at once rather than when it is collected.

        Raises:
            ValueError: for invalid arguments (immediately).
            BlitzmeshError: a subclass matching the failure, during iteration; InternalError
                also when the stream ends without a finish_reason.
        """
        request = _generate_request(
            prompt=prompt,
            messages=messages,
            prompt_token_ids=prompt_token_ids,
            model=model,
            sampling=SamplingParams(
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                max_tokens=max_tokens,
                stop=_stop_sequences(stop),
                seed=seed,
                stop_token_ids=tuple(stop_token_ids),
                ignore_eos=ignore_eos,
                presence_penalty=presence_penalty,
                frequency_penalty=frequency_penalty,
                repetition_penalty=repetition_penalty,
                logit_bias=logit_bias or (),
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
            ),
            request_id=request_id,
            return_token_ids=return_token_ids,
            n=n,
            echo=echo,
            ttft_slo_s=ttft_slo_s,
            tpot_slo_s=tpot_slo_s,
        )
        return self._generate(request, self._timeout(timeout_s))

    async def _generate(
        self, request: inference_pb2.GenerateRequest, timeout_s: float | None
    ) -> AsyncIterator[TokenChunk]:
        finished: set[int] = set()
        stream = self._stream(self._stubs()[0].Generate, request, timeout_s, request.request_id)
        # aclosing: if our consumer stops early, cancel the RPC now, not at garbage collection.
        async with contextlib.aclosing(stream):
            async for msg in stream:
                chunk = _parse(convert.token_chunk_from_proto, msg, request.request_id)
                if chunk.finish_reason is not None:
                    finished.add(chunk.index)
                yield chunk
        if len(finished) < max(request.n, 1):
            # The gateway promises that every accepted request ends in a finish or an error
            # status; a stream that just stops would hand the caller a silently cut text.
            missing = sorted(set(range(max(request.n, 1))) - finished)
            raise InternalError(
                f"the Generate stream ended without a finish_reason for choice(s) {missing}",
                code="INTERNAL",
                request_id=request.request_id,
            )

    async def complete(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[MessageLike] | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        model: str,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        stop: str | Sequence[str] | None = None,
        seed: int | None = None,
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        repetition_penalty: float | None = None,
        logit_bias: Mapping[int, float] | None = None,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        n: int = 1,
        echo: bool = False,
        ttft_slo_s: float | None = None,
        tpot_slo_s: float | None = None,
        return_token_ids: bool = False,
        request_id: str | None = None,
        timeout_s: float | None = None,
    ) -> Completion:
        """Run a completion and return it whole (the gateway's unary ``Complete``).

        Takes the same arguments as `generate` (`usage.slo` reports the SLOs). Retried on
        UNAVAILABLE. With `n` > 1 the
        choices are in `Completion.choices` (the top-level text is choice 0's) and `usage` counts
        the prompt once and the completion tokens of every choice.

        Raises:
            ValueError: for invalid arguments.
            BlitzmeshError: a subclass matching the failure.
        """
        request = _generate_request(
            prompt=prompt,
            messages=messages,
            prompt_token_ids=prompt_token_ids,
            model=model,
            sampling=SamplingParams(
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                max_tokens=max_tokens,
                stop=_stop_sequences(stop),
                seed=seed,
                stop_token_ids=tuple(stop_token_ids),
                ignore_eos=ignore_eos,
                presence_penalty=presence_penalty,
                frequency_penalty=frequency_penalty,
                repetition_penalty=repetition_penalty,
                logit_bias=logit_bias or (),
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
            ),
            request_id=request_id,
            return_token_ids=return_token_ids,
            n=n,
            echo=echo,
            ttft_slo_s=ttft_slo_s,
            tpot_slo_s=tpot_slo_s,
        )
        reply = await self._unary(
            self._stubs()[0].Complete,
            request,
            self._timeout(timeout_s),
            retry=True,
            request_id=request.request_id,
        )
        return _parse(convert.completion_from_proto, reply, request.request_id)

    # --- admin --------------------------------------------------------------------------------

    async def list_models(self, *, timeout_s: float | None = None) -> list[ModelInfo]:
        """Models the cluster can serve."""
        reply = await self._unary(
            self._stubs()[1].ListModels,
            admin_pb2.ListModelsRequest(),
            self._timeout(timeout_s),
            retry=True,
        )
        return [_parse(convert.model_info_from_proto, m) for m in reply.models]

    async def cluster(self, *, timeout_s: float | None = None) -> ClusterState:
        """Snapshot of the cluster: instances with their state and load, models, policy."""
        reply = await self._unary(
            self._stubs()[1].GetCluster,
            admin_pb2.GetClusterRequest(),
            self._timeout(timeout_s),
            retry=True,
            metadata=self._admin_metadata,
        )
        return _parse(convert.cluster_state_from_proto, reply)

    async def scale(
        self,
        model: str,
        delta: int,
        *,
        wait: bool = False,
        role: InstanceRole | None = None,
        instance_ids: Sequence[str] = (),
        timeout_s: float | None = None,
    ) -> ScaleResult:
        """Add (``delta > 0``) or drain (``delta < 0``) instances of `model`.

        `instance_ids` (with ``delta = -len(instance_ids)``) drains exactly those SERVING
        instances; without it the manager drains the least loaded.

        With ``wait=True`` the reply comes once the new instances serve (or failed), so a
        longer `timeout_s` may be needed. Unlike the other calls this one is never retried: it
        is not idempotent, and an UNAVAILABLE reply does not prove the first attempt had no
        effect, so a retry could scale twice.
        """
        _check_name("model", model)
        if isinstance(delta, bool) or not isinstance(delta, int) or delta == 0:
            raise ValueError(f"delta must be a non-zero int, got {delta!r}")
        if not -_INT32_MAX <= delta <= _INT32_MAX:
            raise ValueError(f"delta must fit in 32 bits, got {delta!r}")
        if not isinstance(wait, bool):
            raise ValueError(f"wait must be a bool, got {wait!r}")
        if isinstance(instance_ids, str) or not all(isinstance(i, str) and i for i in instance_ids):
            raise ValueError(f"instance_ids must be a sequence of non-empty strings, got {instance_ids!r}")
        if instance_ids and delta != -len(instance_ids):
            raise ValueError(f"delta must be -{len(instance_ids)} to drain {list(instance_ids)}, got {delta!r}")
        request = admin_pb2.ScaleRequest(
            model_id=model,
            delta=delta,
            role=convert.instance_role_to_proto(role or "unspecified"),
            wait=wait,
            instance_ids=list(instance_ids),
        )
        reply = await self._unary(
            self._stubs()[1].Scale, request, self._timeout(timeout_s), retry=False, metadata=self._admin_metadata
        )
        return _parse(convert.scale_result_from_proto, reply)

    async def set_policy(
        self,
        name: str,
        params: Mapping[str, str | int | float | bool] | None = None,
        *,
        advisory: bool | None = None,
        timeout_s: float | None = None,
    ) -> PolicyState:
        """Switch the scaling policy (e.g. ``"heteroscale"``) and its parameters.

        Parameters travel as strings and are validated by the global manager. `advisory`:
        ``True`` decides without acting, ``False`` acts, ``None`` keeps the current mode.
        """
        _check_name("name", name)
        if advisory is not None and not isinstance(advisory, bool):
            raise ValueError(f"advisory must be a bool or None, got {advisory!r}")
        request = admin_pb2.SetPolicyRequest(policy=name, params=convert.policy_params_to_proto(params or {}))
        if advisory is not None:
            request.advisory = advisory
        reply = await self._unary(
            self._stubs()[1].SetPolicy, request, self._timeout(timeout_s), retry=True, metadata=self._admin_metadata
        )
        return _parse(convert.policy_state_from_proto, reply)

    def watch_events(self, *, timeout_s: float | None = None) -> AsyncIterator[ClusterEvent]:
        """Stream cluster events (scaling decisions with their reasons, state changes) as they
        happen, until the caller stops iterating.

        Unlike other calls a watch has no deadline unless `timeout_s` is given, since it is
        meant to run for as long as the caller wants. A lost connection is retried only until
        the first event; after that UnavailableError is raised and the caller watches again
        (events in between are not replayed).
        """
        _check_timeout("timeout_s", timeout_s)
        return self._watch_events(None if timeout_s is None or math.isinf(timeout_s) else timeout_s)

    async def _watch_events(self, timeout_s: float | None) -> AsyncIterator[ClusterEvent]:
        stream = self._stream(
            self._stubs()[1].WatchEvents,
            admin_pb2.WatchEventsRequest(),
            timeout_s,
            None,
            metadata=self._admin_metadata,
        )
        async with contextlib.aclosing(stream):
            async for msg in stream:
                yield _parse(convert.cluster_event_from_proto, msg)

    # --- call machinery -----------------------------------------------------------------------

    def _stubs(self) -> tuple[inference_pb2_grpc.InferenceStub, admin_pb2_grpc.AdminStub]:
        if self._closed:
            raise RuntimeError(f"the client of {self._target} is closed")
        if self._inference is None or self._admin is None:
            # Opened lazily so that the channel binds to the loop that makes the first call,
            # not to whatever loop (if any) was current when the client was constructed.
            options = [("grpc.primary_user_agent", f"blitzmesh-python/{__version__}")]
            if self._credentials is not None:
                self._channel = grpc.aio.secure_channel(self._target, self._credentials, options=options)
            else:
                self._channel = grpc.aio.insecure_channel(self._target, options=options)
            self._inference = inference_pb2_grpc.InferenceStub(self._channel)
            self._admin = admin_pb2_grpc.AdminStub(self._channel)
        return self._inference, self._admin

    def _timeout(self, timeout_s: float | None) -> float | None:
        """The per-call override, else the client default; ``None`` means no deadline."""
        _check_timeout("timeout_s", timeout_s)
        value = self._timeout_s if timeout_s is None else timeout_s
        return None if value is None or math.isinf(value) else float(value)

    async def _retry_after(self, error: grpc.aio.AioRpcError, attempt: int, deadline: float | None) -> bool:
        """Sleep before retry number `attempt + 1` and return True, or return False when the
        error must be raised: not UNAVAILABLE, retries used up, or no time left to wait."""
        if error.code() != grpc.StatusCode.UNAVAILABLE or attempt >= self._max_retries:
            return False
        # Jitter keeps clients that lost the gateway together from coming back in lockstep.
        delay_s = self._retry_backoff_s * (2**attempt) * random.uniform(0.5, 1.0)
        if deadline is not None and time.monotonic() + delay_s >= deadline:
            return False
        await asyncio.sleep(delay_s)
        return True

    @staticmethod
    def _remaining(deadline: float | None) -> float | None:
        return None if deadline is None else max(deadline - time.monotonic(), 0.0)

    async def _unary(
        self,
        method: Callable[..., Awaitable[_T]],
        request: Any,
        timeout_s: float | None,
        *,
        retry: bool,
        request_id: str | None = None,
        metadata: tuple[tuple[str, str], ...] | None = None,
    ) -> _T:
        # One deadline for the whole call, retries included: the caller's timeout_s bounds how
        # long they wait, however many attempts it takes.
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        attempt = 0
        while True:
            try:
                return await method(
                    request,
                    timeout=self._remaining(deadline),
                    metadata=self._metadata if metadata is None else metadata,
                )
            except grpc.aio.AioRpcError as e:
                if retry and await self._retry_after(e, attempt, deadline):
                    attempt += 1
                    continue
                raise from_rpc_error(e, request_id=request_id) from e

    async def _stream(
        self,
        method: Callable[..., Any],
        request: Any,
        timeout_s: float | None,
        request_id: str | None,
        *,
        metadata: tuple[tuple[str, str], ...] | None = None,
    ) -> AsyncIterator[Any]:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        attempt = 0
        while True:
            call = method(
                request, timeout=self._remaining(deadline), metadata=self._metadata if metadata is None else metadata
            )
            received = False
            try:
                async for msg in call:
                    received = True
                    yield msg
                return
            except grpc.aio.AioRpcError as e:
                # After the first message the caller already holds part of the output; a retry
                # would repeat it (or sample a different continuation), so only fail.
                if not received and await self._retry_after(e, attempt, deadline):
                    attempt += 1
                    continue
                raise from_rpc_error(e, request_id=request_id) from e
            finally:
                # No-op once the call is done; otherwise (consumer left, task cancelled) it stops
                # the work on the server.
                call.cancel()


# --- sync client ------------------------------------------------------------------------------

_END = object()


def _blocking(
    method: Callable[Concatenate[AsyncClient, _P], Coroutine[Any, Any, _T]],
) -> Callable[Concatenate[Client, _P], _T]:
    """Turn an AsyncClient coroutine method into a blocking Client method."""

    @functools.wraps(method)
    def call(self: Client, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        self._check_open()
        return self._submit(method(self._aclient, *args, **kwargs))

    call.__qualname__ = f"Client.{method.__name__}"
    return call


def _blocking_iter(
    method: Callable[Concatenate[AsyncClient, _P], AsyncIterator[_T]],
) -> Callable[Concatenate[Client, _P], Iterator[_T]]:
    """Turn an AsyncClient streaming method into a Client method returning an iterator."""

    @functools.wraps(method)
    def call(self: Client, *args: _P.args, **kwargs: _P.kwargs) -> Iterator[_T]:
        self._check_open()
        # Called here, in the caller's thread, so invalid arguments raise at once.
        return self._iterate(method(self._aclient, *args, **kwargs))

    call.__qualname__ = f"Client.{method.__name__}"
    return call


class Client:
    """Blocking client of a Blitzmesh gateway, with the same methods and arguments as
    `AsyncClient` (`generate` and `watch_events` return plain iterators).

    It runs an `AsyncClient` on a private event loop in a background thread; it may be shared
    between threads. Use it as a context manager or call `close`.
    """

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        timeout_s: float | None = 60.0,
        max_retries: int = 2,
        retry_backoff_s: float = 0.2,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        # Validate (by constructing) before starting the thread, so a bad argument leaves
        # nothing running.
        self._aclient = AsyncClient(
            target,
            api_key=api_key,
            admin_api_key=admin_api_key,
            timeout_s=timeout_s,
            max_retries=max_retries,
            retry_backoff_s=retry_backoff_s,
            credentials=credentials,
        )
        self._loop = asyncio.new_event_loop()
        self._close_lock = threading.Lock()
        self._closed = False
        # A daemon thread, so that a program which forgets close() can still exit.
        self._thread = threading.Thread(target=self._run_loop, name=f"blitzmesh-client-{target}", daemon=True)
        self._thread.start()

    @property
    def target(self) -> str:
        """The gateway address this client talks to."""
        return self._aclient.target

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Cancel calls in flight, close the channel and stop the background thread.
        Closing twice is fine."""
        with self._close_lock:
            if self._closed:
                return
            # Set first: iterators interrupted by the shutdown below must not try to submit
            # their own cleanup to a loop that is about to stop.
            self._closed = True
            try:
                self._submit(self._shutdown())
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join()

    generate = _blocking_iter(AsyncClient.generate)
    complete = _blocking(AsyncClient.complete)
    list_models = _blocking(AsyncClient.list_models)
    cluster = _blocking(AsyncClient.cluster)
    scale = _blocking(AsyncClient.scale)
    set_policy = _blocking(AsyncClient.set_policy)
    watch_events = _blocking_iter(AsyncClient.watch_events)

    # --- bridge to the loop thread ------------------------------------------------------------

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()

    async def _shutdown(self) -> None:
        await self._aclient.close()
        # Calls other threads still wait on must end now, or those threads would block forever
        # once the loop stops.
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"the client of {self.target} is closed")
        if threading.current_thread() is self._thread:
            # The loop would wait on itself.
            raise RuntimeError("a blocking Client cannot be called from its own loop thread")

    def _submit(self, coro: Coroutine[Any, Any, _T]) -> _T:
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result()
        except concurrent.futures.CancelledError:
            if not self._closed:
                raise
            # close() from another thread cut this call short; say so in the SDK's terms.
            raise RequestCancelledError(
                f"the client of {self.target} was closed during the call", code="CANCELLED"
            ) from None
        finally:
            # Only matters when the wait itself was interrupted (KeyboardInterrupt): then the
            # call on the loop is cancelled too instead of running on unobserved.
            future.cancel()

    def _iterate(self, stream: AsyncIterator[_T]) -> Iterator[_T]:
        async def next_item() -> Any:
            try:
                return await anext(stream)
            except StopAsyncIteration:
                # A sentinel rather than the exception: StopAsyncIteration is not meant to
                # travel through futures.
                return _END

        try:
            while True:
                item = self._submit(next_item())
                if item is _END:
                    return
                yield item
        finally:
            # Runs when the caller stops early too (break, or the iterator is collected): close
            # the async side so the RPC is cancelled on the server.
            aclose = getattr(stream, "aclose", None)
            if aclose is not None and not self._closed:
                self._submit(aclose())
