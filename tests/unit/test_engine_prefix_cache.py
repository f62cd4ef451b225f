"""Automatic prefix caching in the engine: a request served from cached KV blocks streams what a
cold run streams (tokens and log-probs), the hit counters move, eviction under a small pool keeps
outputs right, and every block is back once every request has ended."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from services.common.waiting import wait_until
from services.model_format import synth
from services.worker.engine.engine import Engine, EngineConfig, TokenEvent
from services.worker.engine.sampling import SamplingParams
from services.worker.model.llama import LlamaForCausalLM, load_model

EOS = 2
BS = 16
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> LlamaForCausalLM:
    path = synth.synthesize(tmp_path_factory.mktemp("prefix") / "tiny", "tiny", seed=0)
    return load_model(str(path))


def make_engine(model: LlamaForCausalLM, **overrides: object) -> Engine:
    fields: dict[str, object] = {
        "max_batch_size": 4,
        "max_num_tokens": 128,
        "num_kv_blocks": 64,
        "block_size": BS,
        "num_threads": 1,
        **overrides,
    }
    return Engine.create(model, (EOS,), EngineConfig(**fields))  # type: ignore[arg-type]


def prompt_of(n: int, seed: int) -> list[int]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [1, *torch.randint(3, 2048, (n - 1,), generator=g).tolist()]


async def run(engine: Engine, request_id: str, prompt: Sequence[int], params: SamplingParams = PARAMS):
    return [ev async for ev in engine.generate(request_id, prompt, params)]


def assert_same_stream(got: list[TokenEvent], want: list[TokenEvent]) -> None:
    assert [e.token_id for e in got] == [e.token_id for e in want]
    assert [e.finish_reason for e in got] == [e.finish_reason for e in want]
    for g, w in zip(got, want, strict=True):
        assert g.logprob == pytest.approx(w.logprob, abs=1e-4)
        assert [t for t, _ in g.top_logprobs] == [t for t, _ in w.top_logprobs]
        assert [lp for _, lp in g.top_logprobs] == pytest.approx([lp for _, lp in w.top_logprobs], abs=1e-4)


async def cold(model: LlamaForCausalLM, prompt: Sequence[int], params: SamplingParams = PARAMS) -> list[TokenEvent]:
    async with make_engine(model, enable_prefix_caching=False) as engine:
        return await run(engine, "cold", prompt, params)


def assert_no_leak(engine: Engine) -> None:
    kv = engine.kv_cache
    assert kv.sequences() == [] and kv.used_blocks == 0 and kv.free_blocks == kv.total_blocks
    assert engine.stats().kv_blocks_reserved == 0


async def test_a_hit_streams_what_a_cold_run_streams(model: LlamaForCausalLM) -> None:
    prompt = prompt_of(40, 1)  # 2 full blocks + 8 tokens
    want = await cold(model, prompt)
    async with make_engine(model) as engine:
        first = await run(engine, "a", prompt)
        s = engine.stats()
        assert (s.prefix_hit_tokens, s.prefix_query_tokens) == (0, 40)
        again = await run(engine, "b", prompt)
        s = engine.stats()
        assert (s.prefix_hit_tokens, s.prefix_query_tokens) == (32, 80)
        # Each event tells the request's own hit: what usage.prompt_tokens_details reports.
        assert {e.cached_tokens for e in first} == {0} and {e.cached_tokens for e in again} == {32}
        # Only the 8 tokens after the cached blocks were computed for the second prompt.
        assert engine.step_log[-len(again)].work == (("b", 8),)
        assert_no_leak(engine)
    assert_same_stream(first, want)
    assert_same_stream(again, want)


async def test_a_shared_prefix_is_reused_by_other_suffixes(model: LlamaForCausalLM) -> None:
    system = prompt_of(50, 2)  # 3 full blocks shared
    prompts = [[*system, *prompt_of(20, 10 + i)[1:]] for i in range(3)]
    wants = [await cold(model, p) for p in prompts]
    async with make_engine(model) as engine:
        gots = [await run(engine, f"r{i}", p) for i, p in enumerate(prompts)]
        assert engine.stats().prefix_hit_tokens == 2 * 48
        assert_no_leak(engine)
    for got, want in zip(gots, wants, strict=True):
        assert_same_stream(got, want)


async def test_generated_tokens_are_cached_for_the_next_turn(model: LlamaForCausalLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=3)
    turn1 = prompt_of(20, 3)
    async with make_engine(model) as engine:
        out = [e.token_id for e in await run(engine, "t1", turn1, params)]
        assert None not in out
        # The next turn's prompt is the whole conversation so far: 49 tokens of it have KV
        # (the last generated token was never fed back), 3 full blocks.
        turn2 = [*turn1, *out, *prompt_of(9, 4)[1:]]  # type: ignore[list-item]
        got = await run(engine, "t2", turn2, params)
        assert engine.stats().prefix_hit_tokens == 48
        assert got[-1].cached_tokens == 48
        # Resumed after 29 tokens (a migration): 48 tokens matched, but its prompt has only 20.
        resumed = await run_resumed(engine, "t1-again", turn1, params, out[:29])  # type: ignore[arg-type]
        assert engine.stats().prefix_hit_tokens == 96 and resumed[-1].cached_tokens == 20
        assert_no_leak(engine)
    assert_same_stream(got, await cold(model, turn2, params))


async def run_resumed(
    engine: Engine, request_id: str, prompt: Sequence[int], params: SamplingParams, resumed: list[int]
) -> list[TokenEvent]:
    return [ev async for ev in engine.generate(request_id, list(prompt), params, resumed)]


async def test_concurrent_identical_prompts_and_a_small_pool_that_evicts(model: LlamaForCausalLM) -> None:
    # 12 blocks: two 40-token requests of 8 more tokens (3 blocks each) run at once (neither
    # finds the other's blocks), then a third one hits; cycling through 6 distinct prompts
    # evicts cached blocks, and coming back to them must still be right.
    prompts = [prompt_of(40, 20 + i) for i in range(6)]
    wants = {i: await cold(model, p) for i, p in enumerate(prompts)}
    async with make_engine(model, num_kv_blocks=12) as engine:
        for round_ in range(2):
            for i, p in enumerate(prompts):
                a, b = await asyncio.gather(run(engine, f"a{round_}-{i}", p), run(engine, f"b{round_}-{i}", p))
                c = await run(engine, f"c{round_}-{i}", p)
                for got in (a, b, c):
                    assert_same_stream(got, wants[i])
                assert engine.kv_cache.used_blocks == 0
        s = engine.stats()
        assert 0 < s.prefix_hit_tokens < s.prefix_query_tokens
        assert engine.kv_cache.cached_blocks <= 12
        assert_no_leak(engine)


async def test_a_pool_full_of_cached_blocks_still_admits_new_work(model: LlamaForCausalLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    async with make_engine(model, num_kv_blocks=4) as engine:
        # 48 + 15 tokens computed: 4 blocks, the 3 full ones cached afterwards.
        await run(engine, "a", prompt_of(48, 30), params)
        assert engine.kv_cache.evictable_blocks == 3 and engine.kv_cache.free_blocks == 4
        await run(engine, "b", prompt_of(48, 31), params)  # needs all 4: evicts a's
        assert engine.kv_cache.evictable_blocks == 3
        assert engine.kv_cache.match_prefix(prompt_of(48, 30)) == []
        assert_no_leak(engine)


async def test_prompt_logprobs_compute_the_whole_prompt(model: LlamaForCausalLM) -> None:
    prompt = prompt_of(40, 5)
    with_prompt = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=2)
    async with make_engine(model) as engine:
        await run(engine, "warm", prompt)
        got = await run(engine, "p", prompt, with_prompt)
        # Not looked up (its prompt's log-probs need every position computed).
        assert engine.stats().prefix_query_tokens == 40
        assert engine.step_log[-len(got)].work == (("p", 40),)
        assert {e.cached_tokens for e in got} == {0}
        assert_no_leak(engine)
    want = await cold(model, prompt, with_prompt)
    assert [e.token_id for e in got] == [e.token_id for e in want]
    lps = [p.logprob for p in got[0].prompt_logprobs]
    assert lps[0] is None and lps[1:] == pytest.approx([p.logprob for p in want[0].prompt_logprobs][1:], abs=1e-4)


async def test_a_hand_off_parks_shared_blocks_and_gives_them_back(model: LlamaForCausalLM) -> None:
    prompt = prompt_of(40, 6)
    async with make_engine(model) as engine:
        await run(engine, "warm", prompt)
        (head,) = [ev async for ev in engine.generate("h", prompt, PARAMS, handoff=True)]
        assert head.parked_kv is not None and head.kv_tokens == 40 and head.cached_tokens == 32
        table = engine.kv_cache.block_table(head.parked_kv)
        assert [engine.kv_cache.ref_count(b) for b in table] == [1, 1, 1]
        assert engine.kv_cache.block_hash(table[0]) is not None  # a cached block, parked
        assert engine.stats().prefix_hit_tokens == 32
        # While parked, another request shares those blocks.
        again = await run(engine, "c", prompt)
        assert again[0].token_id == head.token_id
        assert engine.release_parked(head.parked_kv) == 3
        assert_no_leak(engine)


async def test_caching_off_computes_everything(model: LlamaForCausalLM) -> None:
    prompt = prompt_of(40, 7)
    async with make_engine(model, enable_prefix_caching=False) as engine:
        await run(engine, "a", prompt)
        b = await run(engine, "b", prompt)
        s = engine.stats()
        assert (s.prefix_hit_tokens, s.prefix_query_tokens) == (0, 0) and {e.cached_tokens for e in b} == {0}
        assert engine.kv_cache.cached_blocks == 0
        assert_no_leak(engine)


async def test_aborts_and_a_chunked_prefill_over_a_cached_prefix(model: LlamaForCausalLM) -> None:
    prompt = prompt_of(90, 8)
    want = await cold(model, prompt)
    async with make_engine(model, enable_chunked_prefill=True, max_num_tokens=32) as engine:
        await run(engine, "warm", prompt[:40])  # 47 tokens computed: caches 2 blocks
        # Aborted once admitted on its cached prefix: its blocks go back, cached ones stay matchable.
        stream = engine.generate("x", prompt, PARAMS)
        task = asyncio.ensure_future(anext(aiter(stream)))
        await wait_until(lambda: engine.stats().prefix_hit_tokens == 32, timeout_s=30)
        engine.abort("x")
        await asyncio.gather(task, return_exceptions=True)
        await stream.aclose()
        assert engine.kv_cache.used_blocks == 0
        # At least 32 cached tokens (more if x computed a chunk before the abort: its full blocks
        # were cached after each step); the rest in chunks of at most 32.
        got = await run(engine, "y", prompt)
        assert engine.stats().prefix_hit_tokens >= 64
        assert_no_leak(engine)
    assert_same_stream(got, want)
