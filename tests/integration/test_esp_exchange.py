"""ESP across members that talk over the data plane (real TCP sockets; UCX where ucxx imports):
a prompt prefilled by a group of 2 and 3 members gives one instance's logits and the in-process
group's, each member keeping exactly its slice's KV; a member that goes away fails the others
in time, with their blocks freed; a stranger's handshake is refused."""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.dataplane import make_transport
from services.dataplane.errors import DataPlaneError, ProtocolError
from services.model_format import synth
from services.worker.engine.kv_cache import KVCache
from services.worker.esp_exchange import connect_group, prefill_member
from services.worker.model.esp import sequence_parallel_prefill
from services.worker.model.llama import load_model
from tests.integration.spawned import spawned

BLOCK = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(str(synth.synthesize(tmp_path_factory.mktemp("m") / "tiny", "tiny", seed=7)))


def _cache(model) -> KVCache:
    return KVCache.for_model(model.config, num_blocks=32, block_size=BLOCK, dtype=model.dtype)


async def _group(kind: str, model, prompt, bounds, *, break_member: int | None = None):
    n = len(bounds) - 1
    transports = [make_transport(kind) for _ in range(n)]
    for t in transports:
        await t.start()
    caches = [_cache(model) for _ in range(n)]
    addresses = [t.address() for t in transports]

    async def member(j: int):
        links = await connect_group(transports[j], j, addresses, "g1", timeout_s=10)
        if j == break_member:
            links.abort()  # this member goes away before its first layer
            caches[j].allocate("r", 1)
            caches[j].free("r")
            return None
        return await prefill_member(model, caches[j], links, "r", prompt, bounds, timeout_s=5)

    try:
        results = await asyncio.wait_for(asyncio.gather(*(member(j) for j in range(n)), return_exceptions=True), 60)
    finally:
        for t in transports:
            await t.close()
    return results, caches


@pytest.mark.parametrize("bounds", [[0, 17, 31], [0, 4, 20, 31]])
async def test_a_group_over_the_data_plane_prefills_like_one_instance(model, bounds) -> None:
    g = torch.Generator().manual_seed(len(bounds))
    prompt = torch.randint(3, model.config.vocab_size, (31,), generator=g).tolist()
    results, caches = await _group("tcp", model, prompt, bounds)
    *others, logits = results
    assert all(r is None for r in others) and isinstance(logits, torch.Tensor)
    whole = model.forward(torch.tensor(prompt))[-1]
    torch.testing.assert_close(logits, whole, atol=1e-4, rtol=1e-4)
    local, placement = sequence_parallel_prefill(model, [_cache(model) for _ in caches], "r", prompt, bounds)
    torch.testing.assert_close(logits, local, atol=1e-6, rtol=1e-6)
    # Each member kept exactly its slice's KV: the in-process group's, for every layer.
    for cache, shard in zip(caches, placement.shards, strict=True):
        assert cache.num_blocks_of("r") == cache.blocks_needed(shard.num_tokens)
        theirs = type(shard)(cache, "r", shard.start, shard.end)
        for layer in range(model.config.num_hidden_layers):
            for a, b in zip(theirs.kv(layer)[:2], shard.kv(layer)[:2], strict=True):
                torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


async def test_a_member_that_goes_away_fails_the_others_in_time_and_frees_their_blocks(model) -> None:
    prompt = list(range(3, 34))
    results, caches = await _group("tcp", model, prompt, [0, 10, 20, 31], break_member=1)
    assert results[1] is None
    assert isinstance(results[0], DataPlaneError) and isinstance(results[2], DataPlaneError), results
    assert all(c.free_blocks == c.num_blocks for c in caches)


async def test_a_stranger_is_refused_at_the_handshake() -> None:
    async with make_transport("tcp") as a, make_transport("tcp") as b:
        addresses = [a.address(), b.address()]
        stranger = asyncio.ensure_future(connect_group(a, 0, addresses, "another-group", timeout_s=5))
        with pytest.raises(ProtocolError, match="unexpected handshake"):
            await connect_group(b, 1, addresses, "g1", timeout_s=5)
        await asyncio.gather(stranger, return_exceptions=True)


def _member_process(path: str, kind: str, j: int, prompt, bounds, conn) -> None:
    """One group member in its own process (UCX has one worker per process)."""

    async def run() -> None:
        model = load_model(path)
        async with make_transport(kind) as transport:
            conn.send(transport.address())
            addresses = conn.recv()
            links = await connect_group(transport, j, addresses, "g2", timeout_s=20)
            logits = await prefill_member(model, _cache(model), links, "r", prompt, bounds, timeout_s=20)
            conn.send(None if logits is None else logits.tolist())
            await links.close()

    asyncio.run(run())


@pytest.mark.parametrize("kind", ["tcp", pytest.param("ucx", marks=pytest.mark.ucx)])
def test_members_in_their_own_processes(tmp_path, kind) -> None:
    """Three members, three processes, over TCP and over UCX: one instance's logits."""
    if kind == "ucx":
        pytest.importorskip("ucxx")
    path = str(synth.synthesize(tmp_path / "tiny", "tiny", seed=7))
    prompt = list(range(5, 36))
    bounds = [0, 11, 22, 31]
    with spawned(_member_process, [(path, kind, j, prompt, bounds) for j in range(3)]) as pipes:
        for parent in pipes:
            assert parent.poll(90), "a member did not start"
        addresses = [parent.recv() for parent in pipes]
        for parent in pipes:
            parent.send(addresses)
        results = []
        for parent in pipes:
            assert parent.poll(90), "a member did not finish"
            results.append(parent.recv())
    assert results[0] is None and results[1] is None
    whole = load_model(path).forward(torch.tensor(prompt))[-1]
    torch.testing.assert_close(torch.tensor(results[2]), whole, atol=1e-4, rtol=1e-4)


async def test_a_request_decodes_with_its_kv_left_on_every_member(model) -> None:
    """After a 3-member prefill nothing moves: the last member decodes as the request's master,
    the two others attend each layer's query to their slices over the data plane; 7 greedy
    tokens equal one instance's, logits within 1e-4."""
    from services.worker.esp_exchange import decode_master_step, end_decode, serve_holder
    from services.worker.model.esp import Shard

    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(3, model.config.vocab_size, (26,), generator=g).tolist()
    bounds = [0, 9, 18, 26]
    ids, want = list(prompt), []
    for _ in range(7):
        row = model.forward(torch.tensor(ids))[-1]
        want.append(row)
        ids.append(int(row.argmax()))
    transports = [make_transport("tcp") for _ in range(3)]
    for t in transports:
        await t.start()
    caches = [_cache(model) for _ in range(3)]
    addresses = [t.address() for t in transports]

    async def member(j: int):
        links = await connect_group(transports[j], j, addresses, "g3", timeout_s=10)
        logits = await prefill_member(model, caches[j], links, "r", prompt, bounds, timeout_s=10)
        shard = Shard(caches[j], "r", bounds[j], bounds[j + 1])
        if j < 2:
            return await serve_holder(model, shard, links.later[2], timeout_s=10)
        tokens, rows = [int(logits.argmax())], [logits]
        for _ in range(6):
            row = await decode_master_step(model, caches[j], shard, links.earlier, tokens[-1], timeout_s=10)
            rows.append(row)
            tokens.append(int(row.argmax()))
        await end_decode(links.earlier)
        return tokens, rows

    try:
        served0, served1, (tokens, rows) = await asyncio.wait_for(asyncio.gather(*(member(j) for j in range(3))), 60)
    finally:
        for t in transports:
            await t.close()
    assert served0 == served1 == ("end", 6)
    assert tokens == ids[len(prompt) :]
    for got, exp in zip(rows, want, strict=True):
        torch.testing.assert_close(got, exp, atol=1e-4, rtol=1e-4)
    # The holders' KV never moved; only the master's slice grew.
    assert [c.num_blocks_of("r") for c in caches] == [3, 3, caches[2].blocks_needed(8 + 6)]


async def test_a_new_master_joins_when_the_last_holder_is_full(model) -> None:
    """Scale-up during decode: the master's cache fills after 4 new tokens; a third instance
    joins as master and takes the new KV, the old master becomes a holder, no KV moves, and the
    tokens stay one instance's."""
    from services.worker.engine.kv_cache import OutOfBlocks
    from services.worker.esp_exchange import (
        accept_master,
        decode_master_step,
        end_decode,
        hand_over,
        join_as_master,
        serve_holder,
    )
    from services.worker.model.esp import Shard

    g = torch.Generator().manual_seed(12)
    prompt = torch.randint(3, model.config.vocab_size, (16,), generator=g).tolist()
    bounds, steps = [0, 8, 16], 9
    ids = list(prompt)
    for _ in range(steps + 1):
        ids.append(int(model.forward(torch.tensor(ids))[-1].argmax()))
    want = ids[len(prompt) :]
    transports = [make_transport("tcp") for _ in range(3)]
    for t in transports:
        await t.start()
    small = [KVCache.for_model(model.config, num_blocks=3, block_size=BLOCK, dtype=model.dtype) for _ in range(2)]
    big = _cache(model)
    addresses = [t.address() for t in transports]
    handoff: asyncio.Queue = asyncio.Queue()

    async def holder0():
        links = await connect_group(transports[0], 0, addresses[:2], "g4", timeout_s=10)
        await prefill_member(model, small[0], links, "r", prompt, bounds, timeout_s=10)
        shard = Shard(small[0], "r", 0, 8)
        first = await serve_holder(model, shard, links.later[1], timeout_s=10)
        second = await serve_holder(model, shard, await accept_master(transports[0], "g4", timeout_s=10), timeout_s=10)
        return first, second

    async def old_master():
        links = await connect_group(transports[1], 1, addresses[:2], "g4", timeout_s=10)
        logits = await prefill_member(model, small[1], links, "r", prompt, bounds, timeout_s=10)
        shard = Shard(small[1], "r", 8, 16)
        tokens = [int(logits.argmax())]
        while True:
            try:
                row = await decode_master_step(model, small[1], shard, links.earlier, tokens[-1], timeout_s=10)
            except OutOfBlocks:
                break
            tokens.append(int(row.argmax()))
        await hand_over(links.earlier, timeout_s=10)
        await handoff.put((tokens, shard.end))
        served = await serve_holder(model, shard, await accept_master(transports[1], "g4", timeout_s=10), timeout_s=10)
        return tokens, served

    async def new_master():
        tokens, pos = await handoff.get()
        holders = await join_as_master(transports[2], addresses[:2], "g4", timeout_s=10)
        big.allocate("r", 0)
        shard = Shard(big, "r", pos, pos)
        tokens = list(tokens)
        while len(tokens) < steps + 1:
            row = await decode_master_step(model, big, shard, holders, tokens[-1], timeout_s=10)
            tokens.append(int(row.argmax()))
        await end_decode(holders, timeout_s=10)
        return tokens, (shard.start, shard.end)

    try:
        first_second, (old_tokens, old_served), (tokens, span) = await asyncio.wait_for(
            asyncio.gather(holder0(), old_master(), new_master()), 60
        )
    finally:
        for t in transports:
            await t.close()
    assert len(old_tokens) == 5  # 4 steps filled the old master's 3 blocks (12 tokens)
    assert first_second == (("handover", 4), ("end", 5)) and old_served == ("end", 5)
    assert tokens == want
    assert span == (20, 25) and small[1].num_blocks_of("r") == 3 and small[0].num_blocks_of("r") == 2
