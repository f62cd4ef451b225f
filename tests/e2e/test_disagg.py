"""Prefill/decode disaggregation with real processes: a 1P+2D mesh gives a colocated mesh's greedy
tokens (the prompt's KV handed off over the data plane and pulled, not recomputed); a decode
worker SIGKILLed mid-stream migrates its stream; a prefill worker SIGKILLed while streams run
loses none, the manager serves one hop until it re-joins.

References come from a one-worker colocated mesh, started and stopped before the split one."""

from __future__ import annotations

import asyncio
import collections
import re
import signal
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass

import aiohttp
import grpc
import openai
import pytest
import pytest_asyncio

import blitzmesh
from blitzmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.common import roles
from services.common.waiting import wait_until
from services.mesh.launcher import Mesh, MeshConfig

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(180)]

MODEL = "tiny"
GREEDY = {"model": MODEL, "ignore_eos": True, "temperature": 0, "return_token_ids": True}

# Prompts of different lengths: inside one 16-token KV block, across a few, across many.
PROMPTS = (
    "Hi",
    "The quick brown fox jumps over the lazy dog.",
    "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen",
    " ".join(["the water of time and people who know the long way home"] * 16),
)
SHORT = 32  # tokens generated for each of PROMPTS

KILL_PROMPT = "Count forever"
KILL_TOKENS = 200  # at >= 5 ms a step (emulated pacing) the stream outlives the kill

WAVE_PROMPTS = tuple(f"stream {i}" for i in range(4))
WAVE_TOKENS = 120


@dataclass(frozen=True)
class Reference:
    token_ids: tuple[int, ...]
    text: str
    prompt_tokens: int


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def references(
    make_mesh_config: Callable[..., MeshConfig], tmp_path_factory: pytest.TempPathFactory
) -> dict[tuple[str, int], Reference]:
    """(prompt, max_tokens) -> the greedy completion of a colocated one-worker mesh, which is
    stopped before the split mesh starts (the box has two cores)."""
    wanted = [
        *((p, SHORT) for p in PROMPTS),
        (PROMPTS[1], 1),
        (KILL_PROMPT, KILL_TOKENS),
        *((p, WAVE_TOKENS) for p in WAVE_PROMPTS),
    ]
    mesh = Mesh(make_mesh_config(tmp_path_factory.mktemp("run-colocated"), workers=1))
    try:
        await mesh.start()
        async with blitzmesh.AsyncClient(mesh.gateway_grpc, timeout_s=120) as client:
            done = await asyncio.gather(*(client.complete(p, **GREEDY, max_tokens=n) for p, n in wanted))
    finally:
        await mesh.stop()
    for c in done:
        assert c.finish_reason == "length"
    return {key: Reference(c.token_ids, c.text, c.usage.prompt_tokens) for key, c in zip(wanted, done, strict=True)}


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def disagg_mesh(
    references: dict[tuple[str, int], Reference],
    make_mesh_config: Callable[..., MeshConfig],
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[Mesh]:
    """1 prefill + 2 decode workers; workers and manager export /metrics."""
    cfg = make_mesh_config(tmp_path_factory.mktemp("run-disagg"), workers=3, prefill=1, decode=2)
    cfg.worker_args = [*cfg.worker_args, "--metrics-port", "0"]
    cfg.manager_args = [*cfg.manager_args, "--metrics-port", "0"]
    m = Mesh(cfg)
    try:
        await m.start()
        yield m
    finally:
        await m.stop()


# ---- helpers -----------------------------------------------------------------------------------

_SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{([^}]*)\})? (\S+)$", re.M)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


async def _metric(url: str, name: str, **labels: str) -> float:
    """The sum of `name`'s samples at `url` whose labels include `labels` (0 if none)."""
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        assert r.status == 200, url
        text = await r.text()
    total = 0.0
    for sample, raw_labels, value in _SAMPLE.findall(text):
        if sample == name and labels.items() <= dict(_LABEL.findall(raw_labels)).items():
            total += float(value)
    return total


def _metrics_url(mesh: Mesh, name: str) -> str:
    return f"http://127.0.0.1:{mesh.procs[name].ports['metrics_port']}/metrics"


async def _gateway(mesh: Mesh, name: str, **labels: str) -> float:
    return await _metric(mesh.gateway_http + "/metrics", name, **labels)


async def _workers(mesh: Mesh, names: Iterable[str], name: str, **labels: str) -> float:
    return sum([await _metric(_metrics_url(mesh, w), name, **labels) for w in names])


def _split(mesh: Mesh) -> tuple[str, list[str]]:
    """(the prefill worker, the decode workers), as the mesh started them."""
    prefill = [w for w, role in mesh.roles.items() if role == "prefill"]
    decode = sorted(w for w, role in mesh.roles.items() if role == "decode")
    assert len(prefill) == 1 and len(decode) == 2, mesh.roles
    return prefill[0], decode


async def _status(mesh: Mesh, address: str) -> common_pb2.InstanceInfo | None:
    try:
        async with mesh.connect(address, roles.WORKER) as ch:
            return await worker_pb2_grpc.WorkerStub(ch).GetStatus(worker_pb2.GetStatusRequest(), timeout=5)
    except grpc.aio.AioRpcError:
        return None


async def _running(mesh: Mesh, name: str) -> int:
    info = await _status(mesh, mesh.procs[name].grpc_address)
    return 0 if info is None else info.load.running


async def _restart(mesh: Mesh, name: str, role: int) -> None:
    """Start a killed worker again; the manager loads it back into its pool."""
    proc = await mesh.restart(name)

    async def serving() -> bool:
        info = await _status(mesh, proc.grpc_address)
        return (
            info is not None
            and info.state == common_pb2.INSTANCE_STATE_SERVING
            and info.role == role
            and info.model_id == MODEL
        )

    await wait_until(serving, 60, interval_s=0.1, what=f"{name} to serve again")
    await mesh.wait_instances_serving(3, 30, roles={"prefill": 1, "decode": 2})


def _tokens(chunks: list[blitzmesh.TokenChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def _check(chunks: list[blitzmesh.TokenChunk], ref: Reference, max_tokens: int) -> None:
    assert _tokens(chunks) == list(ref.token_ids)
    assert "".join(c.text for c in chunks) == ref.text
    last = chunks[-1]
    assert last.finish_reason == "length" and last.usage is not None
    assert last.usage.completion_tokens == max_tokens and last.usage.prompt_tokens == ref.prompt_tokens


# ---- tests -------------------------------------------------------------------------------------


async def test_disaggregated_greedy_tokens_equal_colocated(
    references: dict[tuple[str, int], Reference], disagg_mesh: Mesh
) -> None:
    mesh = disagg_mesh
    prefill, decode = _split(mesh)
    lengths = [references[(p, SHORT)].prompt_tokens for p in PROMPTS]
    assert lengths == sorted(set(lengths)) and lengths[0] < 16 < lengths[2] and lengths[-1] > 8 * 16, lengths
    gm = _metrics_url(mesh, "global_manager")
    before = {
        "handed_off": await _gateway(mesh, "blitzmesh_gateway_kv_handoffs_total", outcome="handed_off"),
        "prefill_finished": await _gateway(mesh, "blitzmesh_gateway_kv_handoffs_total", outcome="prefill_finished"),
        "offered": await _workers(mesh, [prefill], "blitzmesh_worker_kv_handoffs_total", outcome="offered"),
        "pulled": await _workers(mesh, decode, "blitzmesh_worker_kv_handoffs_total", side="decode", outcome="pulled"),
        "recomputed": await _workers(mesh, decode, "blitzmesh_worker_kv_handoffs_total", outcome="recomputed"),
        "pd_pair": await _metric(gm, "blitzmesh_gm_schedule_total", outcome="pd_pair"),
    }

    openai_client = openai.AsyncOpenAI(base_url=mesh.gateway_http + "/v1", api_key="unused", max_retries=0, timeout=60)
    async with blitzmesh.AsyncClient(mesh.gateway_grpc, timeout_s=60, max_retries=0) as client:

        async def sdk(prompt: str, max_tokens: int) -> list[blitzmesh.TokenChunk]:
            return [c async for c in client.generate(prompt, **GREEDY, max_tokens=max_tokens)]

        async def http(prompt: str) -> str:
            done = await openai_client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=SHORT, temperature=0, extra_body={"ignore_eos": True}
            )
            assert done.choices[0].finish_reason == "length"
            return done.choices[0].text

        try:
            # One burst: each prompt twice through the SDK and once through the HTTP API.
            streams, texts, single = await asyncio.gather(
                asyncio.gather(*(sdk(p, SHORT) for p in (*PROMPTS, *PROMPTS))),
                asyncio.gather(*(http(p) for p in PROMPTS)),
                sdk(PROMPTS[1], 1),  # the first token ends it: nothing to hand off
            )
        finally:
            await openai_client.close()

    decoded_on: collections.Counter[str] = collections.Counter()
    for prompt, chunks in zip((*PROMPTS, *PROMPTS), streams, strict=True):
        _check(chunks, references[(prompt, SHORT)], SHORT)
        # The first token from the prefill worker, every later one from one decode worker.
        assert chunks[0].instance_id == prefill and len(chunks[0].token_ids) == 1, chunks[0]
        (decoder,) = {c.instance_id for c in chunks[1:]}
        assert decoder in decode
        decoded_on[decoder] += 1
    for prompt, text in zip(PROMPTS, texts, strict=True):
        assert text == references[(prompt, SHORT)].text, prompt
    _check(single, references[(PROMPTS[1], 1)], 1)
    assert {c.instance_id for c in single} == {prefill}
    assert set(decoded_on) == set(decode), decoded_on  # a burst is spread over both decode workers

    # Every split request handed its KV off and the decode side pulled it (nothing recomputed).
    split = len(streams) + len(texts)
    after_handed_off = await _gateway(mesh, "blitzmesh_gateway_kv_handoffs_total", outcome="handed_off")
    assert after_handed_off - before["handed_off"] == split
    finished = await _gateway(mesh, "blitzmesh_gateway_kv_handoffs_total", outcome="prefill_finished")
    assert finished - before["prefill_finished"] == 1
    offered = await _workers(mesh, [prefill], "blitzmesh_worker_kv_handoffs_total", outcome="offered")
    assert offered - before["offered"] == split
    pulled = await _workers(mesh, decode, "blitzmesh_worker_kv_handoffs_total", side="decode", outcome="pulled")
    assert pulled - before["pulled"] == split
    recomputed = await _workers(mesh, decode, "blitzmesh_worker_kv_handoffs_total", outcome="recomputed")
    assert recomputed == before["recomputed"]
    assert await _metric(gm, "blitzmesh_gm_schedule_total", outcome="pd_pair") - before["pd_pair"] >= split + 1


async def test_decode_worker_killed_mid_stream_openai_stream_completes(
    references: dict[tuple[str, int], Reference], disagg_mesh: Mesh
) -> None:
    mesh = disagg_mesh
    _, decode = _split(mesh)
    ref = references[(KILL_PROMPT, KILL_TOKENS)]
    migrations = await _gateway(mesh, "blitzmesh_gateway_migrations_total")
    client = openai.AsyncOpenAI(base_url=mesh.gateway_http + "/v1", api_key="unused", max_retries=0)
    text, chunks, killed, finish = "", 0, None, None
    try:
        stream = await client.completions.create(
            model=MODEL,
            prompt=KILL_PROMPT,
            max_tokens=KILL_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
            stream=True,
        )
        async with asyncio.timeout(60):
            async for chunk in stream:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
                chunks += 1
                # Past the hand-off, while the decode worker streams: kill it.
                if killed is None and chunks >= 5:
                    for name in decode:
                        if await _running(mesh, name) > 0:
                            killed = name
                            mesh.procs[name].process.send_signal(signal.SIGKILL)
                            break
    finally:
        await client.close()
    assert killed is not None
    assert text == ref.text and finish == "length"
    assert await _gateway(mesh, "blitzmesh_gateway_migrations_total") == migrations + 1
    await _restart(mesh, killed, common_pb2.INSTANCE_ROLE_DECODE)  # whole again for the next test


async def test_prefill_worker_killed_while_streams_run_loses_none(
    references: dict[tuple[str, int], Reference], disagg_mesh: Mesh
) -> None:
    mesh = disagg_mesh
    prefill, decode = _split(mesh)
    gm = _metrics_url(mesh, "global_manager")
    async with blitzmesh.AsyncClient(mesh.gateway_grpc, timeout_s=90, max_retries=0) as client:
        started: set[int] = set()

        async def run(i: int) -> list[blitzmesh.TokenChunk]:
            chunks = []
            async for chunk in client.generate(WAVE_PROMPTS[i % len(WAVE_PROMPTS)], **GREEDY, max_tokens=WAVE_TOKENS):
                chunks.append(chunk)
                started.add(i)
            return chunks

        def wave(ids: range) -> list[asyncio.Task[list[blitzmesh.TokenChunk]]]:
            return [asyncio.create_task(run(i)) for i in ids]

        def check(ids: range, streams: list[list[blitzmesh.TokenChunk]]) -> None:
            for i, chunks in zip(ids, streams, strict=True):
                _check(chunks, references[(WAVE_PROMPTS[i % len(WAVE_PROMPTS)], WAVE_TOKENS)], WAVE_TOKENS)

        # Streams decoding, more arriving (some on the prefill worker) when it is killed, and more
        # sent while the manager still routes to it: every one completes with its greedy tokens.
        decoding = wave(range(0, 6))
        await wait_until(lambda: len(started) == 6, 30, what="6 streams past their first token")
        arriving = wave(range(6, 12))
        await wait_until(lambda: started & set(range(6, 12)), 30, what="a second wave reaching the prefill worker")
        mesh.procs[prefill].process.send_signal(signal.SIGKILL)
        after = wave(range(12, 18))
        async with asyncio.timeout(90):
            streams = await asyncio.gather(*decoding, *arriving, *after)
        check(range(0, 18), streams)

        # Once the manager has lost the prefill worker it routes one hop to a decode worker.
        async def prefill_gone() -> bool:
            return all(i.state != "serving" for i in (await client.cluster()).instances if i.instance_id == prefill)

        await wait_until(prefill_gone, 30, interval_s=0.2, what=f"the manager to lose {prefill}")
        one_hop = await _metric(gm, "blitzmesh_gm_schedule_total", outcome="one_hop")
        handed_off = await _gateway(mesh, "blitzmesh_gateway_kv_handoffs_total", outcome="handed_off")
        streams = await asyncio.gather(*wave(range(18, 22)))
        check(range(18, 22), streams)
        assert all({c.instance_id for c in chunks} <= set(decode) for chunks in streams)
        assert await _metric(gm, "blitzmesh_gm_schedule_total", outcome="one_hop") - one_hop >= 4
        assert await _gateway(mesh, "blitzmesh_gateway_kv_handoffs_total", outcome="handed_off") == handed_off

        # Restarted, it re-joins the prefill pool and requests are split again.
        await _restart(mesh, prefill, common_pb2.INSTANCE_ROLE_PREFILL)
        # The gateway's channel to the old address may still be in reconnect backoff (capped at
        # 2 s) when the manager routes to it again: the first requests retry elsewhere, one hop.
        probe = references[(PROMPTS[1], 1)]

        async def split_again() -> bool:
            done = await client.complete(PROMPTS[1], **GREEDY, max_tokens=1)
            assert done.token_ids == probe.token_ids
            return done.instance_id == prefill

        await wait_until(split_again, 15, interval_s=0.2, what=f"requests to reach {prefill} again")
        handed_off = await _gateway(mesh, "blitzmesh_gateway_kv_handoffs_total", outcome="handed_off")
        streams = await asyncio.gather(*wave(range(22, 26)))
        check(range(22, 26), streams)
        assert all(chunks[0].instance_id == prefill for chunks in streams)
        handed_off_again = await _gateway(mesh, "blitzmesh_gateway_kv_handoffs_total", outcome="handed_off")
        assert handed_off_again - handed_off == 4
