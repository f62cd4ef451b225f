"""Elastic sequence parallelism as worker operations: a `Generate` in mode `esp_member` makes
this instance one member of an ESP group (services/worker/esp_exchange.py does the math over
the data plane), with the request's KV in the engine's own KV cache.

- **Join**: the member links to the others over the data plane. The worker's `GroupServer` owns
  `accept()`, so group connections (op `esp_prefill`) reach the member through `EspRouter`,
  queued by group until the member takes them.
- **Prefill a shard**: the member computes its slice and keeps that slice's KV (the paper's
  proactive scale-down: after the prefill nothing moves).
- **Serve as holder** (every member but the last): attend the master's queries to the slice
  until the master ends the request; the stream then ends with one message without tokens.
- **Decode as master** (the last member): sample (greedy or seeded, as the engine does, so the
  tokens are a single instance's), append each new token's KV to its slice, stream the tokens.
- **Scale up**: when the master's cache is full and the request names spares, the first spare
  joins as master (op `esp_join` on its data plane) and takes the new KV; the old master becomes
  one more holder and relays the new master's tokens, which ride in the step headers, to its own
  stream. No KV moves. A spare that fills up in turn hands over to the next spare the same way;
  the first master, which owns the stream, relays whichever master's tokens. Without a spare the
  request ends with RESOURCE_EXHAUSTED naming the group (with none left, with an error saying so).
- **End**: every member frees its blocks however the request ends; a member that goes away fails
  the others within the group's timeout (UNAVAILABLE), never a hang.

The ESP compute runs beside the engine's own steps: the prefill's layers on threads off the event
loop (so the group's transfers progress beside them), the decode steps on the event loop thread.
Its blocks count against the engine's free KV, so the engine admits around them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog
import torch

from blitzmesh.convert import finish_reason_to_proto
from blitzmesh.v1 import worker_pb2
from services.common.waiting import wait_for
from services.dataplane.chain import CONTROL_TAG, GroupServer
from services.dataplane.errors import DataPlaneError, ProtocolError
from services.dataplane.transport import Endpoint, Transport
from services.worker.convert import token_logprob_to_proto
from services.worker.engine.engine import Engine
from services.worker.engine.kv_cache import OutOfBlocks
from services.worker.engine.sampling import SamplingParams, TokenHistory, sample
from services.worker.esp_exchange import (
    ESP_OP,
    accept_master,
    connect_group,
    decode_master_step,
    end_decode,
    hand_over,
    join_as_master,
    prefill_member,
    serve_holder,
)
from services.worker.model.esp import Shard

log = structlog.get_logger()

ESP_JOIN_OP = "esp_join"
DEFAULT_TIMEOUT_S = 30.0


class EspError(Exception):
    """An ESP request cannot go on; `code` is the gRPC status its members answer with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class _Waiting:
    endpoint: Endpoint
    hello: dict[str, Any]
    taken: asyncio.Future[None]
    done: asyncio.Future[None]


class EspRouter:
    """Hands the ESP group connections this worker's `GroupServer` accepts to the member waiting
    for them, by group id. A connection no member takes within `wait_s` is dropped; a taken one
    stays open until its group ends here (`release`)."""

    def __init__(self, group_server: GroupServer, *, wait_s: float = DEFAULT_TIMEOUT_S) -> None:
        self._wait_s = wait_s
        self._queues: dict[str, asyncio.Queue[_Waiting]] = {}
        self._taken: dict[str, list[_Waiting]] = {}
        group_server.register_op(ESP_OP, self._serve)

    def _queue(self, group: str) -> asyncio.Queue[_Waiting]:
        return self._queues.setdefault(group, asyncio.Queue())

    async def _serve(self, ep: Endpoint, hello: dict[str, Any]) -> None:
        loop = asyncio.get_running_loop()
        w = _Waiting(ep, hello, loop.create_future(), loop.create_future())
        self._queue(str(hello.get("group"))).put_nowait(w)
        try:
            await wait_for(asyncio.shield(w.taken), self._wait_s)
        except TimeoutError:
            ep.abort()
            return
        await w.done

    def acceptor(self, group: str) -> Callable[[float], Any]:
        async def accept(timeout_s: float) -> tuple[Endpoint, dict[str, Any]]:
            queue = self._queue(group)
            while True:
                w = await wait_for(queue.get(), timeout_s)
                if not w.taken.done() and not w.endpoint.closed:
                    w.taken.set_result(None)
                    self._taken.setdefault(group, []).append(w)
                    return w.endpoint, w.hello

        return accept

    def release(self, group: str) -> None:
        """The group ended here: its connections close."""
        for w in self._taken.pop(group, []):
            if not w.done.done():
                w.done.set_result(None)
        queue = self._queues.get(group)
        if queue is not None and queue.empty():
            del self._queues[group]


def _sampling_to_json(params: SamplingParams) -> dict[str, Any]:
    return dataclasses.asdict(params)


def _sampling_from_json(obj: dict[str, Any]) -> SamplingParams:
    obj = dict(obj)
    obj["logit_bias"] = tuple((int(t), float(b)) for t, b in obj.get("logit_bias", ()))
    obj["stop_token_ids"] = tuple(obj.get("stop_token_ids", ()))
    return SamplingParams(**obj)


@dataclass
class _Sampler:
    """One request's token picking, the engine's way: its own generator (skipping the draws of
    tokens already sampled elsewhere) and history, its stop ids and max_tokens."""

    params: SamplingParams
    prompt: Sequence[int]
    vocab: int
    stop_ids: frozenset[int]
    output: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.generator = self.params.make_generator(skip=len(self.output))
        self.history = TokenHistory.create(self.params, self.prompt, self.vocab)
        if self.history is not None:
            for t in self.output:
                self.history.add(t)

    def pick(self, logits: torch.Tensor) -> tuple[int, float, Any]:
        out = sample(logits.unsqueeze(0), [self.params], [self.generator], [self.history])
        token = out.tokens[0]
        self.output.append(token)
        if self.history is not None:
            self.history.add(token)
        return token, out.logprobs[0], out.top_logprobs[0]

    def finish_reason(self) -> str | None:
        if self.output and self.output[-1] in self.stop_ids:
            return "stop"
        if len(self.output) >= self.params.max_tokens:
            return "length"
        return None


@dataclass
class EspEvent:
    """One message of a member's stream: a token (the master's), or the end of a holder's part."""

    token: int | None
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    logprob: float | None = None
    top_logprobs: Any = ()


async def _pace(engine: Engine, started_s: float, tokens: int) -> None:
    """With an emulated accelerator (the engine's `pacing`), an ESP step lasts at least what the
    engine's own step of `tokens` tokens would: members prefill their slices side by side, so a
    group's prefill takes one slice's time, not the prompt's."""
    pacing = engine.config.pacing
    if pacing is not None:
        left = pacing.step_time_s(tokens) - (time.monotonic() - started_s)
        if left > 0:
            await asyncio.sleep(left)


async def _end(ep: Endpoint, ok: bool) -> None:
    """Close a connection that ended well (UCX keeps its peer endpoint for later connections);
    abort one that did not."""
    if ok:
        await ep.close()
    else:
        ep.abort()


class EspWorker:
    """A worker's ESP operations (see the module docstring)."""

    def __init__(self, transport: Transport, group_server: GroupServer, engine: Callable[[], Engine | None]) -> None:
        self.transport = transport
        self.router = EspRouter(group_server)
        self._engine = engine
        self.groups: dict[str, dict[str, Any]] = {}  # group id -> what this member does there
        self.joined_total = 0
        self.scale_ups_total = 0
        group_server.register_op(ESP_JOIN_OP, self._serve_join)

    def kv_tokens(self) -> dict[str, int]:
        """Group id -> the KV tokens held here for it now (its heartbeat's `esp_group_kv_tokens`)."""
        out = {}
        for group, g in self.groups.items():
            shard = g.get("shard")
            out[group] = shard.num_tokens if shard is not None else int(g.get("kv_tokens", 0))
        return out

    def _serving_engine(self) -> Engine:
        engine = self._engine()
        if engine is None:
            raise EspError(grpc.StatusCode.UNAVAILABLE, "no model is SERVING here")
        return engine

    @staticmethod
    def _stop_ids(engine: Engine, params: SamplingParams) -> frozenset[int]:
        stop = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop |= engine.eos_token_ids
        return frozenset(stop)

    async def member(
        self,
        request_id: str,
        prompt: Sequence[int],
        params: SamplingParams,
        spec: worker_pb2.EspMember,
        resumed: Sequence[int] = (),
    ) -> AsyncIterator[EspEvent]:
        """This instance's part in the group `spec` names; see the module docstring. A request
        `resumed` after tokens generated elsewhere prefills them too, in the master's slice, and
        samples on from there (a seeded one skips their draws), as a resumed engine request does."""
        engine = self._serving_engine()
        model, cache = engine.model, engine.kv_cache
        n, j = len(spec.member_addresses), spec.index
        bounds = list(spec.bounds)
        if n < 1 or len(bounds) != n + 1 or not 0 <= j < n or bounds[-1] != len(prompt):
            raise EspError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"esp_member: index {j} and bounds {bounds} do not cut a prompt of {len(prompt)} tokens"
                f" among {n} member addresses",
            )
        bounds[-1] += len(resumed)
        sequence = [*prompt, *resumed]
        total = len(prompt) + params.max_tokens
        if total > model.config.max_context_tokens:
            raise EspError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
                f"the model's context of {model.config.max_context_tokens} tokens",
            )
        group = spec.group_id
        if not group:
            raise EspError(grpc.StatusCode.INVALID_ARGUMENT, "esp_member.group_id is empty")
        if group in self.groups:
            raise EspError(grpc.StatusCode.FAILED_PRECONDITION, f"this instance is already a member of {group!r}")
        timeout_s = spec.timeout_s or DEFAULT_TIMEOUT_S
        seq = f"esp/{group}/{request_id}"
        # The KV it holds for the group: its slice while it computes it, then its shard's tokens.
        self.groups[group] = {
            "request_id": request_id,
            "index": j,
            "size": n,
            "role": "member",
            "kv_tokens": bounds[j + 1] - bounds[j],
        }
        self.joined_total += 1
        links = None
        ok = False
        try:
            try:
                links = await connect_group(
                    self.transport,
                    j,
                    list(spec.member_addresses),
                    group,
                    timeout_s=timeout_s,
                    accept=self.router.acceptor(group),
                )
                started_s = time.monotonic()
                logits = await prefill_member(model, cache, links, seq, sequence, bounds, timeout_s=timeout_s)
                await _pace(engine, started_s, bounds[j + 1] - bounds[j])
            except ValueError as e:
                raise EspError(grpc.StatusCode.INVALID_ARGUMENT, f"ESP group {group!r}: {e}") from None
            except OutOfBlocks as e:
                raise EspError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED, f"ESP group {group!r}: member {j} has no room: {e}"
                ) from None
            shard = Shard(cache, seq, bounds[j], bounds[j + 1])
            self.groups[group]["shard"] = shard
            if j < n - 1:
                self.groups[group]["role"] = "holder"
                steps = await self._hold(model, shard, links.later[n - 1], group, timeout_s)
                ok = True
                yield EspEvent(None, None, len(prompt), steps)
                return
            self.groups[group]["role"] = "master"
            assert logits is not None
            sampler = _Sampler(params, prompt, model.config.vocab_size, self._stop_ids(engine, params), list(resumed))
            async for ev in self._master(engine, shard, dict(links.earlier), sampler, logits, spec, timeout_s):
                ok = ev.finish_reason is not None
                yield ev
        except (DataPlaneError, TimeoutError) as e:
            raise EspError(
                grpc.StatusCode.UNAVAILABLE, f"ESP group {group!r}: member {j} lost its group: {type(e).__name__}: {e}"
            ) from None
        finally:
            # A UCX abort tears down the one endpoint this process keeps to each peer (and the
            # peer's pair of it), so a group that ended well closes its connections instead.
            if links is not None and ok:
                await links.close()
            elif links is not None:
                links.abort()
            cache.free(seq)
            self.router.release(group)
            self.groups.pop(group, None)

    async def _hold(self, model: Any, shard: Shard, master: Endpoint, group: str, timeout_s: float) -> int:
        steps = 0
        while True:
            outcome, served = await serve_holder(model, shard, master, timeout_s=timeout_s)
            steps += served
            if outcome == "end":
                return steps
            master = await accept_master(self.transport, group, timeout_s=timeout_s, accept=self.router.acceptor(group))

    async def _master(
        self,
        engine: Engine,
        shard: Shard,
        holders: dict[int, Endpoint],
        sampler: _Sampler,
        logits: torch.Tensor,
        spec: worker_pb2.EspMember,
        timeout_s: float,
    ) -> AsyncIterator[EspEvent]:
        model, cache = engine.model, engine.kv_cache
        prompt_len = len(sampler.prompt)
        while True:
            token, lp, top = sampler.pick(logits)
            reason = sampler.finish_reason()
            yield EspEvent(token, reason, prompt_len, len(sampler.output), lp, top)
            if reason is not None:
                await end_decode(holders, timeout_s=timeout_s)
                return
            try:
                started_s = time.monotonic()
                logits = await decode_master_step(model, cache, shard, holders, token, timeout_s=timeout_s)
                await _pace(engine, started_s, 1)
            except OutOfBlocks:
                if not spec.spare_addresses:
                    raise EspError(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"ESP group {spec.group_id!r}: the master's KV is full after {shard.end} tokens"
                        " and the request names no spare instance to scale up to",
                    ) from None
                async for ev in self._scale_up(model, shard, holders, sampler, spec, timeout_s):
                    yield ev
                return

    async def _scale_up(
        self,
        model: Any,
        shard: Shard,
        holders: dict[int, Endpoint],
        sampler: _Sampler,
        spec: worker_pb2.EspMember,
        timeout_s: float,
    ) -> AsyncIterator[EspEvent]:
        """Hand the mastership to the first spare; serve it as one more holder and relay the
        tokens it reports in its step headers. When that master fills up in turn and hands over
        to the next spare, serve the next one the same way, to the end of the request."""
        group = spec.group_id
        await hand_over(holders, timeout_s=timeout_s)
        self.scale_ups_total += 1
        self.groups[group]["role"] = "holder (handed over)"
        ep = await self._send_join(
            spec.spare_addresses[0],
            group,
            [bytes(spec.member_addresses[i]) for i in sorted(holders)],
            [bytes(a) for a in spec.spare_addresses[1:]],
            sampler,
            shard.end,
            [],
            timeout_s,
        )
        ended = False
        try:
            while True:
                notes: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
                serving = asyncio.ensure_future(
                    serve_holder(model, shard, ep, timeout_s=timeout_s, on_header=notes.put_nowait)
                )
                try:
                    while True:
                        getter = asyncio.ensure_future(notes.get())
                        await asyncio.wait({getter, serving}, return_when=asyncio.FIRST_COMPLETED)
                        if not getter.done():
                            getter.cancel()  # a header put just before the holder returned stays queued
                            if notes.empty():
                                break
                            note = notes.get_nowait()
                        else:
                            note = getter.result()
                        if "error" in note:
                            raise EspError(grpc.StatusCode.UNAVAILABLE, f"ESP group {group!r}: {note['error']}")
                        for token in note.get("emit", ()):
                            sampler.output.append(int(token))
                            reason = note.get("finish") if note.get("end") else None
                            yield EspEvent(int(token), reason, len(sampler.prompt), len(sampler.output))
                        if note.get("end"):
                            await serving
                            ended = True
                            return
                    outcome, _ = serving.result()  # raises what ended it
                    if outcome != "handover":
                        raise ProtocolError(f"ESP group {group!r}: the new master ended without an end message")
                finally:
                    serving.cancel()
                # That master filled up and handed over to the next spare, which connects here.
                await _end(ep, True)
                ep = await accept_master(self.transport, group, timeout_s=timeout_s, accept=self.router.acceptor(group))
        finally:
            await _end(ep, ended)

    async def _send_join(
        self,
        spare: bytes,
        group: str,
        holders: list[bytes],
        spares: list[bytes],
        sampler: _Sampler,
        pos: int,
        emit: list[int],
        timeout_s: float,
    ) -> Endpoint:
        """Ask `spare` to become the request's master from position `pos` on, over `holders`
        (every holder but this instance, which serves it on the connection returned). `emit`:
        tokens sampled here that the request's stream has not had yet (the new master sends them
        in its first step header). The join names this instance's address, so that a later spare
        connects here too."""
        ep = await self.transport.connect(spare, timeout_s=timeout_s)
        join = {
            "op": ESP_JOIN_OP,
            "group": group,
            "holders": [a.hex() for a in holders],
            "from": self.transport.address().hex(),
            "spares": [a.hex() for a in spares],
            "prompt": list(sampler.prompt),
            "output": list(sampler.output),
            "emit": emit,
            "sampling": _sampling_to_json(sampler.params),
            "stop_ids": sorted(sampler.stop_ids),
            "pos": pos,
            "timeout_s": timeout_s,
        }
        try:
            await ep.send_msg(json.dumps(join).encode(), CONTROL_TAG, timeout_s=timeout_s)
        except BaseException:
            ep.abort()
            raise
        return ep

    async def _serve_join(self, ep: Endpoint, req: dict[str, Any]) -> None:
        """A spare's side of a scale-up: become the request's master over the holders named. When
        its own KV fills up and the join names more spares, hand over to the next one and serve
        it as one more holder."""
        group = str(req.get("group"))
        seq = f"esp/{group}/master"
        holders: dict[int, Endpoint] = {}
        engine: Engine | None = None
        ended = False
        try:
            engine = self._serving_engine()
            model, cache = engine.model, engine.kv_cache
            timeout_s = float(req.get("timeout_s") or DEFAULT_TIMEOUT_S)
            others = [bytes.fromhex(a) for a in req["holders"]]
            sampler = _Sampler(
                _sampling_from_json(req["sampling"]),
                [int(t) for t in req["prompt"]],
                model.config.vocab_size,
                frozenset(int(t) for t in req["stop_ids"]),
                [int(t) for t in req["output"]],
            )
            self.groups[group] = {"request_id": group, "index": len(others) + 1, "size": len(others) + 2}
            self.groups[group]["role"] = "master (scaled up)"
            self.joined_total += 1
            holders = await join_as_master(self.transport, others, group, timeout_s=timeout_s)
            holders[len(others)] = ep  # the old master, a holder now, on this connection
            pos = int(req["pos"])
            cache.allocate(seq, 0)
            shard = Shard(cache, seq, pos, pos)
            self.groups[group]["shard"] = shard
            token, emit = sampler.output[-1], [int(t) for t in req.get("emit", ())]
            while True:
                started_s = time.monotonic()
                try:
                    logits = await decode_master_step(
                        model, cache, shard, holders, token, timeout_s=timeout_s, note={"emit": emit}
                    )
                except OutOfBlocks:
                    spares = [bytes.fromhex(a) for a in req.get("spares", ())]
                    if not spares:
                        raise
                    await self._hand_on(model, shard, holders, ep, req, others, spares, sampler, emit, timeout_s)
                    ended = True
                    return
                await _pace(engine, started_s, 1)
                token, _, _ = sampler.pick(logits)
                emit = [token]
                reason = sampler.finish_reason()
                if reason is not None:
                    await end_decode(holders, timeout_s=timeout_s, note={"emit": emit, "finish": reason})
                    ended = True
                    return
        except OutOfBlocks:
            log.warning("esp scale-up master full", group=group)
            with contextlib.suppress(DataPlaneError):
                await end_decode(
                    holders or {0: ep},
                    note={"error": "the scaled-up master's KV is full too and the request names no further spare"},
                )
        except Exception as e:  # reported to the old master, which ends its stream with it
            log.warning("esp join failed", group=group, error=str(e))
            with contextlib.suppress(DataPlaneError):
                await end_decode({0: ep}, timeout_s=5, note={"error": f"the spare could not take over: {e}"})
        finally:
            for h in holders.values():
                if h is not ep:
                    await _end(h, ended)
            if engine is not None:
                engine.kv_cache.free(seq)
            self.router.release(group)
            self.groups.pop(group, None)

    async def _hand_on(
        self,
        model: Any,
        shard: Shard,
        holders: dict[int, Endpoint],
        ep: Endpoint,
        req: dict[str, Any],
        others: list[bytes],
        spares: list[bytes],
        sampler: _Sampler,
        emit: list[int],
        timeout_s: float,
    ) -> None:
        """A scaled-up master that filled up too: the next spare becomes master over every
        holder (the old masters included), this instance serves it its slice as one more holder
        to the end of the request, and `emit` (sampled here, not yet streamed) reaches the
        stream in the next master's first step header."""
        group = str(req["group"])
        await hand_over(holders, timeout_s=timeout_s)
        self.scale_ups_total += 1
        self.groups[group]["role"] = "holder (handed over)"
        # The old master that asked this instance to join holds a slice too; the next master
        # connects to it as to every other holder.
        nxt = await self._send_join(
            spares[0], group, [*others, bytes.fromhex(req["from"])], spares[1:], sampler, shard.end, emit, timeout_s
        )
        ok = False
        try:
            await self._hold(model, shard, nxt, group, timeout_s)
            ok = True
        finally:
            await _end(nxt, ok)


def event_to_proto(ev: EspEvent, params: SamplingParams) -> worker_pb2.WorkerGenerateResponse:
    msg = worker_pb2.WorkerGenerateResponse(
        token_ids=[ev.token] if ev.token is not None else [],
        prompt_tokens=ev.prompt_tokens,
        completion_tokens=ev.completion_tokens,
        cached_tokens=0,  # an ESP group computes the whole prompt: it has no prefix cache
    )
    if params.logprobs is not None and ev.token is not None and ev.logprob is not None:
        msg.logprobs.append(token_logprob_to_proto(ev.token, ev.logprob, ev.top_logprobs))
    if ev.finish_reason is not None:
        msg.finish_reason = finish_reason_to_proto(ev.finish_reason)
    return msg
