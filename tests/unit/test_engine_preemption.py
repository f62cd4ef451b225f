"""MAX_UTILIZATION in the engine: a KV pool too small for every request at once forces pauses;
paused requests resume (recomputed or swapped in) with exactly the tokens of an unpaused run."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
import torch

from services.common.waiting import wait_until
from services.model_format import synth
from services.worker.engine.engine import Engine, EngineConfig, PacingProfile, TokenEvent
from services.worker.engine.kv_cache import KVCache
from services.worker.engine.request import RequestStatus
from services.worker.engine.sampling import SamplingParams
from services.worker.engine.scheduler import CapacityPolicy
from services.worker.model.llama import LlamaForCausalLM, load_model

EOS = 2
MAX_UTIL = CapacityPolicy.MAX_UTILIZATION


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> LlamaForCausalLM:
    path = synth.synthesize(tmp_path_factory.mktemp("preemption") / "tiny", "tiny", seed=0)
    return load_model(str(path))


def make_engine(model: LlamaForCausalLM, **overrides: object) -> Engine:
    fields: dict[str, object] = {
        "max_batch_size": 4,
        "max_num_tokens": 64,
        "block_size": 4,
        "num_kv_blocks": 256,
        "num_threads": 1,
        **overrides,
    }
    return Engine.create(model, (EOS,), EngineConfig(**fields))  # type: ignore[arg-type]


def prompt_of(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [1, *torch.randint(3, 2048, (n - 1,), generator=g).tolist()]


PROMPTS = [prompt_of(n, seed) for seed, n in enumerate((14, 9, 20, 11))]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def seeded(i: int) -> SamplingParams:
    return SamplingParams(
        temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=24, ignore_eos=True, frequency_penalty=0.5
    )


async def run_all(engine: Engine, params: Sequence[SamplingParams]) -> list[list[TokenEvent]]:
    async def one(i: int) -> list[TokenEvent]:
        return [ev async for ev in engine.generate(f"r{i}", PROMPTS[i], params[i])]

    async with engine:
        results = await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))
        # No request is lost and nothing stays behind.
        assert engine.stats().running == engine.stats().waiting == 0
        assert engine.kv_cache.used_blocks == 0
    return list(results)


def check_stream(events: list[TokenEvent], max_tokens: int) -> None:
    """Every token sent once, in order: completion counts go up by one, the last ends it."""
    assert [e.completion_tokens for e in events] == list(range(1, max_tokens + 1))
    assert all(e.token_id is not None for e in events)
    assert events[-1].finish_reason == "length"


# 12 blocks of 4 tokens: the longest request (20 + 24 tokens) fits alone; four together do not.
TIGHT = {"capacity_policy": MAX_UTIL, "num_kv_blocks": 12}


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "whole-prefill"])
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
async def test_paused_requests_give_the_unpaused_tokens(
    model: LlamaForCausalLM, mode: str, chunked: bool, sampling: str
) -> None:
    params = [GREEDY if sampling == "greedy" else seeded(i) for i in range(len(PROMPTS))]
    reference = await run_all(make_engine(model), params)
    engine = make_engine(model, preemption_mode=mode, enable_chunked_prefill=chunked, **TIGHT)
    paused = await run_all(engine, params)
    assert engine.preemptions[mode] > 0 and engine.stats().preempted_total == sum(engine.preemptions.values())
    if chunked:
        assert engine.preemptions == {
            mode: engine.stats().preempted_total,
            **{m: 0 for m in ("recompute", "swap") if m != mode},
        }
    for ref, got, p in zip(reference, paused, params, strict=True):
        check_stream(got, p.max_tokens)
        assert [e.token_id for e in got] == [e.token_id for e in ref]


async def test_guaranteed_no_evict_never_pauses(model: LlamaForCausalLM) -> None:
    engine = make_engine(model, num_kv_blocks=12)
    await run_all(engine, [GREEDY] * len(PROMPTS))
    assert engine.stats().preempted_total == 0


async def test_max_utilization_runs_more_at_once(model: LlamaForCausalLM) -> None:
    """The same tight pool: GUARANTEED_NO_EVICT starts one request at a time (each reserves
    prompt + max_tokens); MAX_UTILIZATION starts several on their prompts' blocks alone."""
    no_evict = make_engine(model, num_kv_blocks=12)
    await run_all(no_evict, [GREEDY] * len(PROMPTS))
    max_util = make_engine(model, **TIGHT)
    await run_all(max_util, [GREEDY] * len(PROMPTS))
    assert max(len(s.work) for s in no_evict.step_log) == 1
    assert max(len(s.work) for s in max_util.step_log) > 1


async def test_without_chunking_a_long_fold_is_swapped(model: LlamaForCausalLM) -> None:
    """Without chunked prefill a paused request whose prompt + generated tokens exceed
    max_num_tokens could never be prefilled again: it is swapped even in recompute mode."""
    params = [GREEDY] * len(PROMPTS)
    reference = await run_all(make_engine(model), params)
    engine = make_engine(model, enable_chunked_prefill=False, max_num_tokens=20, **TIGHT)
    got = await run_all(engine, params)
    assert engine.preemptions["swap"] > 0
    assert [[e.token_id for e in s] for s in got] == [[e.token_id for e in s] for s in reference]


async def test_prompt_logprobs_survive_a_pause(model: LlamaForCausalLM) -> None:
    """Paused mid-prefill (8-token chunks), a request's prompt log-probs are computed again with
    its prompt: complete, and equal to an unpaused run's."""
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=2)] * len(PROMPTS)
    reference = await run_all(make_engine(model), params)
    engine = make_engine(model, max_num_tokens=8, **TIGHT)
    got = await run_all(engine, params)
    assert engine.stats().preempted_total > 0
    for ref, stream, prompt in zip(reference, got, PROMPTS, strict=True):
        assert len(stream[0].prompt_logprobs) == len(prompt)
        assert [p.token_id for p in stream[0].prompt_logprobs] == prompt
        for a, b in zip(ref[0].prompt_logprobs[1:], stream[0].prompt_logprobs[1:], strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [e.token_id for e in stream] == [e.token_id for e in ref]


async def test_a_paused_request_is_not_released_to_another_instance(model: LlamaForCausalLM) -> None:
    engine = make_engine(model, pacing=PacingProfile(base_s=0.005, per_token_s=0), **TIGHT)
    async with engine:
        tasks = [asyncio.create_task(collect_all(engine, f"r{i}", PROMPTS[i], GREEDY)) for i in range(len(PROMPTS))]
        paused = await wait_until(
            lambda: [s.request_id for s in engine._waiting if s.status is RequestStatus.PREEMPTED],
            10,
            what="a paused request in the queue",
        )
        released = engine.release_waiting(10, "test")
        assert not set(paused) & set(released)
        results = await asyncio.gather(*tasks, return_exceptions=True)
    for i, result in enumerate(results):
        if f"r{i}" not in released:
            assert isinstance(result, list)
            check_stream(result, GREEDY.max_tokens)


async def collect_all(engine: Engine, request_id: str, prompt: list[int], params: SamplingParams) -> list[TokenEvent]:
    return [ev async for ev in engine.generate(request_id, prompt, params)]


async def test_abort_of_a_paused_request_frees_everything(model: LlamaForCausalLM) -> None:
    engine = make_engine(model, preemption_mode="swap", pacing=PacingProfile(base_s=0.005, per_token_s=0), **TIGHT)
    async with engine:
        tasks = {
            f"r{i}": asyncio.create_task(collect_all(engine, f"r{i}", PROMPTS[i], GREEDY)) for i in range(len(PROMPTS))
        }
        paused = await wait_until(
            lambda: [s.request_id for s in engine._waiting if s.swapped is not None], 10, what="a swapped request"
        )
        engine.abort(paused[0])
        aborted = await tasks.pop(paused[0])
        assert aborted[-1].finish_reason == "abort"
        for events in await asyncio.gather(*tasks.values()):
            check_stream(events, GREEDY.max_tokens)
        assert engine.kv_cache.used_blocks == 0 and engine.stats().waiting == 0


def test_kv_copy_out_and_in_round_trip() -> None:
    cache = KVCache(num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=3)
    table = cache.allocate("a", 10)
    k_all, v_all = cache.storage()
    k_all.normal_()
    v_all.normal_()
    k, v = cache.copy_out("a", 10)
    assert k.shape == (2, 3, 4, 2, 3) and k.device.type == "cpu"
    expected_k = k_all[:, table].clone()
    cache.free("a")
    cache.allocate("b", 16)  # takes the blocks "a" had (LIFO), so "a" comes back elsewhere
    new_table = cache.copy_in("a", k, v)
    assert set(new_table).isdisjoint(cache.block_table("b"))
    assert torch.equal(k_all[:, new_table], expected_k)
    assert torch.equal(v_all[:, new_table], v)
    with pytest.raises(ValueError, match="does not fit a pool"):
        cache.copy_in("c", k[:, :, :2], v[:, :, :2])


@pytest.mark.parametrize("mode", ["recompute", "swap"])
async def test_many_requests_through_a_tiny_pool(model: LlamaForCausalLM, mode: str) -> None:
    """Ten requests of mixed lengths, batches of 6, a pool that holds about two of them, chunks of
    8: many pauses, and every request still gives the tokens it gives alone."""
    g = torch.Generator().manual_seed(7)
    lengths = torch.randint(3, 30, (10,), generator=g).tolist()
    prompts = [prompt_of(n, 50 + i) for i, n in enumerate(lengths)]
    params = [SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True) for i in range(10)]

    async def run(engine: Engine) -> list[list[int | None]]:
        async def one(i: int) -> list[int | None]:
            events = [ev async for ev in engine.generate(f"q{i}", prompts[i], params[i])]
            check_stream(events, params[i].max_tokens)
            return [e.token_id for e in events]

        async with engine:
            out = await asyncio.gather(*(one(i) for i in range(10)))
            assert engine.kv_cache.used_blocks == 0
        return list(out)

    reference = await run(make_engine(model))
    engine = make_engine(
        model, capacity_policy=MAX_UTIL, num_kv_blocks=16, max_batch_size=6, max_num_tokens=8, preemption_mode=mode
    )
    assert await run(engine) == reference
    assert engine.stats().preempted_total >= 3
