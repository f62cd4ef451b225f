"""The engine's side of prefill/decode disaggregation: a hand-off parks the prompt's KV after the
first token; a KV fill admits a request whose prompt KV comes from elsewhere. Split this way a
request gives exactly the tokens it gives served whole (the transfer itself is tested over the
real data plane in tests/integration/test_kv_transfer.py and test_disagg_worker.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from services.common.waiting import wait_until
from services.worker.engine.engine import Engine, KVBlocks, KVFill, PacingProfile, TokenEvent
from services.worker.engine.kv_cache import KVCache
from services.worker.engine.sampling import SamplingParams
from services.worker.model.llama import LlamaForCausalLM
from tests.unit import test_engine
from tests.unit.test_engine import GREEDY, collect, make_engine, prompt_of

model = test_engine.model  # the same tiny synthetic model, as a fixture of this module


def copy_fill(src: KVCache, parked: str, num_tokens: int, *, gate: asyncio.Event | None = None) -> KVFill:
    """A fill that copies the parked blocks from another engine's cache, as the data plane does."""

    async def fill(blocks: KVBlocks) -> None:
        if gate is not None:
            await gate.wait()
        table = blocks.allocate(blocks.request_id, num_tokens)
        src_table = src.block_table(parked)[: len(table)]
        (sk, sv), (dk, dv) = src.storage(), blocks_cache(blocks).storage()
        dk[:, table] = sk[:, src_table]
        dv[:, table] = sv[:, src_table]

    return fill


def blocks_cache(blocks: KVBlocks) -> KVCache:
    return blocks._cache


async def split_run(
    prefill: Engine, decode: Engine, request_id: str, prompt: Sequence[int], params: SamplingParams
) -> tuple[TokenEvent, list[TokenEvent]]:
    first = [ev async for ev in prefill.generate(request_id, prompt, params, handoff=True)]
    assert len(first) == 1 and first[0].finish_reason is None and first[0].parked_kv is not None
    head = first[0]
    assert head.kv_tokens == len(prompt)
    fill = copy_fill(prefill.kv_cache, head.parked_kv, head.kv_tokens)
    assert head.token_id is not None
    rest = [ev async for ev in decode.generate(request_id, prompt, params, [head.token_id], kv_fill=fill)]
    assert prefill.release_parked(head.parked_kv) > 0
    return head, rest


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True, frequency_penalty=0.7),
    ],
    ids=["greedy", "seeded", "seeded-penalties"],
)
async def test_a_handed_off_request_gives_the_tokens_of_a_whole_run(model: LlamaForCausalLM, params) -> None:
    prompts = [prompt_of(n, seed) for seed, n in enumerate((9, 17, 33, 5))]
    async with make_engine(model) as whole:
        expected = await asyncio.gather(*(collect(whole, f"r{i}", p, params) for i, p in enumerate(prompts)))
    async with make_engine(model) as prefill, make_engine(model) as decode:
        # Concurrently, so the hand-offs share the prefill and the decode batches.
        runs = await asyncio.gather(*(split_run(prefill, decode, f"r{i}", p, params) for i, p in enumerate(prompts)))
        assert decode.kv_fills == {"pulled": len(prompts), "recomputed": 0}
        assert prefill.kv_cache.used_blocks == 0 and decode.kv_cache.used_blocks == 0
    for (head, rest), whole_events in zip(runs, expected, strict=True):
        assert [head.token_id] + [e.token_id for e in rest] == [e.token_id for e in whole_events]
        assert [e.completion_tokens for e in rest] == list(range(2, params.max_tokens + 1))
        assert rest[-1].finish_reason == "length"
        # The prefill side prefilled the prompt and says so (0 cached); the decode side pulled its
        # KV and says nothing, so the gateway keeps the prefill side's count.
        assert head.cached_tokens == 0 and {e.cached_tokens for e in rest} == {None}


async def test_a_failed_fill_recomputes_the_prompt(model: LlamaForCausalLM) -> None:
    prompt = prompt_of(21, 4)
    async with make_engine(model) as whole:
        expected = [e.token_id for e in await collect(whole, "r", prompt, GREEDY)]

    async def broken(blocks: KVBlocks) -> None:
        blocks.allocate(blocks.request_id, len(prompt))
        raise ConnectionError("producer died mid-transfer")

    async with make_engine(model) as decode:
        events = [ev async for ev in decode.generate("r", prompt, GREEDY, expected[:1], kv_fill=broken)]
        assert [e.token_id for e in events] == expected[1:]
        assert decode.kv_fills == {"pulled": 0, "recomputed": 1}
        assert decode.kv_cache.used_blocks == 0
        assert {e.cached_tokens for e in events} == {0}  # prefilled here after all, from nothing cached


async def test_parked_kv_stays_until_released_and_frees_the_request_id(model: LlamaForCausalLM) -> None:
    prompt = prompt_of(40, 2)
    async with make_engine(model) as engine:
        (head,) = [ev async for ev in engine.generate("r", prompt, GREEDY, handoff=True)]
        assert head.parked_kv is not None
        blocks = engine.kv_cache.blocks_needed(len(prompt))
        assert engine.stats().kv_blocks_parked == blocks == engine.kv_cache.used_blocks
        assert engine.stats().running == 0
        # The id is free again at once (a retry may land here while the KV is still offered).
        again = await collect(engine, "r", prompt, GREEDY)
        assert [e.token_id for e in again][0] == head.token_id
        assert engine.kv_cache.used_blocks == blocks
        assert engine.release_parked(head.parked_kv) == blocks
        assert engine.release_parked(head.parked_kv) == 0
        assert engine.stats().kv_blocks_parked == 0 and engine.kv_cache.used_blocks == 0


async def test_a_hand_off_that_ends_on_its_first_token_parks_nothing(model: LlamaForCausalLM) -> None:
    async with make_engine(model) as engine:
        events = await asyncio.gather(
            *(
                collect_handoff(engine, f"r{i}", prompt_of(7, i), SamplingParams(temperature=0, max_tokens=1))
                for i in range(3)
            )
        )
        for evs in events:
            assert len(evs) == 1 and evs[0].finish_reason == "length" and evs[0].parked_kv is None
        assert engine.kv_cache.used_blocks == 0


async def collect_handoff(engine: Engine, request_id: str, prompt: Sequence[int], params: SamplingParams):
    return [ev async for ev in engine.generate(request_id, prompt, params, handoff=True)]


async def test_a_hand_off_reserves_blocks_only_to_its_first_token(model: LlamaForCausalLM) -> None:
    """Prefill-only requests do not hold KV for max_tokens: a pool too small for one whole
    request still runs many hand-offs."""
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    async with make_engine(model, num_kv_blocks=8, max_batch_size=4) as engine:
        prompt = prompt_of(20, 1)
        heads = await asyncio.gather(*(collect_handoff(engine, f"r{i}", prompt, params) for i in range(3)))
        for (head,) in heads:
            assert head.parked_kv is not None
            engine.release_parked(head.parked_kv)
        assert engine.kv_cache.used_blocks == 0


async def test_aborting_a_request_while_its_kv_arrives_frees_its_blocks_after_the_pull(
    model: LlamaForCausalLM,
) -> None:
    prompt = prompt_of(30, 3)
    async with make_engine(model) as source:
        (head,) = await collect_handoff(source, "r", prompt, GREEDY)
        gate = asyncio.Event()
        async with make_engine(model) as decode:
            stream = decode.generate(
                "r",
                prompt,
                GREEDY,
                [head.token_id],
                kv_fill=copy_fill(source.kv_cache, head.parked_kv, len(prompt), gate=gate),
            )
            task = asyncio.create_task(anext(stream))
            await wait_until(lambda: decode.stats().running == 1, 5, what="the request admitted, its KV arriving")
            held = decode.kv_cache.used_blocks
            assert held == decode.kv_cache.blocks_needed(len(prompt))
            decode.abort("r")
            # The pull is still running (gated): its blocks are not back in the pool yet.
            assert (await task).finish_reason == "abort"
            await wait_until(lambda: decode.kv_cache.used_blocks == 0, 5, what="the blocks freed once the pull unwound")
            gate.set()
            await stream.aclose()
            assert decode.kv_fills == {"pulled": 0, "recomputed": 0}
        source.release_parked(head.parked_kv)


async def test_a_fill_waits_for_blocks_like_any_request(model: LlamaForCausalLM) -> None:
    """A decode instance without room queues a handed-off request (FCFS) instead of dropping it."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompt = prompt_of(24, 6)
    pacing = PacingProfile(base_s=0.005, per_token_s=0)
    async with make_engine(model) as source, make_engine(model, num_kv_blocks=5, pacing=pacing) as decode:
        (head,) = await collect_handoff(source, "h", prompt, params)
        hog = asyncio.create_task(collect(decode, "hog", prompt_of(30, 9), params))  # 70 tokens: all 5 blocks
        await wait_until(lambda: decode.stats().running == 1, 5, what="the first request running")
        fill = copy_fill(source.kv_cache, head.parked_kv, len(prompt))
        rest = asyncio.create_task(collect_with(decode.generate("h", prompt, params, [head.token_id], kv_fill=fill)))
        await wait_until(lambda: decode.stats().waiting == 1, 5, what="the hand-off queued")
        assert decode.kv_fills["pulled"] == 0
        await hog
        events = await rest
        assert len(events) == params.max_tokens - 1 and decode.kv_fills["pulled"] == 1
        source.release_parked(head.parked_kv)


async def collect_with(stream) -> list[TokenEvent]:
    return [ev async for ev in stream]


async def test_kv_fill_arguments_are_checked(model: LlamaForCausalLM) -> None:
    async def fill(blocks: KVBlocks) -> None:
        return None

    async with make_engine(model) as engine:
        with pytest.raises(ValueError, match="resumes no token"):
            await collect_with(engine.generate("r", [1, 5, 6], GREEDY, kv_fill=fill))
        with pytest.raises(ValueError, match="cannot also take its KV"):
            await collect_with(engine.generate("r", [1, 5, 6], GREEDY, [7], handoff=True, kv_fill=fill))
        assert engine.kv_cache.used_blocks == 0


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=30, ignore_eos=True, presence_penalty=0.5),
    ],
    ids=["greedy", "seeded-penalties"],
)
async def test_a_live_migrated_request_continues_exactly_with_its_kv(model: LlamaForCausalLM, params) -> None:
    """Live migration: a decoding request leaves with its KV between steps; another engine pulls
    that KV, resumes after the tokens so far, and gives the uninterrupted run's tokens."""
    prompt = prompt_of(21, 8)
    async with make_engine(model) as whole:
        expected = [e.token_id for e in await collect(whole, "r", prompt, params)]
    pacing = PacingProfile(base_s=0.01, per_token_s=0)
    async with make_engine(model, pacing=pacing) as source, make_engine(model) as dest:
        events: list[TokenEvent] = []

        async def run() -> None:
            async for ev in source.generate("r", prompt, params):
                events.append(ev)

        task = asyncio.create_task(run())
        await wait_until(lambda: len(events) >= 5, 5, what="five tokens on the source")
        assert source.release_running(4, "test") == ["r"]
        await task
        last = events[-1]
        assert last.token_id is None and last.finish_reason is None and last.parked_kv is not None
        tokens = [e.token_id for e in events[:-1]]
        assert last.kv_tokens == len(prompt) + len(tokens) - 1
        fill = copy_fill(source.kv_cache, last.parked_kv, last.kv_tokens)
        rest = [ev async for ev in dest.generate("r", prompt, params, tokens, kv_fill=fill)]
        assert tokens + [e.token_id for e in rest] == expected
        assert dest.kv_fills == {"pulled": 1, "recomputed": 0}
        assert source.release_parked(last.parked_kv) > 0 and source.kv_cache.used_blocks == 0
        # Nothing else is released: a queued or prefilling request has no KV worth moving.
        assert source.release_running(4, "test") == []


async def test_a_live_migration_leaves_requests_too_close_to_their_end_to_be_worth_moving(
    model: LlamaForCausalLM,
) -> None:
    """`min_tokens_left` (the manager's hand-back): a request with fewer tokens left of its
    max_tokens stays and finishes here; one with enough left leaves with its KV."""
    pacing = PacingProfile(base_s=0.01, per_token_s=0)
    short = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    long = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    async with make_engine(model, pacing=pacing) as source:
        events: dict[str, list[TokenEvent]] = {"short": [], "long": []}

        async def run(rid: str, params: SamplingParams) -> None:
            async for ev in source.generate(rid, prompt_of(17, 3), params):
                events[rid].append(ev)

        tasks = [asyncio.create_task(run("short", short)), asyncio.create_task(run("long", long))]
        await wait_until(lambda: all(len(e) >= 4 for e in events.values()), 5, what="four tokens of each")
        # "short" has at most 8 of 12 left, "long" at least 50 of 60.
        assert source.release_running(4, "test", min_tokens_left=20) == ["long"]
        await asyncio.gather(*tasks)
        assert events["long"][-1].parked_kv is not None and events["long"][-1].token_id is None
        assert events["short"][-1].finish_reason == "length" and len(events["short"]) == 12
