"""ESP as worker operations: real workers (grpc.aio servers, TCP data plane, one process, each
with its own engine and KV pool) serve one request as a group, each called with `Generate` in
mode `esp_member`. The master's tokens equal one colocated worker's, greedy and seeded, for a
prompt that fits one instance and one that fits only the group; a full master scales up to a
spare, and a full spare to the next (also over UCX, one process per instance); a member that
goes away ends the request with UNAVAILABLE in time, blocks freed."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from prometheus_client import REGISTRY

from blitzmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.common.grpc_util import channel
from services.common.waiting import wait_until
from services.param_manager.service import ParamManagerService
from services.worker.config import WorkerConfig
from services.worker.service import WorkerService
from tests.integration.spawned import spawned
from tests.integration.test_param_worker import pm_config

pytestmark = pytest.mark.timeout(180)

Workers = dict[str, tuple[WorkerService, worker_pb2_grpc.WorkerStub]]


@contextlib.asynccontextmanager
async def esp_workers(tiny_models: Path, serve_in_process: Any, kv_tokens: dict[str, int]) -> AsyncIterator[Workers]:
    """A parameter manager and one loaded worker per entry of `kv_tokens` (id -> KV pool tokens)."""
    pm = ParamManagerService(pm_config(tiny_models))
    async with contextlib.AsyncExitStack() as stack:
        pm_ctx = await stack.enter_async_context(serve_in_process(pm, pm.servicer.config))
        out: Workers = {}
        for iid, tokens in kv_tokens.items():
            cfg = WorkerConfig(
                port=0, param_manager=pm_ctx.address, instance_id=iid, kv_cache_tokens=tokens, dataplane="tcp"
            )
            wk = WorkerService(cfg)
            ctx = await stack.enter_async_context(serve_in_process(wk, wk.cfg))
            ch = await stack.enter_async_context(channel(ctx.address))
            stub = worker_pb2_grpc.WorkerStub(ch)
            load = worker_pb2.LoadParametersRequest(model_id="tiny", instance_id=iid)
            assert [p async for p in stub.LoadParameters(load, timeout=60)][-1].done
            out[iid] = (wk, stub)
        yield out


def sampling(max_tokens: int, seed: int | None) -> common_pb2.SamplingParams:
    if seed is None:
        return common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return common_pb2.SamplingParams(temperature=0.9, top_p=0.9, seed=seed, max_tokens=max_tokens, ignore_eos=True)


def esp_request(
    rid: str, prompt: list[int], params: common_pb2.SamplingParams, member: worker_pb2.EspMember | None = None
) -> worker_pb2.WorkerGenerateRequest:
    req = worker_pb2.WorkerGenerateRequest(request_id=rid, model_id="tiny", prompt_token_ids=prompt, sampling=params)
    if member is not None:
        req.esp_member.CopyFrom(member)
    return req


async def collect(stream: Any) -> list[worker_pb2.WorkerGenerateResponse]:
    return [m async for m in stream]


async def run_group(
    ws: Workers,
    members: list[str],
    group: str,
    prompt: list[int],
    params: common_pb2.SamplingParams,
    bounds: list[int],
    spares: list[str] = (),  # type: ignore[assignment]
) -> list[list[worker_pb2.WorkerGenerateResponse]]:
    addresses = [ws[m][0].servicer.transport.address() for m in members]  # type: ignore[union-attr]
    spare_addresses = [ws[s][0].servicer.transport.address() for s in spares]  # type: ignore[union-attr]
    calls = [
        collect(
            ws[m][1].Generate(
                esp_request(
                    group,
                    prompt,
                    params,
                    worker_pb2.EspMember(
                        group_id=group,
                        index=j,
                        bounds=bounds,
                        member_addresses=addresses,
                        spare_addresses=spare_addresses,
                        timeout_s=10,
                    ),
                ),
                timeout=90,
            )
        )
        for j, m in enumerate(members)
    ]
    return await asyncio.gather(*calls)


def tokens_of(msgs: list[worker_pb2.WorkerGenerateResponse]) -> list[int]:
    return [t for m in msgs for t in m.token_ids]


def used_blocks(ws: Workers) -> dict[str, int]:
    return {iid: w.servicer.instance.engine.kv_cache.used_blocks for iid, (w, _) in ws.items()}  # type: ignore[union-attr]


@pytest.mark.parametrize("seed", [None, 7])
async def test_a_group_of_workers_gives_one_workers_tokens(
    tiny_models: Path, serve_in_process: Any, seed: int | None
) -> None:
    """Groups of 2 and 3 workers, greedy and seeded: the master streams one colocated worker's
    tokens; the holders' streams end with no token; every block is freed after."""
    async with esp_workers(tiny_models, serve_in_process, {"ref": 4096, "a": 512, "b": 512, "c": 512}) as ws:
        prompt = [1, *range(5, 82)]
        params = sampling(12, seed)
        want = tokens_of(await collect(ws["ref"][1].Generate(esp_request("whole", prompt, params), timeout=60)))
        assert len(want) == 12
        for members, bounds in ((["a", "b"], [0, 40, 78]), (["a", "b", "c"], [0, 20, 53, 78])):
            results = await run_group(ws, members, f"g{len(members)}-{seed}", prompt, params, bounds)
            *holders, master = results
            assert tokens_of(master) == want
            assert master[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert master[-1].completion_tokens == 12 and master[-1].prompt_tokens == 78
            for h in holders:
                assert len(h) == 1 and not h[0].token_ids and h[0].completion_tokens == 11
        await wait_until(lambda: set(used_blocks(ws).values()) == {0}, 10, what="every ESP block freed")


async def test_groups_sharing_members_with_different_masters_run_at_once(
    tiny_models: Path, serve_in_process: Any
) -> None:
    """Multi-master: three requests at once over the same workers, in groups that overlap with a
    different master each ([a, b] mastered by b, [b, a] by a, [a, b, c] by c), greedy and seeded.
    Every member holds slices of several requests and attends each master's queries to the
    right one: each master streams its request's colocated tokens."""
    async with esp_workers(tiny_models, serve_in_process, {"ref": 4096, "a": 512, "b": 512, "c": 512}) as ws:
        cases = [
            (["a", "b"], [1, *range(5, 70)], sampling(14, None), [0, 30, 66]),
            (["b", "a"], [1, *range(200, 251)], sampling(10, 3), [0, 26, 52]),
            (["a", "b", "c"], [1, *range(400, 489)], sampling(12, None), [0, 30, 60, 90]),
        ]
        want = [
            tokens_of(await collect(ws["ref"][1].Generate(esp_request(f"whole{i}", p, sp), timeout=60)))
            for i, (_, p, sp, _) in enumerate(cases)
        ]
        results = await asyncio.gather(
            *(run_group(ws, members, f"multi{i}", p, sp, bounds) for i, (members, p, sp, bounds) in enumerate(cases))
        )
        for i, ((members, _, sp, _), streams) in enumerate(zip(cases, results, strict=True)):
            *holders, master = streams
            assert tokens_of(master) == want[i], (i, members)
            assert master[-1].completion_tokens == sp.max_tokens
            assert all(len(h) == 1 and not h[0].token_ids for h in holders)
        await wait_until(lambda: set(used_blocks(ws).values()) == {0}, 10, what="every ESP block freed")


async def test_a_prompt_no_single_worker_can_hold_is_served_by_a_group(
    tiny_models: Path, serve_in_process: Any
) -> None:
    """Members of 48 KV tokens each: a 120-token prompt (2.5x one member's KV) is refused by
    one of them and served by a group of 3, with the tokens of a worker that holds it whole; the
    master fills up and the spare joins as master (scale-up during decode), no KV moved."""
    kv = {"ref": 4096, "a": 48, "b": 48, "c": 48, "spare": 48}
    async with esp_workers(tiny_models, serve_in_process, kv) as ws:
        prompt = [1, *range(5, 124)]
        params = sampling(20, None)
        want = tokens_of(await collect(ws["ref"][1].Generate(esp_request("whole", prompt, params), timeout=60)))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await collect(ws["a"][1].Generate(esp_request("alone", prompt, params), timeout=30))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "KV blocks" in str(refused.value.details())
        # 40 tokens each: the master's 3 blocks hold 8 more, then the spare takes the rest.
        a, b, c, spare = (ws[k][0].servicer.esp for k in ("a", "b", "c", "spare"))
        results = await run_group(ws, ["a", "b", "c"], "long", prompt, params, [0, 40, 80, 120], spares=["spare"])
        *holders, master = results
        assert tokens_of(master) == want and master[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert c.scale_ups_total == 1 and spare.joined_total == 1  # type: ignore[union-attr]
        assert [h[0].completion_tokens for h in holders] == [19, 19]
        assert a.joined_total == b.joined_total == 1  # type: ignore[union-attr]
        await wait_until(lambda: set(used_blocks(ws).values()) == {0}, 10, what="every ESP block freed")


@pytest.mark.parametrize("seed", [None, 7])
async def test_a_spare_that_fills_up_hands_over_to_the_next_spare(
    tiny_models: Path, serve_in_process: Any, seed: int | None
) -> None:
    """Two scale-ups in one request: the master fills after 8 tokens, the first spare (one
    16-token block) after 16 more, and the second spare decodes the rest. Every old master
    stays a holder of its own slice, no KV moves, and the stream has one worker's tokens."""
    kv = {"ref": 4096, "a": 48, "b": 48, "c": 48, "s1": 16, "s2": 48}
    async with esp_workers(tiny_models, serve_in_process, kv) as ws:
        prompt = [1, *range(5, 124)]
        params = sampling(40, seed)
        want = tokens_of(await collect(ws["ref"][1].Generate(esp_request("whole", prompt, params), timeout=60)))
        assert len(want) == 40
        c, s1, s2 = (ws[k][0].servicer.esp for k in ("c", "s1", "s2"))
        results = await run_group(
            ws, ["a", "b", "c"], f"chain-{seed}", prompt, params, [0, 40, 80, 120], spares=["s1", "s2"]
        )
        *holders, master = results
        assert tokens_of(master) == want and master[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert master[-1].completion_tokens == 40
        assert (c.scale_ups_total, s1.joined_total, s1.scale_ups_total, s2.joined_total) == (1, 1, 1, 1)  # type: ignore[union-attr]
        assert s2.scale_ups_total == 0  # type: ignore[union-attr]
        assert [h[0].completion_tokens for h in holders] == [39, 39]
        await wait_until(lambda: set(used_blocks(ws).values()) == {0}, 10, what="every ESP block freed")
        assert not any(ws[k][0].servicer.esp.groups for k in kv)  # type: ignore[union-attr]


async def test_the_last_spare_full_too_fails_clearly(tiny_models: Path, serve_in_process: Any) -> None:
    """The only spare fills up as well: the request ends with an error that says so, every
    block freed."""
    kv = {"a": 48, "b": 48, "c": 48, "s1": 16}
    async with esp_workers(tiny_models, serve_in_process, kv) as ws:
        prompt = [1, *range(5, 124)]
        results = await asyncio.gather(
            run_group(ws, ["a", "b", "c"], "full2", prompt, sampling(40, None), [0, 40, 80, 120], spares=["s1"]),
            return_exceptions=True,
        )
        err = results[0]
        assert isinstance(err, grpc.aio.AioRpcError), err
        assert "no further spare" in str(err.details()), err.details()
        await wait_until(lambda: set(used_blocks(ws).values()) == {0}, 20, what="every ESP block freed")


async def test_a_full_master_without_a_spare_fails_clearly(tiny_models: Path, serve_in_process: Any) -> None:
    async with esp_workers(tiny_models, serve_in_process, {"a": 48, "b": 48}) as ws:
        prompt = [1, *range(5, 84)]
        results = await asyncio.gather(
            run_group(ws, ["a", "b"], "full", prompt, sampling(20, None), [0, 40, 80]), return_exceptions=True
        )
        err = results[0]
        assert isinstance(err, grpc.aio.AioRpcError), err
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "no spare instance" in str(err.details())
        await wait_until(lambda: set(used_blocks(ws).values()) == {0}, 20, what="every ESP block freed")


async def test_a_member_that_goes_away_ends_the_request_with_unavailable(
    tiny_models: Path, serve_in_process: Any
) -> None:
    """A holder's call is cancelled mid-decode (its member leaves): the master's stream ends with
    UNAVAILABLE naming the group within the group's timeout, never hangs; blocks freed."""
    async with esp_workers(tiny_models, serve_in_process, {"a": 512, "b": 512}) as ws:
        prompt = [1, *range(5, 60)]
        addresses = [ws[m][0].servicer.transport.address() for m in ("a", "b")]  # type: ignore[union-attr]

        def member(j: int) -> worker_pb2.WorkerGenerateRequest:
            spec = worker_pb2.EspMember(
                group_id="kill", index=j, bounds=[0, 30, 56], member_addresses=addresses, timeout_s=5
            )
            return esp_request("kill", prompt, sampling(400, None), spec)

        holder = ws["a"][1].Generate(member(0), timeout=60)
        holder_task = asyncio.ensure_future(collect(holder))
        master_stream = ws["b"][1].Generate(member(1), timeout=60)
        got = 0
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            async for msg in master_stream:
                got += len(msg.token_ids)
                if got == 3:
                    # Mid-decode, each worker's heartbeat tells where the request's KV lies: the
                    # holder its slice, the master its slice and the tokens decoded so far.
                    reports = {k: ws[k][0].servicer.load_report() for k in ("a", "b")}  # type: ignore[union-attr]
                    assert reports["a"].esp_groups == ("kill",) and reports["a"].esp_group_kv_tokens == (30,)
                    assert reports["b"].esp_groups == ("kill",) and reports["b"].esp_group_kv_tokens[0] >= 26 + 2
                    # The metrics say it too (one registry in this process: the worker started last, b).
                    assert REGISTRY.get_sample_value("blitzmesh_worker_esp_groups") == 1
                    assert REGISTRY.get_sample_value("blitzmesh_worker_esp_kv_tokens") >= 26 + 2
                    holder.cancel()
        assert ended.value.code() == grpc.StatusCode.UNAVAILABLE and "'kill'" in str(ended.value.details())
        assert 3 <= got < 400
        with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
            await holder_task
        await wait_until(lambda: set(used_blocks(ws).values()) == {0}, 20, what="every ESP block freed")


# ---- one process per instance: UCX as well as TCP ------------------------------------------
# ucxx allows one worker per process, so the tests above (every worker in this process) run on
# TCP. Here each instance is a process of its own with the worker's ESP operations (`EspWorker`
# over its own transport and `GroupServer`, an engine's model and KV pool), which exercises the
# distributed decode and both scale-ups over either transport.


def _instance_process(path: str, kind: str, kv_tokens: int, conn: Any) -> None:
    """One instance: sends its data plane address, then either runs the member it is sent
    (`{"spec", "prompt", "max_tokens", "seed"}`; answers its tokens, or the error) or, sent None,
    serves as a spare until told to stop. Last it answers its counters and KV blocks in use."""
    from services.dataplane import make_transport
    from services.dataplane.chain import GroupServer
    from services.worker.engine.engine import Engine, EngineConfig
    from services.worker.engine.kv_cache import KVCache
    from services.worker.engine.sampling import SamplingParams
    from services.worker.esp_worker import EspError, EspWorker
    from services.worker.model.llama import load_model

    async def run() -> None:
        model = load_model(path)
        kv = KVCache.for_model(model.config, num_blocks=kv_tokens // 16, block_size=16, dtype=model.dtype)
        engine = Engine(model, kv, (0,), EngineConfig())
        async with make_transport(kind) as transport:
            server = GroupServer(transport)
            await server.start()
            esp = EspWorker(transport, server, lambda: engine)
            conn.send(transport.address())
            job = await asyncio.to_thread(conn.recv)
            if job is not None:
                spec = worker_pb2.EspMember.FromString(job["spec"])
                seed = job["seed"]
                params = SamplingParams(
                    temperature=0.0 if seed is None else 0.9,
                    top_p=1.0 if seed is None else 0.9,
                    seed=seed,
                    max_tokens=job["max_tokens"],
                    ignore_eos=True,
                )
                tokens, done = [], 0
                try:
                    async for ev in esp.member("r", job["prompt"], params, spec):
                        if ev.token is not None:
                            tokens.append(ev.token)
                        done = ev.completion_tokens
                    conn.send({"tokens": tokens, "completion_tokens": done})
                except EspError as e:
                    conn.send({"error": str(e)})
            await asyncio.to_thread(conn.recv)  # stop
            conn.send({"joined": esp.joined_total, "scale_ups": esp.scale_ups_total, "used_blocks": kv.used_blocks})
            await server.close()

    asyncio.run(run())


@pytest.mark.ucx
def test_two_scale_ups_over_ucx_with_each_instance_in_its_own_process(tiny_models: Path) -> None:
    """Over UCX (TCP: the in-process tests above), seeded: three members (48 KV tokens each) and
    two spares (16 and 48), one process each. The master fills after 8 tokens, the first spare
    after 16 more, the second decodes the rest. The master streams one instance's tokens, every
    block is freed, each spare joined once."""
    from services.worker.engine.sampling import SamplingParams, sample
    from services.worker.model.llama import load_model

    pytest.importorskip("ucxx")
    kind, seed = "ucx", 7
    path = str(tiny_models / "tiny")
    prompt, max_tokens = [1, *range(5, 124)], 40
    params = SamplingParams(
        temperature=0.0 if seed is None else 0.9,
        top_p=1.0 if seed is None else 0.9,
        seed=seed,
        max_tokens=max_tokens,
        ignore_eos=True,
    )
    model = load_model(path)
    ids, want, gen = list(prompt), [], params.make_generator()
    for _ in range(max_tokens):
        token = sample(model.forward(torch.tensor(ids))[-1:], [params], [gen]).tokens[0]
        want.append(token)
        ids.append(token)
    kv = [48, 48, 48, 16, 48]  # members a, b, c (the master), spares s1, s2
    with spawned(_instance_process, [(path, kind, n) for n in kv]) as pipes:
        for parent in pipes:
            assert parent.poll(90), "an instance did not start"
        addresses = [parent.recv() for parent in pipes]
        for j, parent in enumerate(pipes[:3]):
            spec = worker_pb2.EspMember(
                group_id="chain",
                index=j,
                bounds=[0, 40, 80, 120],
                member_addresses=addresses[:3],
                spare_addresses=addresses[3:],
                timeout_s=20,
            )
            parent.send({"spec": spec.SerializeToString(), "prompt": prompt, "max_tokens": max_tokens, "seed": seed})
        for parent in pipes[3:]:
            parent.send(None)
        streams = []
        for parent in pipes[:3]:
            assert parent.poll(120), "a member did not finish"
            streams.append(parent.recv())
        counters = []
        for parent in pipes:
            parent.send("stop")
            assert parent.poll(30), "an instance did not stop"
            counters.append(parent.recv())
    *holders, master = streams
    assert master == {"tokens": want, "completion_tokens": max_tokens}, master
    assert holders == [{"tokens": [], "completion_tokens": max_tokens - 1}] * 2
    assert [(c["joined"], c["scale_ups"]) for c in counters] == [(1, 0), (1, 0), (1, 1), (1, 1), (1, 0)]
    assert [c["used_blocks"] for c in counters] == [0] * 5
