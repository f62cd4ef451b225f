"""The open-loop replay: sends each arrival at its time to the gateway's OpenAI HTTP API
(streaming), whatever happened to earlier ones, and records what every request saw; meanwhile
it samples the instance count through the Admin API and keeps the cluster's events.

Bounded: arrivals come from a bounded schedule, every request has a deadline, and requests
still open `drain_timeout_s` after the last arrival are cancelled and recorded as lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

import blitzmesh

from .schedule import Arrival
from .summary import InstanceSample, RequestRecord

__all__ = ["ReplayResult", "StreamState", "prompt_ids", "replay"]

# Ids 0..2 are <unk>, <s>, </s> in the synthetic tokenizers; prompts use ordinary ids after <s>.
BOS_ID = 1
FIRST_ORDINARY_ID = 3


def prompt_ids(n: int, vocab_size: int, rng: random.Random) -> list[int]:
    """A prompt of exactly n token ids: <s> and n-1 ordinary ids below `vocab_size`."""
    if n < 1:
        raise ValueError(f"a prompt needs at least 1 token, got {n!r}")
    if vocab_size <= FIRST_ORDINARY_ID:
        raise ValueError(f"vocab_size must be > {FIRST_ORDINARY_ID}, got {vocab_size!r}")
    return [BOS_ID] + [rng.randrange(FIRST_ORDINARY_ID, vocab_size) for _ in range(n - 1)]


@dataclass
class StreamState:
    """Folds a completion stream's SSE lines into a `RequestRecord`. Pure: times are passed in."""

    record: RequestRecord
    _first_s: float | None = None
    _last_s: float | None = None
    _max_gap_s: float = 0.0
    _chunks: int = 0

    def feed(self, line: str, now_s: float) -> bool:
        """One line of the body; True once the stream is over (finish, error or [DONE])."""
        line = line.strip()
        if not line.startswith("data:"):
            return False
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return True
        try:
            obj = json.loads(data)
        except ValueError:
            self._fail(f"unparseable stream chunk {data[:80]!r}", now_s)
            return True
        if "error" in obj:
            err = obj["error"] or {}
            self._fail(str(err.get("message") or err), now_s)
            return True
        usage = obj.get("usage")
        if usage:
            self.record.completion_tokens = int(usage.get("completion_tokens", 0))
            self._finish_tbt()
        for choice in obj.get("choices") or ():
            text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            if text:
                self._token(now_s)
            if choice.get("finish_reason"):
                self.record.finish_reason = choice["finish_reason"]
                self.record.outcome = "ok"
                self.record.end_s = now_s
        return False

    def _token(self, now_s: float) -> None:
        if self._first_s is None:
            self._first_s = now_s
            self.record.ttft_s = now_s - self.record.sent_s
        else:
            assert self._last_s is not None
            self._max_gap_s = max(self._max_gap_s, now_s - self._last_s)
        self._last_s = now_s
        self._chunks += 1
        self._finish_tbt()

    def _finish_tbt(self) -> None:
        # Mean time between tokens over the stream: usage gives the token count when some
        # tokens produced no text of their own (a multi-byte character split over tokens).
        tokens = max(self.record.completion_tokens, self._chunks)
        if self._first_s is not None and self._last_s is not None and tokens > 1:
            self.record.tbt_mean_s = (self._last_s - self._first_s) / (tokens - 1)
            self.record.tbt_max_s = self._max_gap_s

    def _fail(self, message: str, now_s: float) -> None:
        self.record.outcome = "error"
        self.record.error = message
        self.record.end_s = now_s


@dataclass
class ReplayResult:
    records: list[RequestRecord]
    instances: list[InstanceSample]
    events: list[dict[str, Any]]
    duration_s: float
    started_unix_s: float
    notes: list[str] = field(default_factory=list)


class _Clock:
    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self.t0


async def _send(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    arrival: Arrival,
    record: RequestRecord,
    ids: list[int],
    clock: _Clock,
    timeout_s: float,
) -> None:
    body = {
        "model": model,
        "prompt": ids,
        "max_tokens": arrival.output_tokens,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream_options": {"include_usage": True},
    }
    state = StreamState(record)
    record.sent_s = clock.now()
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(url, json=body) as resp:
                record.status = resp.status
                if resp.status != 200:
                    text = await resp.text()
                    try:
                        message = json.loads(text)["error"]["message"]
                    except (ValueError, KeyError, TypeError):
                        message = text[:200]
                    state._fail(f"HTTP {resp.status}: {message}", clock.now())
                    return
                async for raw in resp.content:
                    if state.feed(raw.decode("utf-8", "replace"), clock.now()):
                        break
    except TimeoutError:
        if record.outcome != "ok":  # no terminal event within the request's deadline
            record.outcome, record.error = "lost", f"no terminal event within {timeout_s}s"
    except aiohttp.ClientError as e:
        if record.outcome != "ok":
            state._fail(f"{type(e).__name__}: {e}", clock.now())


async def _sample_instances(
    admin: blitzmesh.AsyncClient,
    model: str,
    clock: _Clock,
    out: list[InstanceSample],
    period_s: float,
    notes: list[str],
) -> None:
    failures = 0
    while True:
        try:
            cluster = await admin.cluster(timeout_s=5)
            counts: dict[str, int] = {}
            loading: dict[str, float] = {}
            for inst in cluster.instances:
                if inst.model_id == model or inst.state in ("idle", "lost"):
                    counts[inst.state] = counts.get(inst.state, 0) + 1
                if inst.model_id == model and inst.state == "loading" and inst.num_layers > 0:
                    loading[inst.instance_id] = round(inst.layers_loaded / inst.num_layers, 3)
            out.append(InstanceSample(clock.now(), counts, loading))
        except blitzmesh.BlitzmeshError as e:
            failures += 1
            if failures == 1:
                notes.append(f"instance sampling failed at t={clock.now():.1f}s: {e}")
        await asyncio.sleep(period_s)


async def _watch(admin: blitzmesh.AsyncClient, clock: _Clock, out: list[dict[str, Any]]) -> None:
    with contextlib.suppress(blitzmesh.BlitzmeshError):
        async for ev in admin.watch_events():
            out.append(
                {
                    "t_s": round(clock.now(), 3),
                    "manager_time_s": ev.time_s,
                    "action": ev.action,
                    "target": ev.target,
                    "status": ev.status,
                    "reason": ev.reason,
                    "instance_id": ev.instance_id,
                }
            )


async def replay(
    arrivals: Sequence[Arrival],
    *,
    http_url: str,
    model: str,
    admin_target: str | None = None,
    sample_period_s: float = 0.5,
    request_timeout_s: float = 120.0,
    drain_timeout_s: float = 60.0,
    vocab_size: int = 2048,
    seed: int = 0,
) -> ReplayResult:
    """Replay `arrivals` against the gateway at `http_url` (e.g. http://127.0.0.1:8000)."""
    rng = random.Random(seed)
    prompts = [prompt_ids(a.prompt_tokens, vocab_size, rng) for a in arrivals]
    records = [RequestRecord(a.index, a.t_s, a.prompt_tokens, a.output_tokens) for a in arrivals]
    samples: list[InstanceSample] = []
    events: list[dict[str, Any]] = []
    notes: list[str] = []
    url = http_url.rstrip("/") + "/v1/completions"
    started_unix_s = time.time()
    clock = _Clock()
    background: list[asyncio.Task[None]] = []
    admin = blitzmesh.AsyncClient(admin_target, timeout_s=10, max_retries=1) if admin_target else None
    # No connection cap: an open loop must not queue in the client.
    connector = aiohttp.TCPConnector(limit=0)
    try:
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
            if admin is not None:
                background.append(
                    asyncio.create_task(_sample_instances(admin, model, clock, samples, sample_period_s, notes))
                )
                background.append(asyncio.create_task(_watch(admin, clock, events)))
            inflight: set[asyncio.Task[None]] = set()
            for arrival, record, ids in zip(arrivals, records, prompts, strict=True):
                delay = arrival.t_s - clock.now()
                if delay > 0:
                    await asyncio.sleep(delay)
                task = asyncio.create_task(_send(session, url, model, arrival, record, ids, clock, request_timeout_s))
                inflight.add(task)
                task.add_done_callback(inflight.discard)
            if inflight:
                _, pending = await asyncio.wait(set(inflight), timeout=drain_timeout_s)
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                if pending:
                    notes.append(f"{len(pending)} requests still open {drain_timeout_s}s after the last arrival")
            for r in records:
                if r.outcome == "lost" and not r.error:
                    r.error = "no terminal event before the replay ended"
            duration_s = clock.now()
    finally:
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        if admin is not None:
            await admin.close()
    return ReplayResult(records, samples, events, duration_s, started_unix_s, notes)
