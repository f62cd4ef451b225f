"""The request path shared by the HTTP and gRPC front ends.

validate -> tokenize (per-model tokenizer from the parameter manager, cached) -> admit (bounded
concurrency + FIFO queue) -> Schedule a route on the global manager -> stream Worker.Generate
-> detokenize incrementally -> stop strings -> usage. A worker that fails before the first
token reaches the client is excluded and the request re-routed; one that fails after it (dies,
hangs past `token_stall_timeout_s`, or drains) is excluded and the stream migrates: another
instance resumes from the prompt plus the tokens generated so far, and the client's stream goes
on. A client that goes away cancels the worker call and sends Abort.

A hung instance (SIGSTOP, a wedged host) is usually caught sooner than the stall timeout: the
gateway follows the global manager's cluster events (WatchEvents), and when the manager marks an
instance LOST (no heartbeat for its `lost_after_s`, 5 s by default) every stream open on it, before
or after its first token, fails over at once. The stall timeout stays as the bound for when the
event stream is down (a manager restart).

n > 1 fans out here: each choice is an ordinary request of its own (id `<request_id>-<i>`,
seed + i), scheduled, retried before its first token, stop-string-checked and aborted on its
own, and the choices' events interleave as they arrive. That is the simplest correct design:
nothing new in the worker or the engine (an engine fork would need copy-on-write KV blocks,
which the paged cache does not have), and it is how vLLM v1 runs n too (one child request per
choice). The cost is n prefills of the prompt, and one admission slot covers all n choices.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from blitzmesh.convert import request_slo_to_proto, sampling_to_proto
from blitzmesh.errors import parse_retry_after_s
from blitzmesh.v1 import (
    admin_pb2,
    common_pb2,
    global_manager_pb2,
    global_manager_pb2_grpc,
    kv_pb2,
    param_manager_pb2,
    param_manager_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from services.common import roles
from services.common.grpc_util import MOVED_METADATA_KEY, RETRY_AFTER_METADATA_KEY, SLO_METADATA_KEY, channel
from services.common.prefix import block_hashes
from services.gateway import esp
from services.gateway.admission import Admission
from services.gateway.attempts import (
    AttemptLimits,
    AttemptPlan,
    AttemptState,
    Decision,
    Fail,
    Migrate,
    Move,
    Outcome,
    Retry,
    ScheduleFailed,
    Wait,
    WorkerFailed,
    decide,
    error_for,
    plan_attempt,
    slo_error,
)
from services.gateway.config import GatewayConfig
from services.gateway.errors import ErrorKind, GatewayError, invalid, quote
from services.gateway.metrics import GatewayMetrics
from services.gateway.replies import Bad, HandedOff, Moved, Tokens, classify
from services.gateway.schema import (
    FINISH_LENGTH,
    FINISH_STOP,
    INT64_MIN,
    SLO,
    Event,
    Finish,
    InferenceRequest,
    SLOAttainment,
    TokenDelta,
    combine_attainment,
    slo_attainment,
    validate_request,
)
from services.gateway.text import Piece, TextAssembler
from services.gateway.tokenization import ModelAssets, ModelCache

log = structlog.get_logger(__name__)

_ABORT_TIMEOUT_S = 2.0
# Reconnecting the cluster-event watch after the manager went away: backoff bounds.
_WATCH_BACKOFF_MIN_S = 0.2
_WATCH_BACKOFF_MAX_S = 5.0
_LOST_ACTION = "instance_lost"  # the manager's ClusterEvent.action for an instance gone silent
_REGISTERED_ACTION = "instance_registered"  # ... for a worker (re)starting: a new incarnation
# Worker failures the manager hears of (ReportInstanceFailure): the instance itself broke or
# went away. Back-pressure (RESOURCE_EXHAUSTED) and a drain (ABORTED) are not failures.
_REPORTED = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.DATA_LOSS,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.FAILED_PRECONDITION,
    }
)
_REPORT_TIMEOUT_S = 2.0
_REPORT_EVERY_S = 1.0  # one report per instance per this long, however many streams broke at once
_SCHEDULE_BACKOFF_MAX_S = 0.5
_HEALTH_TIMEOUT_S = 2.0


def generate_mode(
    *,
    handoff: bool = False,
    kv_source: kv_pb2.KVTransferDescriptor | None = None,
    zigzag_source: worker_pb2.ZigzagSource | None = None,
) -> dict[str, Any]:
    """The `mode` field of a WorkerGenerateRequest for a request that hands its KV off after
    its first token (`handoff`), decodes from another instance's KV (`kv_source`), or takes
    over the first layers a loading instance ran (`zigzag_source`); none of them: colocated."""
    if kv_source is not None and (handoff or zigzag_source is not None):
        raise ValueError("a request decoding from handed-off KV neither hands off nor relays")
    if zigzag_source is not None:
        return {"zigzag_partner_handoff" if handoff else "zigzag_partner": zigzag_source}
    if kv_source is not None:
        return {"decode_from_kv": kv_source}
    if handoff:
        return {"prefill_handoff": worker_pb2.PrefillHandoffMode()}
    return {"colocated": worker_pb2.ColocatedMode()}


@dataclass(frozen=True)
class ModelCard:
    model_id: str
    created_unix_s: int
    max_context: int
    num_layers: int


class _WorkerFailedError(Exception):
    """One attempt on one instance failed; the caller decides between retry and error."""

    def __init__(
        self,
        instance_id: str,
        code: grpc.StatusCode,
        detail: str,
        tokens_received: int,
        moved: str | None = None,
        slo_kind: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(f"{code.name}: {detail}")
        self.instance_id = instance_id
        self.code = code
        self.detail = detail
        self.tokens_received = tokens_received
        self.moved = moved  # the instance released the queued request (rebalancing): the reason
        # The instance refused the request for an SLO it cannot meet ("ttft"/"tpot"), and when
        # it expects room (its RESOURCE_EXHAUSTED status's trailing metadata).
        self.slo_kind = slo_kind
        self.retry_after_s = retry_after_s

    def outcome(self, incarnation: int) -> WorkerFailed:
        """The failure as `attempts.decide` reads it; `incarnation`: the instance's now."""
        return WorkerFailed(
            self.instance_id,
            self.code,
            self.tokens_received,
            self.moved,
            self.slo_kind,
            self.detail,
            self.retry_after_s,
            incarnation,
        )


class _LostGuard:
    """One open worker stream's link to the cluster-event watch: told the instance is LOST, it
    ends the stream's current read at once (its timeout rescheduled to now)."""

    def __init__(self) -> None:
        self.lost: str | None = None
        self.timeout: asyncio.Timeout | None = None

    def fire(self, reason: str) -> None:
        self.lost = reason
        if self.timeout is not None:
            self.timeout.reschedule(asyncio.get_running_loop().time())


@dataclass(frozen=True)
class Choice:
    """One choice of a request, as each of its attempts runs it: the request (a child request of
    its own when n > 1), its model, prompt and budget, its deadline, the request's logger, its
    place among the choices (`index`) and the echoed prompt's text (None without `echo`)."""

    req: InferenceRequest
    assets: ModelAssets
    prompt_ids: list[int]
    max_tokens: int
    deadline_s: float
    bound: structlog.typing.FilteringBoundLogger
    index: int = 0
    echo_text: str | None = None

    def child(self, index: int) -> Choice:
        """Choice `index` of n > 1: its own request id (`<request_id>-<index>`) and seed (seed + index)."""
        req = self.req
        child = replace(
            req,
            request_id=f"{req.request_id}-{index}",
            n=1,
            sampling=replace(req.sampling, seed=choice_seed(req.sampling.seed, index)),
        )
        return replace(self, req=child, index=index)

    def text(self) -> TextAssembler:
        """The choice's text state, for every instance it runs on."""
        sampling = self.req.sampling
        return TextAssembler(
            self.assets.tokenizer,
            sampling.stop,
            echo=self.echo_text,
            logprobs=sampling.logprobs is not None,
            prompt_ids=self.prompt_ids if sampling.prompt_logprobs is not None else None,
        )


@dataclass
class _StreamState:
    """What one choice's stream carries from instance to instance: the tokens generated so far
    (a migrated stream resumes from them) and the text state built from exactly those tokens,
    so the client sees no token twice and none missing."""

    text: TextAssembler
    generated: list[int] = field(default_factory=list)
    last_s: float | None = None  # when the last token arrived, for TBT
    # Set when a prefill instance ended its stream by handing the request's KV off: where the
    # decode instance pulls it from.
    handoff: kv_pb2.KVTransferDescriptor | None = None
    # The prompt tokens that came from a prefix cache, as the last instance that prefilled the
    # prompt reported them (one that pulled the KV instead reports nothing and leaves it).
    cached_tokens: int = 0


@dataclass
class _Call:
    """One attempt's Worker.Generate call: its hop, the lost-instance guard, the ESP holders'
    calls (`holders`, an ESP master), whether it was asked to hand its KV off (`handoff`), whether a message
    came (the stall timeout starts with the first), and whether the worker ended the call itself
    (`done`; otherwise it is cancelled and aborted there)."""

    hop: global_manager_pb2.RouteHop
    rpc: grpc.aio.UnaryStreamCall
    guard: _LostGuard
    guards: set[_LostGuard]
    stall_s: float | None
    handoff: bool = False
    holders: esp.EspCalls | None = None
    got_any: bool = False
    done: bool = False

    @property
    def instance(self) -> str:
        return self.hop.instance_id or self.hop.address

    def failed(
        self, code: grpc.StatusCode, detail: str, generated: int, moved: str | None = None
    ) -> _WorkerFailedError:
        return _WorkerFailedError(self.instance, code, detail, generated, moved=moved)


@dataclass
class _AttemptRun:
    """What one attempt leaves to clean up: the ZigZag loading instance's call, and the prefill
    instance that handed its KV off (it holds the KV until the decode instance pulls it) with the
    tokens generated when it did."""

    first_hop: asyncio.Task[None] | None = None
    handed_off_by: global_manager_pb2.RouteHop | None = None
    generated_before: int = 0


class Backend:
    """Owns the upstream channels, the model cache, admission and the metrics."""

    def __init__(self, config: GatewayConfig, metrics: GatewayMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics if metrics is not None else GatewayMetrics()
        self.admission = Admission(
            config.max_concurrency, config.max_queue, config.queue_timeout_s, on_change=self.metrics.set_admission
        )
        self._gm_channel: grpc.aio.Channel | None = None
        self._pm_channel: grpc.aio.Channel | None = None
        self.gm: global_manager_pb2_grpc.GlobalManagerStub | None = None
        self.pm: param_manager_pb2_grpc.ParamManagerStub | None = None
        self._workers: dict[str, tuple[grpc.aio.Channel, worker_pb2_grpc.WorkerStub]] = {}
        self._models = ModelCache(self._fetch_model_files)
        # Abort RPCs outlive the request that sent them; kept here so none is dropped or leaked.
        self._background: set[asyncio.Task[None]] = set()
        # Streams open on each instance (by id), ended when the manager marks it LOST.
        self._open: dict[str, set[_LostGuard]] = {}
        self._watch: asyncio.Task[None] | None = None
        # Registrations seen per instance id (the cluster-event watch): an exclusion made before
        # an instance restarted does not keep a request off the new incarnation.
        self._incarnation: dict[str, int] = {}
        self._reported: dict[str, float] = {}  # instance id -> when this gateway last reported it failed

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        self._gm_channel = channel(self.config.global_manager, roles.GLOBAL_MANAGER)
        self._pm_channel = channel(self.config.param_manager, roles.PARAM_MANAGER)
        self.gm = global_manager_pb2_grpc.GlobalManagerStub(self._gm_channel)
        self.pm = param_manager_pb2_grpc.ParamManagerStub(self._pm_channel)
        self._watch = asyncio.get_running_loop().create_task(self._watch_lost(), name="watch-lost")

    async def drain(self, timeout_s: float) -> None:
        """Wait (bounded) until no admitted or queued request is left, e.g. before close()."""
        try:
            async with asyncio.timeout(timeout_s):
                await self.admission.wait_idle()
        except TimeoutError:
            log.warning("drain_timeout", in_flight=self.admission.in_flight, waiting=self.admission.waiting)

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
            self._watch = None
        await self._models.close()
        if self._background:
            await asyncio.wait(set(self._background), timeout=_ABORT_TIMEOUT_S)
        for task in list(self._background):
            task.cancel()
        channels = [ch for ch, _ in self._workers.values()]
        self._workers.clear()
        for ch in (*channels, self._gm_channel, self._pm_channel):
            if ch is not None:
                await ch.close()
        self._gm_channel = self._pm_channel = None

    async def health(self) -> dict[str, str]:
        """Serving status of each manager as this gateway sees it ("SERVING" when reachable)."""
        assert self._gm_channel is not None and self._pm_channel is not None, "Backend.start() first"
        gm, pm = await asyncio.gather(_probe(self._gm_channel), _probe(self._pm_channel))
        return {"global_manager": gm, "param_manager": pm}

    async def _watch_lost(self) -> None:
        """Follow the manager's cluster events for LOST instances, reconnecting with backoff
        (the manager restarts; one that does not implement the watch is asked again slowly)."""
        backoff_s = _WATCH_BACKOFF_MIN_S
        while True:
            call = self._gm().WatchEvents(admin_pb2.WatchEventsRequest())
            try:
                async for event in call:
                    backoff_s = _WATCH_BACKOFF_MIN_S
                    if event.action == _LOST_ACTION and event.instance_id:
                        self.instance_lost(event.instance_id, event.reason)
                    elif event.action == _REGISTERED_ACTION and event.instance_id:
                        self._incarnation[event.instance_id] = self._incarnation.get(event.instance_id, 0) + 1
                        self._reported.pop(event.instance_id, None)
            except grpc.aio.AioRpcError as e:
                log.info("cluster_watch_failed", code=e.code().name, details=e.details(), retry_s=backoff_s)
            except Exception:
                # A bug here must not end the watch for good: streams would hang until the stall timeout.
                log.exception("cluster_watch_crashed", retry_s=backoff_s)
            finally:
                call.cancel()
            await asyncio.sleep(backoff_s)
            backoff_s = min(_WATCH_BACKOFF_MAX_S, backoff_s * 2)

    def instance_lost(self, instance_id: str, reason: str) -> None:
        """End every stream open on `instance_id` now; each fails over like a worker failure."""
        guards = self._open.get(instance_id, set())
        if guards:
            log.warning("instance_lost_streams", instance_id=instance_id, streams=len(guards), reason=reason)
        for guard in list(guards):
            guard.fire(f"the global manager marked the instance LOST ({reason})")

    def report_failure(self, instance_id: str, code: grpc.StatusCode, detail: str) -> None:
        """Tell the manager (in the background) that `instance_id` failed a request, so it is
        routed around at once for every request, not only this one; at most one report per
        instance per `_REPORT_EVERY_S` (a dead instance breaks all its streams at once)."""
        if code not in _REPORTED or not instance_id:
            return
        now = time.monotonic()
        if now - self._reported.get(instance_id, -math.inf) < _REPORT_EVERY_S:
            return
        self._reported[instance_id] = now
        task = asyncio.get_running_loop().create_task(
            self._report(instance_id, f"{code.name}: {detail}"), name=f"report-{instance_id}"
        )
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _report(self, instance_id: str, reason: str) -> None:
        try:
            resp = await self._gm().ReportInstanceFailure(
                global_manager_pb2.ReportInstanceFailureRequest(
                    instance_id=instance_id, reason=reason[:500], reporter="gateway"
                ),
                timeout=_REPORT_TIMEOUT_S,
            )
            log.info("instance_failure_reported", instance_id=instance_id, known=resp.known, reason=reason)
        except grpc.aio.AioRpcError as e:
            # The manager restarting, or one too old for the RPC: the exclusion still holds here.
            log.info("instance_failure_report_failed", instance_id=instance_id, code=e.code().name)

    def _current(self, excluded: list[tuple[str, int]]) -> list[str]:
        """The exclusions that still hold: those of an instance not registered again since."""
        return [iid for iid, seen in excluded if self._incarnation.get(iid, 0) == seen]

    # ---- models ----------------------------------------------------------------------------

    async def list_models(self) -> list[ModelCard]:
        pm = self._pm()
        try:
            resp = await pm.ListModels(admin_pb2.ListModelsRequest(), timeout=self.config.rpc_timeout_s)
        except grpc.aio.AioRpcError as e:
            raise GatewayError(
                ErrorKind.UNAVAILABLE, f"parameter manager unreachable: {e.code().name}: {e.details()}"
            ) from e
        return [ModelCard(m.model_id, m.created_unix_s, m.max_context, m.num_layers) for m in resp.models]

    async def _fetch_model_files(self, model_id: str) -> dict[str, bytes]:
        pm = self._pm()
        try:
            resp = await pm.GetModelFiles(
                param_manager_pb2.GetModelRequest(model_id=model_id), timeout=self.config.rpc_timeout_s
            )
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                raise GatewayError(
                    ErrorKind.NOT_FOUND,
                    f"The model {quote(model_id)} does not exist (see GET /v1/models)",
                    param="model",
                    code="model_not_found",
                ) from e
            raise GatewayError(
                ErrorKind.UNAVAILABLE,
                f"cannot fetch the tokenizer of model {quote(model_id)} from the parameter manager:"
                f" {e.code().name}: {e.details()}",
            ) from e
        return dict(resp.files)

    def _pm(self) -> param_manager_pb2_grpc.ParamManagerStub:
        assert self.pm is not None, "Backend.start() first"
        return self.pm

    def _gm(self) -> global_manager_pb2_grpc.GlobalManagerStub:
        assert self.gm is not None, "Backend.start() first"
        return self.gm

    def _worker(self, address: str) -> worker_pb2_grpc.WorkerStub:
        entry = self._workers.get(address)
        if entry is None:
            ch = channel(address, roles.WORKER)
            entry = (ch, worker_pb2_grpc.WorkerStub(ch))
            self._workers[address] = entry
        return entry[1]

    # ---- the request path ------------------------------------------------------------------

    async def generate(self, req: InferenceRequest) -> AsyncGenerator[Event, None]:
        """Stream events for `req`: TokenDeltas then one Finish, or raise GatewayError.

        Errors raised before the first event are the request's status (400, 404, 429, 503...);
        once an event was yielded, the only error is MID_STREAM (or TIMEOUT). Closing the
        iterator early (client gone) cancels the worker call and aborts it there.
        """
        arrived_s = time.monotonic()
        outcome = "internal"
        sent_any = False
        finished = 0
        bound = log.bind(request_id=req.request_id, model=req.model, api=req.api)
        # Per choice: when its first token went out (TTFT counts from `arrived_s`), and the
        # attainment of each finished choice when the request has an SLO.
        first_token_s: dict[int, float] = {}
        attained: list[SLOAttainment] = []
        try:
            validate_request(req)
            req = replace(req, slo=resolve_slo(self.config, req), arrived_s=arrived_s)
            if req.n > self.config.max_n:
                raise invalid(f"n must be at most max_n={self.config.max_n} on this gateway, got {quote(req.n)}", "n")
            assets = await self._models.get(req.model)
            _check_logit_bias(assets, req)
            prompt_ids = await self._tokenize(assets, req)
            max_tokens = _resolve_max_tokens(assets, req, len(prompt_ids), self.config.default_max_tokens)
            echo_text = _echo_text(assets, req, prompt_ids)
            async with self.admission.slot():
                self.metrics.queue_wait_s.observe(time.monotonic() - arrived_s)
                deadline_s = time.monotonic() + self.config.request_timeout_s
                job = Choice(req, assets, prompt_ids, max_tokens, deadline_s, bound, 0, echo_text)
                events = self._attempts(job) if req.n == 1 else self._fan_out(job)
                async with contextlib.aclosing(events):
                    async for event in events:
                        if not sent_any and isinstance(event, TokenDelta):
                            self.metrics.ttft_s.observe(time.monotonic() - arrived_s)
                        if isinstance(event, TokenDelta):
                            first_token_s.setdefault(event.index, time.monotonic())
                        if isinstance(event, Finish):
                            event = self._with_attainment(req, event, arrived_s, first_token_s, attained)
                            finished += 1
                            if finished == 1:  # the prompt is one prompt, however many choices
                                self.metrics.tokens.labels("prompt").inc(event.usage.prompt_tokens)
                            self.metrics.tokens.labels("completion").inc(event.usage.completion_tokens)
                            if finished == req.n:
                                outcome = event.finish_reason
                                total = combine_attainment(attained)
                                if total is not None:
                                    self.metrics.observe_slo(total)
                        sent_any = True
                        yield event
        except GatewayError as e:
            outcome = e.kind.metric_outcome
            server_side = e.kind in (ErrorKind.MID_STREAM, ErrorKind.INTERNAL, ErrorKind.TIMEOUT, ErrorKind.UNAVAILABLE)
            (bound.warning if server_side else bound.info)("request_failed", kind=e.kind.name, error=e.message)
            raise
        except (asyncio.CancelledError, GeneratorExit):
            # Closing the stream right after its Finish is the normal end, not a cancel.
            if outcome not in (FINISH_STOP, FINISH_LENGTH):
                outcome = "cancelled"
            raise
        except Exception as e:
            # A bug must still end the request with an answer, never a silent hang or cut.
            bound.exception("request_crashed")
            kind = ErrorKind.MID_STREAM if sent_any else ErrorKind.INTERNAL
            raise GatewayError(kind, f"internal error in the gateway ({type(e).__name__}: {e})") from e
        finally:
            self.metrics.requests.labels(req.api, outcome).inc()

    @staticmethod
    def _with_attainment(
        req: InferenceRequest,
        event: Finish,
        arrived_s: float,
        first_token_s: dict[int, float],
        attained: list[SLOAttainment],
    ) -> Finish:
        """The choice's Finish with its SLO attainment in its usage (unchanged without an SLO).
        TTFT: from the gateway accepting the request to the choice's first token sent; TPOT: the
        mean time per token after that one, up to the finish."""
        now_s = time.monotonic()
        first_s = first_token_s.get(event.index, now_s)
        tokens = event.usage.completion_tokens
        tpot_s = (now_s - first_s) / (tokens - 1) if tokens >= 2 else 0.0
        attainment = slo_attainment(req.slo, first_s - arrived_s, tpot_s, tokens)
        if attainment is None:
            return event
        attained.append(attainment)
        return replace(event, usage=replace(event.usage, slo=attainment))

    async def _tokenize(self, assets: ModelAssets, req: InferenceRequest) -> list[int]:
        if req.prompt_token_ids:
            ids = list(req.prompt_token_ids)
            vocab = assets.vocab_size
            if vocab is not None:
                bad = [t for t in ids if t >= vocab]
                if bad:
                    raise invalid(
                        f"prompt token id {bad[0]} is out of range for model {quote(req.model)} (vocab_size={vocab})",
                        "prompt",
                    )
            return ids
        try:
            # Off the event loop (the assets' thread pool), whatever the size.
            if req.messages:
                ids = await assets.encode_chat(req.messages)
            else:
                ids = await assets.encode_prompt(req.prompt or "")
        except GatewayError:
            raise
        except Exception as e:  # a template or tokenizer refusing this input is the client's problem
            param = "messages" if req.messages else "prompt"
            raise invalid(f"cannot tokenize the {param} for model {quote(req.model)}: {e}", param) from e
        if not ids:
            raise invalid("the prompt is empty (0 tokens after tokenization)", "prompt")
        return ids

    async def _fan_out(self, job: Choice) -> AsyncGenerator[Event, None]:
        """n > 1: one child request per choice, run as owned tasks; their events interleave.

        A choice failing before anything reached the client fails the request with its error;
        after that, the request ends with a MID_STREAM error naming the choice. Closing this
        generator cancels every child (each aborts its worker call)."""
        req = job.req
        queue: asyncio.Queue[tuple[int, Event | Exception | None]] = asyncio.Queue(maxsize=4 * req.n)

        async def run_choice(i: int) -> None:
            events = self._attempts(job.child(i))
            try:
                async with contextlib.aclosing(events):
                    async for event in events:
                        await queue.put((i, event))
            except Exception as e:  # handed to the consumer, which raises it
                await queue.put((i, e))
                return
            await queue.put((i, None))

        tasks = [asyncio.create_task(run_choice(i), name=f"choice-{req.request_id}-{i}") for i in range(req.n)]
        sent_any = False
        try:
            done = 0
            while done < req.n:
                i, item = await queue.get()
                if item is None:
                    done += 1
                elif isinstance(item, Exception):
                    if sent_any and not (
                        isinstance(item, GatewayError) and item.kind in (ErrorKind.MID_STREAM, ErrorKind.TIMEOUT)
                    ):
                        detail = item.message if isinstance(item, GatewayError) else f"{type(item).__name__}: {item}"
                        raise GatewayError(
                            ErrorKind.MID_STREAM,
                            f"choice {i} of request {req.request_id} failed after others streamed: {detail}",
                            code="choice_failed",
                        ) from item
                    raise item
                else:
                    sent_any = True
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _attempts(self, job: Choice) -> AsyncGenerator[Event, None]:
        """Run one choice to its end across instances: schedule a route, plan the attempt on it
        (`attempts.plan_attempt`), stream it, and on a worker's failure decide what comes next
        (`attempts.decide`) and apply the verdict.

        An instance failing before the first token is excluded and the request re-routed (up to
        `retries_before_first_token`). One failing after it (death, hang, drain) is excluded and
        the stream *migrates*: another instance resumes from the prompt plus the tokens generated
        so far, and the client's stream goes on with no token repeated or missing (up to
        `max_migrations`; beyond that, or with no instance left, a MID_STREAM error)."""
        state = _StreamState(job.text())
        attempt = AttemptState()
        limits = AttemptLimits(self.config.retries_before_first_token, self.config.max_migrations)
        prefix_hashes = self._prefix_hashes(job.prompt_ids)
        while True:
            try:
                hops = await self._schedule(
                    job,
                    [*self._current(attempt.excluded), *attempt.released],
                    attempt.failures,
                    prefix_hashes,
                    wait=attempt.schedule_waits(len(state.generated)),
                )
            except GatewayError as e:
                failed = ScheduleFailed(len(state.generated), timeout=e.kind == ErrorKind.TIMEOUT, error=e)
                error = self._error_for(decide(attempt, failed, limits), failed, job.req, limits)
                if error is e:
                    raise  # Schedule's own error is the answer
                raise error from None
            attempt = attempt.routed()
            plan = plan_attempt(hops, len(state.generated), state.handoff)
            state.handoff = None  # a live-migrated stream's KV goes to this attempt only
            run = _AttemptRun()
            try:
                async with contextlib.aclosing(self._run_plan(job, plan, state, run)) as events:
                    async for event in events:
                        yield event
                return
            except _WorkerFailedError as f:
                failed = f.outcome(self._incarnation.get(f.instance_id, 0))
                verdict = decide(attempt, failed, limits)
                attempt = verdict.state
                if verdict.report:
                    self.report_failure(f.instance_id, f.code, f.detail)
                if isinstance(verdict, Fail):
                    raise self._error_for(verdict, failed, job.req, limits) from None
                self._log_verdict(verdict, failed, job.bound, limits)
            finally:
                self._end_attempt(run, state, job.req.request_id)

    def _prefix_hashes(self, prompt_ids: list[int]) -> list[int]:
        """The prompt's first KV blocks, for the manager to route to an instance that has them cached."""
        try:
            return block_hashes(
                prompt_ids, self.config.kv_block_size_tokens, max_blocks=self.config.prefix_routing_max_blocks
            )
        except ValueError:
            return []  # a token id past 2**32: the worker refuses it against its vocabulary

    def _error_for(
        self, verdict: Decision, failed: Outcome, req: InferenceRequest, limits: AttemptLimits
    ) -> GatewayError:
        assert isinstance(verdict, Fail), verdict
        return error_for(verdict, failed, req, limits, self.config.request_timeout_s)

    async def _run_plan(
        self, job: Choice, plan: AttemptPlan, state: _StreamState, run: _AttemptRun
    ) -> AsyncGenerator[Event, None]:
        """One attempt, by its plan: the ZigZag loading instance's first layers in the background;
        the prefill instance until it hands the prompt's KV off (disaggregated); then the hop that
        streams to the end (after a failure, a disaggregated route resumes on its decode instance,
        which recomputes the prompt and the tokens so far)."""
        zigzag_source = None
        if plan.relay is not None:
            # ZigZag: the loading instance runs the prompt's first layers while the full
            # partner is busy; the partner takes the request over (its KV and hidden
            # states) when it admits the request, then streams the tokens. In a
            # disaggregated deployment the partner is a prefill instance, which then
            # hands the whole prompt's KV to the route's decode instance.
            new, partner = plan.relay
            run.first_hop = self._start_first_hop(job, new, partner)
            zigzag_source = worker_pb2.ZigzagSource(
                instance_id=new.instance_id, dataplane_address=new.dataplane_address
            )
        kv_source = plan.kv_source
        if plan.prefill is not None:
            # Disaggregated: the prompt and the first token on the prefill instance,
            # which hands the prompt's KV to the decode instance for the rest.
            stream = self._stream(job, plan.prefill, state, handoff=True, zigzag_source=zigzag_source)
            zigzag_source = None
            async for event in stream:
                yield event
            if state.handoff is None:
                self.metrics.handoffs.labels("prefill_finished").inc()
                return
            self.metrics.handoffs.labels("handed_off").inc()
            kv_source, state.handoff = state.handoff, None
            run.handed_off_by, run.generated_before = plan.prefill, len(state.generated)
        stream = self._stream(job, plan.hop, state, kv_source=kv_source, zigzag_source=zigzag_source)
        async for event in stream:
            yield event

    def _start_first_hop(
        self, job: Choice, new: global_manager_pb2.RouteHop, partner: global_manager_pb2.RouteHop
    ) -> asyncio.Task[None]:
        self.metrics.zigzag.labels("routed").inc()
        task = asyncio.create_task(self._zigzag_first_hop(job, new, partner), name=f"zigzag-{job.req.request_id}")
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def _end_attempt(self, run: _AttemptRun, state: _StreamState, request_id: str) -> None:
        if run.first_hop is not None and not run.first_hop.done():
            # The partner has taken the request over (its first hop ends by itself), or
            # failed, or the client left: the loading instance's part is aborted there.
            run.first_hop.cancel()
        if run.handed_off_by is not None and len(state.generated) == run.generated_before:
            # The decode instance produced nothing (it failed, or the client left): the
            # prefill instance frees the KV it offered now rather than when it expires.
            self._abort_later(run.handed_off_by.address, request_id)

    def _log_verdict(
        self,
        verdict: Decision,
        f: WorkerFailed,
        bound: structlog.typing.FilteringBoundLogger,
        limits: AttemptLimits,
    ) -> None:
        """The metrics and the log line of a verdict the choice goes on after."""
        resumed = f.generated
        if isinstance(verdict, Move):
            self.metrics.moves.labels(verdict.reason).inc()
            bound.info("moved", instance_id=f.instance_id, reason=verdict.reason, resumed_tokens=resumed)
        elif isinstance(verdict, Retry):
            # Refused for its SLO before its first token: one other instance may have
            # room (the manager prefers those whose estimate meets it); after that the
            # client hears 429 with Retry-After rather than waiting on a busy cluster.
            self.metrics.retries.labels(f.code.name).inc()
            bound.info("slo_refused_rerouting", instance_id=f.instance_id, slo=f.slo_kind, detail=f.detail)
        elif isinstance(verdict, Migrate):
            self.metrics.migrations.labels(f.code.name).inc()
            where = {"resumed_tokens": resumed, "migration": verdict.state.migrations}
            bound.warning("migrating", instance_id=f.instance_id, code=f.code.name, detail=f.detail, **where)
        elif isinstance(verdict, Wait):
            self.metrics.retries.labels(f.code.name).inc()
            where = {"attempt": verdict.state.retries, "attempts": 1 + limits.retries_before_first_token}
            bound.warning(
                "retry_before_first_token", instance_id=f.instance_id, code=f.code.name, detail=f.detail, **where
            )

    async def _schedule(
        self,
        job: Choice,
        excluded: list[str],
        failures: Sequence[str],
        prefix_hashes: list[int] | None = None,
        *,
        wait: bool = True,
    ) -> list[global_manager_pb2.RouteHop]:
        req, deadline_s = job.req, job.deadline_s
        remaining_s = deadline_s - time.monotonic()
        if remaining_s <= 0:
            raise GatewayError(
                ErrorKind.TIMEOUT,
                f"request {req.request_id} exceeded request_timeout_s={self.config.request_timeout_s}",
            )
        started_s = time.monotonic()
        try:
            route = await self._schedule_rpc(job, excluded, prefix_hashes, wait=wait)
        except grpc.aio.AioRpcError as e:
            code, detail = e.code(), e.details() or ""
            if code == grpc.StatusCode.NOT_FOUND:
                raise GatewayError(
                    ErrorKind.NOT_FOUND,
                    f"The model {quote(req.model)} does not exist or is not served ({detail})",
                    param="model",
                    code="model_not_found",
                ) from e
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise GatewayError(
                    ErrorKind.OVERLOADED, f"cluster overloaded: {detail}", code="cluster_overloaded"
                ) from e
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                raise invalid(f"the scheduler rejected the request: {detail}") from e
            earlier = f"; before that: {'; '.join(failures)}" if failures else ""
            waited_s = time.monotonic() - started_s
            bound_by = (
                f"its deadline (request_timeout_s={self.config.request_timeout_s})"
                if time.monotonic() >= deadline_s - 0.01
                else f"schedule_wait_s={self.config.schedule_wait_s}"
            )
            raise GatewayError(
                ErrorKind.UNAVAILABLE,
                f"no instance available for model {quote(req.model)}: waited {waited_s:.1f} s (up to {bound_by})"
                f" for a SERVING instance; the global manager's last answer: {code.name}: {detail}{earlier}",
                code="no_instance",
            ) from e
        if not route.hops:
            raise GatewayError(
                ErrorKind.UNAVAILABLE, f"the global manager returned an empty route for model {quote(req.model)}"
            )
        return list(route.hops)

    async def _schedule_rpc(
        self,
        job: Choice,
        excluded: list[str],
        prefix_hashes: list[int] | None = None,
        *,
        wait: bool = True,
    ) -> global_manager_pb2.Route:
        """Schedule, retried on UNAVAILABLE (manager restarting, no SERVING instance yet) with
        capped backoff for up to `schedule_wait_s` (not at all with `wait=False`), never past the
        request's deadline. A re-route
        after a worker failure (`excluded` not empty) and a migrating stream wait the same way:
        the instance that failed was maybe the only one, and capacity comes back (a restart, a
        scale-from-zero onto an idle worker) within about a model load."""
        req, deadline_s = job.req, job.deadline_s
        request = global_manager_pb2.ScheduleRequest(
            request_id=req.request_id,
            model_id=req.model,
            prompt_tokens=len(job.prompt_ids),
            max_tokens=job.max_tokens,
            exclude_instance_ids=excluded,
            prefix_block_hashes=prefix_hashes or (),
        )
        if not req.slo.is_empty:
            request.slo.CopyFrom(request_slo_to_proto(req.slo.ttft_s, req.slo.tpot_s))
        give_up_s = min(deadline_s, time.monotonic() + (self.config.schedule_wait_s if wait else 0.0))
        backoff_s = 0.05
        waited = 0
        while True:
            remaining_s = deadline_s - time.monotonic()
            try:
                route: global_manager_pb2.Route = await self._gm().Schedule(
                    request, timeout=max(0.001, min(self.config.rpc_timeout_s, remaining_s))
                )
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() + backoff_s >= give_up_s:
                    raise
                waited += 1
                if waited == 1:
                    log.info("schedule_waiting", request_id=req.request_id, model=req.model, detail=e.details())
                await asyncio.sleep(backoff_s)
                backoff_s = min(_SCHEDULE_BACKOFF_MAX_S, backoff_s * 2)
                continue
            if waited:
                log.info("schedule_waited", request_id=req.request_id, model=req.model, retries=waited)
            return route

    async def _stream(
        self,
        job: Choice,
        hop: global_manager_pb2.RouteHop,
        state: _StreamState,
        *,
        handoff: bool = False,
        kv_source: kv_pb2.KVTransferDescriptor | None = None,
        zigzag_source: worker_pb2.ZigzagSource | None = None,
    ) -> AsyncGenerator[Event, None]:
        """One attempt on one instance, continuing `state` (the tokens earlier instances generated
        are resumed there); raises _WorkerFailedError on any worker-side failure.

        `handoff` (a prefill instance): the stream may end, after the first token, with the
        request's KV handed off (`state.handoff` set, no Finish). `kv_source` (a decode
        instance): it pulls the prompt's KV from there instead of computing it.

        The echoed prompt (and the prompt log-probs) go out with the first token, so a worker
        failing before it still leaves the request free to be re-routed. Each message is read
        (`_read`: the stall watchdog), classified (`replies.classify`) and its tokens added to
        the choice's text (`_take`); then this sends the delta and ends on a hand-off or a finish."""
        request = worker_request(
            job.req,
            hop,
            job.prompt_ids,
            job.max_tokens,
            state.generated,
            handoff=handoff,
            kv_source=kv_source,
            zigzag_source=zigzag_source,
        )
        call = self._open_call(job, hop, request, handoff)
        try:
            try:
                while (msg := await self._read(call, state)) is not grpc.aio.EOF:
                    tokens, piece = self._take(call, state, msg)
                    if piece.worth_sending(tokens.ids, job.req.return_token_ids):
                        yield TokenDelta(
                            piece.text,
                            tokens.ids,
                            call.instance,
                            job.index,
                            piece.logprobs,
                            piece.prompt_logprobs,
                            completion_tokens=len(state.generated),
                            prompt_tokens=len(job.prompt_ids),
                            cached_tokens=state.cached_tokens,
                        )
                    if isinstance(tokens, HandedOff) and not piece.matched:
                        # The prefill instance's part is done; its stream ends right after this.
                        call.done = True
                        state.handoff = tokens.kv
                        call.rpc.cancel()
                        return
                    ending = tokens.finish(
                        piece.matched, len(state.generated), len(job.prompt_ids), state.cached_tokens
                    )
                    if ending is not None:
                        call.done = tokens.finished
                        yield Finish(*ending, call.instance, job.index)
                        return
            except grpc.aio.AioRpcError as e:
                call.done = True
                raise await self._rpc_failure(call, e, len(state.generated)) from None
            call.done = True
            raise call.failed(
                grpc.StatusCode.UNAVAILABLE, "the token stream ended without a finish_reason", len(state.generated)
            )
        finally:
            await self._close_call(call, job.req.request_id)

    def _open_call(
        self, job: Choice, hop: global_manager_pb2.RouteHop, request: worker_pb2.WorkerGenerateRequest, handoff: bool
    ) -> _Call:
        """Start the Worker.Generate call of one attempt (with an ESP group's other members
        called alongside, services/gateway/esp.py) and follow its instance for LOST events."""
        stub = self._worker(hop.address)
        guard = _LostGuard()
        holders = None
        if hop.HasField("esp"):
            # An ESP group's master: the other members are called alongside.
            timeout_s = max(job.deadline_s - time.monotonic(), 0.001)
            holders = esp.start_holders(hop.esp, request, self._worker, timeout_s, self.report_failure, guard.fire)
            request.esp_member.CopyFrom(esp.member_spec(hop.esp, len(hop.esp.members) - 1))
            self.metrics.esp_groups.labels(str(len(hop.esp.members))).inc()
        rpc = stub.Generate(request, timeout=max(job.deadline_s - time.monotonic(), 0.001))
        guards = self._open.setdefault(hop.instance_id, set())
        guards.add(guard)
        stall_s = self.config.token_stall_timeout_s or None
        return _Call(hop, rpc, guard, guards, stall_s, handoff=handoff, holders=holders)

    async def _read(self, call: _Call, state: _StreamState) -> Any:
        """The call's next message (or EOF). None came within `token_stall_timeout_s` of the last
        one (the timeout starts with the instance's first message), or the cluster-event watch
        marked the instance LOST: the instance's failure (UNAVAILABLE)."""
        msg = None
        try:
            async with asyncio.timeout(call.stall_s if call.got_any else None) as call.guard.timeout:
                if call.guard.lost is None:
                    msg = await call.rpc.read()
        except TimeoutError:
            pass  # stalled, or the watch fired the guard: msg stays None
        finally:
            call.guard.timeout = None
        if msg is None:
            raise _WorkerFailedError(
                call.holders.lost_id or call.instance if call.holders is not None else call.instance,
                grpc.StatusCode.UNAVAILABLE,
                call.guard.lost or f"no token for token_stall_timeout_s={self.config.token_stall_timeout_s}",
                len(state.generated),
            )
        if msg is not grpc.aio.EOF:
            call.got_any = True
        return msg

    def _take(self, call: _Call, state: _StreamState, msg: worker_pb2.WorkerGenerateResponse) -> tuple[Tokens, Piece]:
        """One message's tokens, counted as generated, and the text they add. A live migration,
        a bad message or malformed log-probs end the attempt (_WorkerFailedError); the tokens of
        such a message do not count."""
        reply = classify(msg, handoff=call.handoff, resumed=bool(state.generated))
        if isinstance(reply, Moved):
            # The next instance pulls the KV and goes on after the tokens so far.
            call.done = True
            state.handoff = reply.kv
            raise call.failed(grpc.StatusCode.ABORTED, reply.detail, len(state.generated), moved=reply.reason)
        if isinstance(reply, Bad):
            call.done = True
            raise call.failed(reply.code, reply.detail, len(state.generated))
        try:
            # Checked before the tokens count as generated: a malformed message is
            # the instance's failure, and the request resumes without it.
            logprobs, prompt_logprobs = state.text.logprobs(reply.ids, msg.logprobs, msg.prompt_logprobs)
        except ValueError as e:  # e.g. a worker too old to know log-probs sends none
            raise call.failed(grpc.StatusCode.INTERNAL, f"malformed log-probs: {e}", len(state.generated)) from None
        if reply.cached_tokens is not None:
            state.cached_tokens = reply.cached_tokens
        if reply.ids:
            now_s = time.monotonic()
            if state.last_s is not None:
                self.metrics.tbt_s.observe((now_s - state.last_s) / len(reply.ids))
            state.last_s = now_s
            state.generated.extend(reply.ids)
        return reply, state.text.feed(reply.ids, logprobs, prompt_logprobs, final=reply.finished)

    async def _rpc_failure(self, call: _Call, e: grpc.aio.AioRpcError, generated: int) -> _WorkerFailedError:
        """The worker ended the call with a status: on an ESP master, the holder that broke the
        group if one did; a move (rebalancing) or an SLO refusal as its trailing metadata says."""
        instance = call.instance
        if call.holders is not None:  # a holder that broke the group, not the master
            instance = await esp.failed_member(call.holders, instance, e.details() or "")
        trailing = dict(e.trailing_metadata() or ())
        slo_kind = trailing.get(SLO_METADATA_KEY) if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else None
        return _WorkerFailedError(
            instance,
            e.code(),
            e.details() or "",
            generated,
            moved=trailing.get(MOVED_METADATA_KEY),
            slo_kind=str(slo_kind) if slo_kind else None,
            retry_after_s=parse_retry_after_s(trailing.get(RETRY_AFTER_METADATA_KEY)),
        )

    async def _close_call(self, call: _Call, request_id: str) -> None:
        call.guards.discard(call.guard)
        if not call.guards:
            self._open.pop(call.hop.instance_id, None)
        if call.holders is not None and not call.done:
            call.holders.cancel()
        elif call.holders is not None:
            await esp.wait_holders(call.holders)
        if not call.done:
            # Client gone, a stop string matched, the instance stalled or was LOST: free its
            # KV now (a stopped instance frees it when it runs again and sees the cancel).
            call.rpc.cancel()
            self._abort_later(call.hop.address, request_id)

    async def _zigzag_first_hop(
        self, job: Choice, hop: global_manager_pb2.RouteHop, partner: global_manager_pb2.RouteHop
    ) -> None:
        """The loading instance's part of a ZigZag request: it runs the prompt's first layers
        until the partner relays it (the partner embeds the prompt while the loading instance has
        no embedding yet). Its failure costs nothing but speed: the partner then
        computes the prompt whole. Cancelled (the partner failed, the client left): aborted there."""
        req, max_tokens, bound = job.req, job.max_tokens, job.bound
        call = self._worker(hop.address).Generate(
            worker_pb2.WorkerGenerateRequest(
                request_id=req.request_id,
                model_id=req.model,
                prompt_token_ids=job.prompt_ids,
                sampling=sampling_to_proto(replace(req.sampling, max_tokens=max_tokens, stop=(), prompt_logprobs=None)),
                layer_start=hop.layer_start,
                layer_end=hop.layer_end,
                zigzag_first_layers=worker_pb2.ZigzagFirstLayersMode(
                    partner=worker_pb2.ZigzagSource(
                        instance_id=partner.instance_id, dataplane_address=partner.dataplane_address
                    )
                ),
            ),
            timeout=max(job.deadline_s - time.monotonic(), 0.001),
        )
        layers: int | None = None
        try:
            async for resp in call:
                if resp.HasField("zigzag_layers"):
                    layers = resp.zigzag_layers
            self.metrics.zigzag.labels("relayed" if layers else "none_ran").inc()
            bound.debug("zigzag_relayed", instance_id=hop.instance_id, layers=layers)
        except asyncio.CancelledError:
            self.metrics.zigzag.labels("cancelled").inc()
            call.cancel()
            self._abort_later(hop.address, req.request_id)
            raise
        except grpc.aio.AioRpcError as e:
            self.metrics.zigzag.labels("failed").inc()
            bound.info("zigzag_first_hop_failed", instance_id=hop.instance_id, code=e.code().name, detail=e.details())

    def _abort_later(self, address: str, request_id: str) -> None:
        task = asyncio.get_running_loop().create_task(self._abort(address, request_id), name=f"abort-{request_id}")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort(self, address: str, request_id: str) -> None:
        try:
            resp = await self._worker(address).Abort(
                worker_pb2.AbortRequest(request_id=request_id), timeout=_ABORT_TIMEOUT_S
            )
            log.debug("aborted", request_id=request_id, address=address, found=resp.found)
        except grpc.aio.AioRpcError as e:
            # The cancelled call already freed the KV; Abort is the belt to those braces.
            log.debug("abort_failed", request_id=request_id, address=address, code=e.code().name)


def resolve_slo(config: GatewayConfig, req: InferenceRequest) -> SLO:
    """The request's objectives, each kind on its own: the request's, else its model's default
    (`model_slo_defaults`), else the gateway's (`default_ttft_slo_s`, `default_tpot_slo_s`)."""
    model = config.model_slo_defaults.get(req.model)

    def pick(given: float | None, per_model: float | None, default: float | None) -> float | None:
        if given is not None:
            return given
        return per_model if per_model is not None else default

    return SLO(
        ttft_s=pick(req.slo.ttft_s, model.ttft_s if model else None, config.default_ttft_slo_s),
        tpot_s=pick(req.slo.tpot_s, model.tpot_s if model else None, config.default_tpot_slo_s),
    )


# A TTFT budget the gateway has already spent (queue, tokenizer, a refused attempt) still goes to
# the worker as this much: it must refuse it (or serve it at once), never read it as "no objective".
_MIN_TTFT_BUDGET_S = 1e-3


def worker_slo(req: InferenceRequest, *, resumed: bool, now_s: float | None = None) -> common_pb2.RequestSLO | None:
    """The objectives a worker schedules by. TTFT: what is left of the request's budget (the
    engine counts from its own arrival; the gateway counted from accepting the request), and
    none once tokens exist (a resumed stream's first token went out long ago). None without any."""
    ttft_s = req.slo.ttft_s
    if ttft_s is not None:
        if resumed:
            ttft_s = None
        elif req.arrived_s is not None:
            elapsed_s = (time.monotonic() if now_s is None else now_s) - req.arrived_s
            ttft_s = max(ttft_s - elapsed_s, _MIN_TTFT_BUDGET_S)
    if ttft_s is None and req.slo.tpot_s is None:
        return None
    return request_slo_to_proto(ttft_s, req.slo.tpot_s)


def worker_request(
    req: InferenceRequest,
    hop: global_manager_pb2.RouteHop,
    prompt_ids: list[int],
    max_tokens: int,
    resume: list[int],
    *,
    handoff: bool = False,
    kv_source: kv_pb2.KVTransferDescriptor | None = None,
    zigzag_source: worker_pb2.ZigzagSource | None = None,
) -> worker_pb2.WorkerGenerateRequest:
    """The Worker.Generate request of one attempt on `hop`, resuming after the tokens `resume`
    (`generate_mode` for the other arguments). Stop strings are applied by the gateway, on text;
    the worker only sees token-level stops. Prompt log-probs went out with the first token: a
    resumed attempt does not ask again."""
    resume = list(resume)
    sampling = replace(
        req.sampling,
        max_tokens=max_tokens,
        stop=(),
        prompt_logprobs=None if resume else req.sampling.prompt_logprobs,
    )
    return worker_pb2.WorkerGenerateRequest(
        request_id=req.request_id,
        model_id=req.model,
        prompt_token_ids=prompt_ids,
        sampling=sampling_to_proto(sampling),
        layer_end=0,
        resume_token_ids=resume,
        **generate_mode(handoff=handoff, kv_source=kv_source, zigzag_source=zigzag_source),
        layer_start=hop.layer_start if zigzag_source is not None else 0,
        slo=worker_slo(req, resumed=bool(resume)),
    )


# The name tests/unit/test_slo_plumbing.py imports; the one error builder is `attempts.error_for`.
_slo_error = slo_error


def _resolve_max_tokens(assets: ModelAssets, req: InferenceRequest, prompt_tokens: int, default_max_tokens: int) -> int:
    """The completion budget: the request's, else the default capped by the context left."""
    context = assets.max_context
    requested = req.sampling.max_tokens
    if context is not None:
        if prompt_tokens >= context:
            raise invalid(
                f"This model's maximum context length is {context} tokens, but the prompt has {prompt_tokens}"
                " tokens; shorten the prompt",
                "prompt" if not req.messages else "messages",
                "context_length_exceeded",
            )
        if requested is not None and prompt_tokens + requested > context:
            raise invalid(
                f"This model's maximum context length is {context} tokens, but {prompt_tokens + requested} were"
                f" requested ({prompt_tokens} in the prompt + max_tokens={requested}); lower max_tokens or"
                " shorten the prompt",
                "max_tokens",
                "context_length_exceeded",
            )
    if requested is not None:
        return requested
    if context is not None:
        return min(default_max_tokens, context - prompt_tokens)
    return default_max_tokens


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice `index`: seed + index, wrapped into 64 bits (vLLM derives its n child
    requests' seeds the same way). Choice 0 is exactly the n=1 answer; unseeded stays unseeded."""
    if seed is None:
        return None
    return (seed + index - INT64_MIN) % 2**64 + INT64_MIN


def _check_logit_bias(assets: ModelAssets, req: InferenceRequest) -> None:
    vocab = assets.vocab_size
    if vocab is None:
        return  # the worker checks against the model's own vocabulary
    for token, _ in req.sampling.logit_bias:
        if token >= vocab:
            raise invalid(
                f"logit_bias token id {token} is out of range for model {quote(req.model)} (vocab_size={vocab})",
                "logit_bias",
            )


def _echo_text(assets: ModelAssets, req: InferenceRequest, prompt_ids: list[int]) -> str | None:
    """The text `echo` prepends: the prompt as given, or the decoded prompt token ids."""
    if not req.echo:
        return None
    return req.prompt if req.prompt is not None else assets.tokenizer.decode(prompt_ids)


async def _probe(ch: grpc.aio.Channel) -> str:
    try:
        resp = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=_HEALTH_TIMEOUT_S
        )
    except grpc.aio.AioRpcError as e:
        return f"UNREACHABLE ({e.code().name})"
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))
