"""ZigZag live scaling between real workers (grpc.aio servers, TCP data plane, one process): a
worker still LOADING (its parameters arrive over a slow link) runs the first layers of requests;
its full partner relays each over the data plane (the KV of those layers and the hidden states)
and finishes it with exactly the tokens of a whole run."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from blitzmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.common.grpc_util import channel
from services.common.waiting import wait_until
from services.model_format import synth
from services.param_manager.service import ParamManagerConfig, ParamManagerService
from services.worker.config import WorkerConfig
from services.worker.service import WorkerService
from services.worker.zigzag_pull import Peer

pytestmark = pytest.mark.timeout(120)

ServeFactory = Any  # tests/integration/conftest.py: serve_in_process
MODEL = "tiny6"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("zz-models")
    # The tiny preset with 6 layers: enough for a request to split in the middle.
    synth.synthesize(root / MODEL, "tiny", seed=0, overrides={"num_hidden_layers": 6})
    return root


def request(rid: str, prompt: list[int], **kw: Any) -> worker_pb2.WorkerGenerateRequest:
    return worker_pb2.WorkerGenerateRequest(
        request_id=rid,
        model_id=MODEL,
        prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        **kw,
    )


@contextlib.asynccontextmanager
async def pair(
    models: Path,
    serve_in_process: ServeFactory,
    link_gbps: float,
    *,
    decode: bool = False,
    old: dict[str, Any] | None = None,
) -> AsyncIterator[dict[str, Any]]:
    """A parameter manager behind a slow link, a full worker (loaded first, its config with the
    fields in `old`; with `decode`, a full decode worker too) and a second worker whose load is
    left running in the background."""
    pm_cfg = ParamManagerConfig(
        port=0, model_dir=models, chunk_bytes=64 * 1024, dataplane="tcp", dataplane_link_gbps=link_gbps
    )
    pm = ParamManagerService(pm_cfg)
    async with contextlib.AsyncExitStack() as stack:
        pm_ctx = await stack.enter_async_context(serve_in_process(pm, pm_cfg))
        out: dict[str, Any] = {}
        for iid in ("old", "new", "decode") if decode else ("old", "new"):
            cfg = WorkerConfig(
                port=0,
                param_manager=pm_ctx.address,
                instance_id=iid,
                kv_cache_tokens=4096,
                dataplane="tcp",
                **((old or {}) if iid == "old" else {}),
            )
            wk = WorkerService(cfg)
            ctx = await stack.enter_async_context(serve_in_process(wk, cfg))
            ch = await stack.enter_async_context(channel(ctx.address))
            out[iid] = (wk, worker_pb2_grpc.WorkerStub(ch))
        for full in ("old", "decode") if decode else ("old",):
            stub = out[full][1]
            loaded = [
                p
                async for p in stub.LoadParameters(
                    worker_pb2.LoadParametersRequest(model_id=MODEL, instance_id=full), timeout=60
                )
            ]
            assert loaded[-1].done
        load = out["new"][1].LoadParameters(
            worker_pb2.LoadParametersRequest(model_id=MODEL, instance_id="new"), timeout=60
        )
        out["load"] = asyncio.create_task(collect(load))
        try:
            yield out
        finally:
            if not out["load"].done():
                out["load"].cancel()
            await asyncio.gather(out["load"], return_exceptions=True)


async def collect(call: Any) -> list[Any]:
    return [m async for m in call]


async def tokens(call: Any) -> list[int]:
    return [t async for m in call for t in m.token_ids]


async def test_a_loading_worker_runs_first_layers_and_its_partner_finishes_exactly(
    models: Path, serve_in_process: ServeFactory
) -> None:
    prompts = [[1, *range(7, 7 + n)] for n in (5, 40, 90)]
    # 0.01 Gbit/s: the ~6 MB model takes about 5 s to arrive, layer by layer, the embedding (a
    # sixth of it) after the six layers.
    async with pair(models, serve_in_process, link_gbps=0.01) as p:
        (old_svc, old), (new_svc, new) = p["old"], p["new"]
        expected = [await tokens(old.Generate(request(f"whole-{i}", pr), timeout=30)) for i, pr in enumerate(prompts)]
        await wait_until(lambda: engine_of(new_svc) is not None, 30, what="the loading worker's engine started")
        info = await new.GetStatus(worker_pb2.GetStatusRequest())
        assert info.state == common_pb2.INSTANCE_STATE_LOADING
        # A whole request is refused while loading; a ZigZag one is taken.
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await tokens(new.Generate(request("whole", prompts[0]), timeout=10))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "LOADING" in (refused.value.details() or "")
        address = new_svc.servicer.transport.address()  # type: ignore[union-attr]
        # A "partner" without the embedding (the loading worker itself) cannot look the prompt up:
        # the first hop fails at once, saying why (the real partner then computes it whole).
        itself = worker_pb2.ZigzagFirstLayersMode(
            partner=worker_pb2.ZigzagSource(instance_id="new", dataplane_address=address)
        )
        with pytest.raises(grpc.aio.AioRpcError) as no_rows:
            await collect(new.Generate(request("self", prompts[0], zigzag_first_layers=itself), timeout=10))
        assert no_rows.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "embedding of 'tiny6' is not loaded here" in (no_rows.value.details() or "")
        firsts = [
            asyncio.create_task(
                collect(new.Generate(request(f"r{i}", pr, zigzag_first_layers=first_layers_with(old_svc)), timeout=60))
            )
            for i, pr in enumerate(prompts)
        ]
        engine = engine_of(new_svc)
        # Live from its first layer: the partner embedded the prompts (no embedding here yet).
        await wait_until(
            lambda: engine.zigzag["partner_embedded"] == 3, 10, what="three prompts embedded by the partner"
        )
        await wait_until(
            lambda: all((s := engine._by_id.get(f"r{i}")) is not None and s.zz_layers >= 1 for i in range(3)),
            30,
            what="each request through a first layer on the loading worker",
        )
        source = worker_pb2.ZigzagSource(instance_id="new", dataplane_address=address)
        rests = await asyncio.gather(
            *(
                tokens(old.Generate(request(f"r{i}", pr, zigzag_partner=source), timeout=60))
                for i, pr in enumerate(prompts)
            )
        )
        assert rests == expected
        ends = [(await f)[-1] for f in firsts]
        assert all(m.HasField("zigzag_layers") and m.zigzag_layers >= 1 for m in ends), ends
        old_engine = engine_of(p["old"][0])
        assert old_engine.zigzag["continued"] == 3 and old_engine.zigzag["recomputed"] == 0
        status = await new.GetStatus(worker_pb2.GetStatusRequest())
        assert status.load.zigzag_relayed_total == 3
        # The loading worker frees each relayed request's KV once its partner has pulled it.
        await wait_until(lambda: engine.kv_cache.used_blocks == 0, 10, what="relayed KV freed")
        # It then finishes loading and serves on its own. The layers came first, one group each.
        progress = await p["load"]
        assert progress[-1].done
        assert [m.layers_loaded for m in progress[:6]] == [1, 2, 3, 4, 5, 6]
        assert await tokens(new.Generate(request("after", prompts[1]), timeout=30)) == expected[1]


async def test_a_dead_loading_worker_leaves_its_requests_to_be_recomputed(
    models: Path, serve_in_process: ServeFactory
) -> None:
    prompt = [1, *range(9, 60)]
    async with pair(models, serve_in_process, link_gbps=0.02) as p:
        (old_svc, old), (new_svc, new) = p["old"], p["new"]
        expected = await tokens(old.Generate(request("whole", prompt), timeout=30))
        await wait_until(lambda: engine_of(new_svc) is not None, 30, what="the loading worker's engine started")
        address = new_svc.servicer.transport.address()  # type: ignore[union-attr]
        first = asyncio.create_task(
            collect(new.Generate(request("r", prompt, zigzag_first_layers=first_layers_with(old_svc)), timeout=60))
        )
        await wait_until(lambda: "r" in engine_of(new_svc)._by_id, 10, what="the request on the loading worker")
        # The loading worker's load fails (its engine stops): the partner's relay finds nothing.
        p["load"].cancel()
        await asyncio.gather(p["load"], return_exceptions=True)
        await wait_until(lambda: new_svc.servicer.instance is None, 10, what="the loading worker back to IDLE")
        source = worker_pb2.ZigzagSource(instance_id="new", dataplane_address=address)
        assert await tokens(old.Generate(request("r", prompt, zigzag_partner=source), timeout=60)) == expected
        assert engine_of(old_svc).zigzag["recomputed"] == 1
        with pytest.raises(grpc.aio.AioRpcError):
            await first


def first_layers_with(partner: WorkerService) -> worker_pb2.ZigzagFirstLayersMode:
    """The first hop's mode as the gateway sends it: naming the full partner, whose data plane
    embeds the prompt while the loading worker has no embedding yet (it arrives after the layers)."""
    transport = partner.servicer.transport
    assert transport is not None
    return worker_pb2.ZigzagFirstLayersMode(
        partner=worker_pb2.ZigzagSource(instance_id="old", dataplane_address=transport.address())
    )


def engine_of(svc: WorkerService) -> Any:
    inst = svc.servicer.instance
    return inst.engine if inst is not None else None


async def test_disaggregated_zigzag_hands_the_whole_kv_to_decode(models: Path, serve_in_process: ServeFactory) -> None:
    """A loading prefill worker runs the first layers; the full prefill worker relays it, emits
    the first token and hands the whole prompt's KV to a decode worker, which continues with
    the tokens of a whole run; every transfer over the data plane."""
    prompt = [1, *range(11, 71)]
    async with pair(models, serve_in_process, link_gbps=0.02, decode=True) as p:
        (old_svc, old), (new_svc, new), (dec_svc, dec) = p["old"], p["new"], p["decode"]
        expected = await tokens(old.Generate(request("whole", prompt), timeout=30))
        await wait_until(lambda: engine_of(new_svc) is not None, 30, what="the loading worker's engine started")
        first = asyncio.create_task(
            collect(new.Generate(request("r", prompt, zigzag_first_layers=first_layers_with(old_svc)), timeout=60))
        )
        await wait_until(
            lambda: getattr(engine_of(new_svc)._by_id.get("r"), "zz_layers", 0) >= 1, 30, what="a first layer run"
        )
        source = worker_pb2.ZigzagSource(instance_id="new", dataplane_address=new_svc.servicer.transport.address())
        head = await collect(old.Generate(request("r", prompt, zigzag_partner_handoff=source), timeout=60))
        assert len(head) == 1 and head[0].HasField("kv_handoff") and head[0].kv_handoff.num_tokens == len(prompt)
        rest = await tokens(
            dec.Generate(
                request("r", prompt, resume_token_ids=list(head[0].token_ids), decode_from_kv=head[0].kv_handoff),
                timeout=60,
            )
        )
        assert [*head[0].token_ids, *rest] == expected
        assert (await first)[-1].zigzag_layers >= 1
        assert engine_of(old_svc).zigzag["continued"] == 1
        assert engine_of(dec_svc).kv_fills == {"pulled": 1, "recomputed": 0}


# The full worker of the pulled-ZigZag tests: one request at a time, so the others wait.
BUSY = {"max_batch_size": 1, "step_time_a_s": 0.03, "step_time_b_s": 0.0}


async def loading_peer(new_svc) -> Peer:
    """The loading worker as a ZigZag peer, once its engine runs (1 of 6 layers held)."""
    await wait_until(lambda: engine_of(new_svc) is not None, 30, what="the loading worker's engine started")
    transport = new_svc.servicer.transport
    assert transport is not None
    return Peer("new", new_svc.servicer.address, transport.address(), 1, 6, inflight_limit=2)


@pytest.mark.parametrize("peer_dies", [False, True], ids=["pulled", "peer-dies"])
async def test_a_partner_hands_its_queued_requests_to_a_loading_peer(
    models: Path, serve_in_process: ServeFactory, peer_dies: bool
) -> None:
    """ZigZag pulled (manager --zigzag-dispatch pull), between real workers: the full worker,
    told its loading peer, hands that peer its waiting requests to run ahead and takes each over
    when it admits it, with the tokens of a whole run. If the peer's load fails meanwhile, every
    request is recomputed on the partner, none lost."""
    prompts = [[1, *range(9 + i, 50 + i)] for i in range(6)]
    async with pair(models, serve_in_process, link_gbps=0.02, old=BUSY) as p:
        (old_svc, old), (new_svc, _) = p["old"], p["new"]
        expected = [await tokens(old.Generate(request(f"w{i}", pr), timeout=30)) for i, pr in enumerate(prompts)]
        old_svc.servicer.offloader.set_peers([await loading_peer(new_svc)], MODEL)
        calls = [
            asyncio.create_task(tokens(old.Generate(request(f"r{i}", pr), timeout=60))) for i, pr in enumerate(prompts)
        ]
        if peer_dies:
            await wait_until(lambda: bool(engine_of(new_svc)._by_id), 10, what="a request run ahead on the peer")
            p["load"].cancel()
            await asyncio.gather(p["load"], return_exceptions=True)
        assert await asyncio.gather(*calls) == expected
        zigzag = engine_of(old_svc).zigzag
        if peer_dies:
            assert zigzag["recomputed"] >= 1, zigzag
        else:
            assert zigzag["continued"] >= 2 and zigzag["recomputed"] == 0, zigzag
        assert not old_svc.servicer.offloader._ahead  # every run-ahead ended with its request


async def test_a_loaded_peer_takes_back_the_queued_requests_it_ran_ahead(
    models: Path, serve_in_process: ServeFactory
) -> None:
    """Take-back (the manager's ReleaseWaiting with `ran_ahead_by`, when the peer has loaded): the
    partner releases every queued request that peer ran ahead, even with max_requests 0, offers
    it nothing more, and serves the rest with their whole-run tokens."""
    prompts = [[1, *range(9 + i, 50 + i)] for i in range(5)]
    async with pair(models, serve_in_process, link_gbps=0.02, old=BUSY) as p:
        (old_svc, old), (new_svc, _) = p["old"], p["new"]
        expected = [await tokens(old.Generate(request(f"w{i}", pr), timeout=30)) for i, pr in enumerate(prompts)]
        offloader = old_svc.servicer.offloader
        offloader.set_peers([await loading_peer(new_svc)], MODEL)  # a cap of 2
        calls = {
            f"r{i}": asyncio.create_task(tokens(old.Generate(request(f"r{i}", pr), timeout=60)))
            for i, pr in enumerate(prompts)
        }
        await wait_until(lambda: offloader.inflight("new") == 2, 10, what="two requests run ahead on the peer")
        ahead = {rid for rid, (pid, _) in offloader._ahead.items() if pid == "new"}
        resp = await old.ReleaseWaiting(
            worker_pb2.ReleaseWaitingRequest(
                max_requests=0, reason="scale_out: new finished loading", ran_ahead_by="new", instance_id="old"
            ),
            timeout=10,
        )
        released = set(resp.request_ids)
        assert released and released <= ahead  # one may have been admitted meanwhile: it stays
        assert "new" not in offloader.peers
        for rid, call in calls.items():
            if rid in released:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call
                assert err.value.code() == grpc.StatusCode.ABORTED
            else:
                assert await call == expected[int(rid[1:])]
        await wait_until(lambda: not offloader._ahead, 10, what="every run-ahead ended with its request")


async def test_a_run_ahead_that_breaks_strands_nothing(
    models: Path, serve_in_process: ServeFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run-ahead whose own code fails (here: building its request) ends like a refused one:
    logged, forgotten, and every request computed whole on the partner with its whole-run tokens."""
    from services.worker import zigzag_pull

    def broken(*_a, **_k):
        raise RuntimeError("injected: the run-ahead request cannot be built")

    prompts = [[1, *range(9 + i, 40 + i)] for i in range(3)]
    async with pair(models, serve_in_process, link_gbps=0.02, old=BUSY) as p:
        (old_svc, old), (new_svc, _) = p["old"], p["new"]
        expected = [await tokens(old.Generate(request(f"w{i}", pr), timeout=30)) for i, pr in enumerate(prompts)]
        peer = await loading_peer(new_svc)
        failed_before = zigzag_pull.OFFLOADS.labels("failed")._value.get()
        monkeypatch.setattr(zigzag_pull, "sampling_to_proto", broken)
        old_svc.servicer.offloader.set_peers([peer], MODEL)
        calls = [
            asyncio.create_task(tokens(old.Generate(request(f"r{i}", pr), timeout=60))) for i, pr in enumerate(prompts)
        ]
        assert await asyncio.gather(*calls) == expected
        assert engine_of(old_svc).zigzag["continued"] == 0
        # The broken run-ahead was tried, counted as failed, and forgotten.
        assert zigzag_pull.OFFLOADS.labels("failed")._value.get() > failed_before
        assert not old_svc.servicer.offloader._ahead


# Hand-back: the full worker decodes slowly (emulated pacing), so the split request is still
# decoding there when the loading worker finishes its load.
SLOW_DECODE = {"step_time_a_s": 0.04, "step_time_b_s": 0.0}
SAMPLINGS = {
    "greedy": common_pb2.SamplingParams(temperature=0, max_tokens=300, ignore_eos=True),
    "seeded": common_pb2.SamplingParams(temperature=0.9, seed=1234, max_tokens=300, ignore_eos=True),
}


@pytest.mark.parametrize("sampling", sorted(SAMPLINGS))
async def test_hand_back_moves_a_split_requests_decode_to_the_loaded_worker_with_its_kv(
    models: Path, serve_in_process: ServeFactory, sampling: str
) -> None:
    """Hand-back between real workers (TCP data plane): a request split with a loading worker is
    decoding on its partner when the load completes; the partner releases it with its KV
    (ReleaseRunning, as the manager's hand-back asks), and the loaded worker pulls that KV and
    decodes on, with exactly the tokens of a whole run, greedy and seeded."""
    prompt = [1, *range(13, 60)]
    params = SAMPLINGS[sampling]

    def req(rid: str, **kw: Any) -> worker_pb2.WorkerGenerateRequest:
        return worker_pb2.WorkerGenerateRequest(
            request_id=rid, model_id=MODEL, prompt_token_ids=prompt, sampling=params, **kw
        )

    async with pair(models, serve_in_process, link_gbps=0.02, old=SLOW_DECODE) as p:
        (old_svc, old), (new_svc, new) = p["old"], p["new"]
        await wait_until(lambda: engine_of(new_svc) is not None, 30, what="the loading worker's engine started")
        first = asyncio.create_task(
            collect(new.Generate(req("r", zigzag_first_layers=first_layers_with(old_svc)), timeout=120))
        )
        await wait_until(
            lambda: getattr(engine_of(new_svc)._by_id.get("r"), "zz_layers", 0) >= 1, 30, what="a first layer run"
        )
        source = worker_pb2.ZigzagSource(instance_id="new", dataplane_address=new_svc.servicer.transport.address())
        on_partner = asyncio.create_task(collect(old.Generate(req("r", zigzag_partner=source), timeout=120)))
        # The load completes while the partner decodes the split request.
        progress = await asyncio.wait_for(p["load"], 60)
        assert progress[-1].done
        assert (await first)[-1].zigzag_layers >= 1
        assert not on_partner.done(), "the split request finished before the load: nothing left to hand back"
        released = await old.ReleaseRunning(
            worker_pb2.ReleaseRunningRequest(max_requests=1, reason="hand-back", instance_id="old"), timeout=5
        )
        assert list(released.request_ids) == ["r"]
        head_msgs = await asyncio.wait_for(on_partner, 30)
        last = head_msgs[-1]
        assert last.HasField("kv_handoff") and not last.HasField("finish_reason")
        head = [t for m in head_msgs for t in m.token_ids]
        assert 1 <= len(head) < params.max_tokens
        assert last.kv_handoff.num_tokens == len(prompt) + len(head) - 1
        rest = await tokens(new.Generate(req("r", resume_token_ids=head, decode_from_kv=last.kv_handoff), timeout=60))
        assert engine_of(new_svc).kv_fills == {"pulled": 1, "recomputed": 0}
        assert engine_of(old_svc).zigzag["continued"] == 1
        # The whole run, on the loaded worker alone.
        assert [*head, *rest] == await tokens(new.Generate(req("whole"), timeout=60))
