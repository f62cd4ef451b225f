"""KV allocator, capacity scheduling (docs/algorithms.md 5) and the continuous-batching engine."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection, Sequence

import pytest
import torch

from services.common.waiting import wait_until
from services.model_format import synth
from services.worker.engine.engine import (
    Engine,
    EngineConfig,
    EngineDeadError,
    EngineStoppedError,
    PacingProfile,
    RequestMovedError,
    RequestTooLarge,
    TokenEvent,
)
from services.worker.engine.kv_cache import KVCache, OutOfBlocks
from services.worker.engine.sampling import SamplingParams
from services.worker.engine.scheduler import CapacityPolicy, RunningSeq, SchedulerLimits, WaitingSeq, schedule
from services.worker.model.llama import LlamaForCausalLM, load_model

EOS = 2
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> LlamaForCausalLM:
    path = synth.synthesize(tmp_path_factory.mktemp("engine") / "tiny", "tiny", seed=0)
    return load_model(str(path))


def make_engine(model: LlamaForCausalLM, eos: Collection[int] = (EOS,), **overrides: object) -> Engine:
    # One compute thread: the test machines are small and shared, and OpenMP spinning with more
    # threads than free cores makes steps 10x slower.
    fields: dict[str, object] = {
        "max_batch_size": 4,
        "max_num_tokens": 64,
        "num_kv_blocks": 64,
        "num_threads": 1,
        **overrides,
    }
    return Engine.create(model, eos, EngineConfig(**fields))  # type: ignore[arg-type]


def reference_greedy(model: LlamaForCausalLM, prompt: Sequence[int], n: int) -> list[int]:
    """Greedy continuation with no cache at all: the whole sequence through the model each time."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor(ids))[-1].argmax()))
    return ids[len(prompt) :]


def prompt_of(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [1, *torch.randint(3, 2048, (n - 1,), generator=g).tolist()]


async def collect(engine: Engine, request_id: str, prompt: Sequence[int], params: SamplingParams) -> list[TokenEvent]:
    return [ev async for ev in engine.generate(request_id, prompt, params)]


# ---- KV cache ----------------------------------------------------------------------------------


def test_kv_allocator_allocates_extends_and_reuses_blocks() -> None:
    kv = KVCache(num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=8)
    assert (kv.total_blocks, kv.used_blocks, kv.capacity_tokens) == (8, 0, 32)
    assert [kv.blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    a = kv.allocate("a", 5)
    assert len(a) == 2 and kv.used_blocks == 2
    assert kv.extend("a", 8) == [] and len(kv.extend("a", 9)) == 1
    b = kv.allocate("b", 16)
    assert len(b) == 4 and not set(b) & set(kv.block_table("a")) and kv.free_blocks == 1
    with pytest.raises(OutOfBlocks, match="needs 2 more blocks, 1 of 8"):
        kv.allocate("c", 8)
    assert not kv.has("c") and kv.free_blocks == 1  # a failed allocation takes nothing
    assert kv.free("b") == 4 and kv.free("b") == 0
    assert sorted(kv.allocate("c", 16)) == sorted(b)  # freed blocks are reusable at once
    with pytest.raises(ValueError, match="'c' already has blocks"):
        kv.allocate("c", 1)
    with pytest.raises(ValueError, match="-3"):
        KVCache(num_layers=1, num_blocks=-3, block_size=4, num_kv_heads=1, head_dim=2)


def test_kv_storage_write_and_gather_and_budget(model: LlamaForCausalLM) -> None:
    cfg = model.config
    per_block = cfg.kv_bytes_per_token() * 16
    kv = KVCache.from_memory_budget(cfg, per_block * 10 + per_block // 2)
    assert kv.total_blocks == 10 and kv.nbytes == per_block * 10
    k_cache, _ = kv.layer_cache(1)
    assert tuple(k_cache.shape) == (10, 16, cfg.num_key_value_heads, cfg.head_dim)
    k = torch.randn(3, cfg.num_key_value_heads, cfg.head_dim)
    kv.write(1, torch.tensor([16 * 7 + 2, 3, 16 * 7 + 15]), k, -k)
    gk, gv = kv.gather(1, torch.tensor([7, 0]))
    assert torch.equal(gk[0, 2], k[0]) and torch.equal(gk[1, 3], k[1]) and torch.equal(gv[0, 15], -k[2])
    with pytest.raises(ValueError, match="holds no block"):
        KVCache.from_memory_budget(cfg, per_block - 1)
    with pytest.raises(IndexError, match="layer 5"):
        kv.layer_cache(5)


# ---- capacity scheduling -----------------------------------------------------------------------


def test_capacity_vector_pure_scheduler() -> None:
    """docs/algorithms.md 5: max_batch_size 4, max_num_tokens 12, 5-token prompts."""
    limits = SchedulerLimits(max_batch_size=4, max_num_tokens=12)
    waiting = [WaitingSeq(f"r{i}", 5, 1) for i in range(1, 6)]
    first = schedule([], waiting, 100, limits)
    # Requests 1 and 2 run; the remaining budget of 2 blocks the rest (FCFS stops at request 3).
    assert first.admitted == ("r1", "r2") and first.work == (("r1", 5), ("r2", 5))
    running = [RunningSeq("r1", 1), RunningSeq("r2", 1)]
    second = schedule(running, waiting[2:], 100, limits)
    # 2 generation tokens, then requests 3 and 4 enter; request 5 waits for the batch size.
    assert second.admitted == ("r3", "r4")
    assert second.work == (("r1", 1), ("r2", 1), ("r3", 5), ("r4", 5)) and second.num_tokens == 12
    full = [RunningSeq(f"r{i}", 1) for i in range(1, 5)]
    assert schedule(full, waiting[4:], 100, limits).admitted == ()
    after_r1 = schedule(full[1:], waiting[4:], 100, limits)
    assert after_r1.admitted == ("r5",) and after_r1.num_tokens == 3 + 5


def test_scheduler_kv_reservation_and_fcfs() -> None:
    limits = SchedulerLimits(max_batch_size=8, max_num_tokens=100)
    waiting = [WaitingSeq("big", 5, 6), WaitingSeq("small", 5, 1)]
    # The head needs 6 blocks, 5 are available: nobody starts, not even the small one behind it.
    assert schedule([], waiting, 5, limits).admitted == ()
    assert schedule([], waiting, 7, limits).admitted == ("big", "small")
    # Same for the token budget: a 2-token prompt that would fit does not overtake a 5-token one.
    tight = SchedulerLimits(max_batch_size=8, max_num_tokens=12)
    queue = [WaitingSeq("p1", 5, 1), WaitingSeq("p2", 5, 1), WaitingSeq("p3", 5, 1), WaitingSeq("p4", 2, 1)]
    assert schedule([], queue, 100, tight).admitted == ("p1", "p2")
    chunked = SchedulerLimits(max_batch_size=8, max_num_tokens=10, chunked_prefill=True)
    plan = schedule([RunningSeq("mid", 30), RunningSeq("dec", 1)], [WaitingSeq("new", 8, 1)], 9, chunked)
    assert plan.work == (("dec", 1), ("mid", 9)) and plan.admitted == ()


@pytest.mark.parametrize("policy", list(CapacityPolicy))
async def test_capacity_vector_in_the_engine(model: LlamaForCausalLM, policy: CapacityPolicy) -> None:
    # The vector is TensorRT-LLM's without chunked prefill (with it, request 3 would take the
    # budget's last 2 tokens as a first chunk); with KV to spare both policies batch alike.
    engine = make_engine(
        model, max_batch_size=4, max_num_tokens=12, enable_chunked_prefill=False, capacity_policy=policy
    )
    async with engine:
        tasks = [
            asyncio.create_task(
                collect(
                    engine,
                    f"r{i}",
                    prompt_of(5, i),
                    SamplingParams(temperature=0, max_tokens=2 if i == 1 else 6, ignore_eos=True),
                )
            )
            for i in range(1, 6)
        ]
        await asyncio.gather(*tasks)
    steps = list(engine.step_log)
    assert steps[0].work == (("r1", 5), ("r2", 5))
    assert steps[1].admitted == ("r3", "r4")
    assert steps[1].work == (("r1", 1), ("r2", 1), ("r3", 5), ("r4", 5))
    # Request 1 got its second (last) token in step 2; request 5 enters right after.
    assert steps[2].admitted == ("r5",)
    assert steps[2].work == (("r2", 1), ("r3", 1), ("r4", 1), ("r5", 5))


# ---- correctness -------------------------------------------------------------------------------


@pytest.mark.parametrize("chunked", [False, True], ids=["whole-prefill", "chunked-prefill"])
async def test_greedy_engine_matches_uncached_model(model: LlamaForCausalLM, chunked: bool) -> None:
    """Requests of different lengths join at different times; tokens equal the no-cache model's."""
    # block_size 4 puts sequences across many blocks; with chunking, a 7-token budget splits prompts.
    engine = make_engine(model, block_size=4, max_num_tokens=7 if chunked else 64, enable_chunked_prefill=chunked)
    prompts = {"a": prompt_of(11, 1), "b": prompt_of(3, 2), "c": prompt_of(19, 3), "d": prompt_of(6, 4)}
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outputs: dict[str, list[int]] = {}
    progress = {"a": asyncio.Event(), "c": asyncio.Event()}

    async def run(name: str, after: str | None = None) -> None:
        if after is not None:
            await progress[after].wait()
        tokens = []
        async for ev in engine.generate(name, prompts[name], params):
            assert ev.token_id is not None
            tokens.append(ev.token_id)
            if len(tokens) == 3 and name in progress:
                progress[name].set()
        outputs[name] = tokens

    async with engine:
        # a and b start together; c joins once a has 3 tokens; d once c has 3.
        await asyncio.gather(run("a"), run("b"), run("c", after="a"), run("d", after="c"))
        assert engine.kv_cache.used_blocks == 0
    for name, prompt in prompts.items():
        assert outputs[name] == reference_greedy(model, prompt, 10), name
    assert max(len(s.work) for s in engine.step_log) >= 3  # really batched


async def test_same_seed_same_output_regardless_of_batch(model: LlamaForCausalLM) -> None:
    prompt = prompt_of(7, 11)
    seeded = SamplingParams(temperature=1.0, max_tokens=12, seed=42, ignore_eos=True)
    engine = make_engine(model)
    async with engine:
        alone = [e.token_id for e in await collect(engine, "alone", prompt, seeded)]
        crowd = await asyncio.gather(
            collect(engine, "x", prompt_of(9, 1), SamplingParams(temperature=0.8, max_tokens=5, ignore_eos=True)),
            collect(engine, "seeded", prompt, seeded),
            collect(engine, "y", prompt_of(4, 2), SamplingParams(temperature=1.0, max_tokens=20, seed=1)),
        )
        other = await collect(
            engine, "other", prompt, SamplingParams(temperature=1.0, max_tokens=12, seed=43, ignore_eos=True)
        )
    assert [e.token_id for e in crowd[1]] == alone
    assert [e.token_id for e in other] != alone


# ---- log-probs, penalties, logit_bias ----------------------------------------------------------


def reference_processed_greedy(model: LlamaForCausalLM, prompt: Sequence[int], n: int, p: SamplingParams) -> list[int]:
    """Greedy with logit_bias and penalties applied by hand, element by element, over the no-cache
    model's logits: bias, repetition (prompt + output), frequency, presence."""
    ids, out = list(prompt), []
    for _ in range(n):
        x = model(torch.tensor(ids))[-1].float().clone()
        for token, bias in p.logit_bias:
            x[token] += bias
        for token in set(ids):
            x[token] = x[token] / p.repetition_penalty if x[token] > 0 else x[token] * p.repetition_penalty
        for token in set(out):
            x[token] -= p.frequency_penalty * out.count(token) + p.presence_penalty
        ids.append(int(x.argmax()))
        out.append(ids[-1])
    return out


async def test_penalties_and_logit_bias_match_a_reference(model: LlamaForCausalLM) -> None:
    prompt = [1, 7, 7, 7, 9, 9, 300, 7, 9]
    plain = reference_greedy(model, prompt, 10)
    p = SamplingParams(
        temperature=0,
        max_tokens=10,
        ignore_eos=True,
        repetition_penalty=1.8,
        frequency_penalty=0.6,
        presence_penalty=0.4,
        logit_bias={plain[3]: -5.0, 11: 1.5},
    )
    expected = reference_processed_greedy(model, prompt, 10, p)
    assert expected != plain  # the options change the output
    async with make_engine(model) as engine:
        penalized, greedy = await asyncio.gather(
            collect(engine, "penalized", prompt, p),
            collect(engine, "plain", prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)),
        )
    assert [e.token_id for e in penalized] == expected
    assert [e.token_id for e in greedy] == plain  # its batch-mate's options do not leak into it


async def test_seeded_request_with_penalties_ignores_its_batch(model: LlamaForCausalLM) -> None:
    prompt = prompt_of(6, 21)
    p = SamplingParams(temperature=0.9, seed=7, max_tokens=10, ignore_eos=True, frequency_penalty=1.0)
    async with make_engine(model) as engine:
        alone = [e.token_id for e in await collect(engine, "alone", prompt, p)]
        crowd = await asyncio.gather(
            collect(engine, "mate", prompt, SamplingParams(temperature=1.0, max_tokens=12, presence_penalty=2.0)),
            collect(engine, "seeded", prompt, p),
        )
    assert [e.token_id for e in crowd[1]] == alone


# ---- resuming a migrated request ---------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=14, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=0.9, seed=123, max_tokens=14, ignore_eos=True),
        SamplingParams(
            temperature=0.8, seed=9, max_tokens=14, ignore_eos=True, frequency_penalty=0.9, repetition_penalty=1.3
        ),
    ],
    ids=["greedy", "seeded", "seeded-penalties"],
)
@pytest.mark.parametrize("chunked", [False, True], ids=["whole-prefill", "chunked-prefill"])
async def test_a_resumed_request_continues_exactly(
    model: LlamaForCausalLM, params: SamplingParams, chunked: bool
) -> None:
    """Cut after k tokens and resumed on a fresh engine, a request gives the tokens the
    uninterrupted one gave after k: the resumed tokens are prefilled, count toward max_tokens,
    feed the penalties, and a seeded sampler skips the draws they took."""
    prompt = prompt_of(9, 5)
    async with make_engine(model) as engine:
        whole = await collect(engine, "whole", prompt, params)
    tokens = [e.token_id for e in whole]
    assert len(tokens) == params.max_tokens
    for k in (1, 6, 13):
        async with make_engine(model, enable_chunked_prefill=chunked, max_num_tokens=8 if chunked else 64) as engine:
            events = [ev async for ev in engine.generate("resumed", prompt, params, resume_token_ids=tokens[:k])]
        assert [e.token_id for e in events] == tokens[k:], k
        # Counts include the resumed tokens; nothing resumed is sent again.
        assert [e.completion_tokens for e in events] == list(range(k + 1, params.max_tokens + 1))
        assert events[-1].finish_reason == "length"


async def test_resuming_refuses_what_cannot_continue(model: LlamaForCausalLM) -> None:
    prompt = prompt_of(5, 1)
    async with make_engine(model) as engine:
        with pytest.raises(ValueError, match="already reach max_tokens=8"):
            await collect_resumed(engine, prompt, GREEDY, list(range(3, 11)))
        with pytest.raises(ValueError, match=r"resumed token ids outside \[0, 2048\): \[99999\]"):
            await collect_resumed(engine, prompt, GREEDY, [5, 99999])
        with pytest.raises(ValueError, match="prompt_logprobs cannot be asked of a resumed request"):
            await collect_resumed(engine, prompt, SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=1), [5])
        assert engine.kv_cache.used_blocks == 0


async def test_release_waiting_moves_only_queued_requests(model: LlamaForCausalLM) -> None:
    """Rebalancing releases the most recently queued requests; the running one goes on."""
    async with make_engine(model, max_batch_size=1, pacing=PacingProfile(base_s=0.01, per_token_s=0)) as engine:
        streams = {
            name: asyncio.create_task(collect(engine, name, prompt_of(5, i), GREEDY))
            for i, name in enumerate(["running", "queued-1", "queued-2", "queued-3"])
        }
        await wait_until(lambda: engine.stats().waiting == 3, 5, what="three queued requests")
        assert engine.release_waiting(2, "test") == ["queued-3", "queued-2"]
        for name in ("queued-3", "queued-2"):
            with pytest.raises(RequestMovedError, match=f"'{name}' released to another instance: test"):
                await streams[name]
        assert len(await streams["running"]) == GREEDY.max_tokens
        assert len(await streams["queued-1"]) == GREEDY.max_tokens
        assert engine.release_waiting(5, "test") == []
        assert engine.kv_cache.used_blocks == 0


async def test_release_waiting_also_releases_the_named_queued_requests(model: LlamaForCausalLM) -> None:
    """ZigZag take-back: the named queued requests (the oldest here, run ahead by a peer that
    has just loaded) leave besides the `max_requests` newest; a named one already running stays."""
    async with make_engine(model, max_batch_size=1, pacing=PacingProfile(base_s=0.01, per_token_s=0)) as engine:
        names = ["running", "queued-1", "queued-2", "queued-3", "queued-4"]
        streams = {
            name: asyncio.create_task(collect(engine, name, prompt_of(5, i), GREEDY)) for i, name in enumerate(names)
        }
        await wait_until(lambda: engine.stats().waiting == 4, 5, what="four queued requests")
        released = engine.release_waiting(1, "test", also=["queued-2", "queued-1", "running", "unknown"])
        assert released == ["queued-1", "queued-2", "queued-4"]  # named in queue order, then the newest
        for name in released:
            with pytest.raises(RequestMovedError, match=f"'{name}' released to another instance: test"):
                await streams[name]
        assert len(await streams["running"]) == GREEDY.max_tokens
        assert len(await streams["queued-3"]) == GREEDY.max_tokens
        assert engine.kv_cache.used_blocks == 0


async def collect_resumed(
    engine: Engine, prompt: Sequence[int], params: SamplingParams, resume: Sequence[int]
) -> list[TokenEvent]:
    return [ev async for ev in engine.generate("r", prompt, params, resume_token_ids=resume)]


@pytest.mark.parametrize("chunked", [False, True], ids=["whole-prefill", "chunked-prefill"])
async def test_logprobs_and_prompt_logprobs_match_the_model(model: LlamaForCausalLM, chunked: bool) -> None:
    prompt = prompt_of(13, 31)
    p = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    engine = make_engine(model, max_num_tokens=5 if chunked else 64, enable_chunked_prefill=chunked)
    async with engine:
        events, other = await asyncio.gather(
            collect(engine, "lp", prompt, p),
            collect(engine, "none", prompt_of(5, 2), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)),
        )
    generated = [e.token_id for e in events]
    assert generated == reference_greedy(model, prompt, 4)
    ref = torch.log_softmax(model(torch.tensor(prompt + generated[:-1])).float(), -1)
    first = events[0].prompt_logprobs
    assert [e.token_id for e in first] == prompt and first[0].logprob is None and first[0].top == ()
    for i in range(1, len(prompt)):
        assert first[i].logprob == pytest.approx(float(ref[i - 1, prompt[i]]), abs=1e-4)
        assert [t for t, _ in first[i].top] == ref[i - 1].topk(2).indices.tolist()
    for j, ev in enumerate(events):
        row = ref[len(prompt) - 1 + j]
        assert ev.logprob == pytest.approx(float(row[ev.token_id]), abs=1e-4) and ev.logprob <= 0
        assert [t for t, _ in ev.top_logprobs] == row.topk(3).indices.tolist()
        assert ev.top_logprobs[0] == (ev.token_id, ev.logprob)  # greedy: the chosen one leads
        assert j == 0 or ev.prompt_logprobs == ()
    assert all(e.top_logprobs == () and e.prompt_logprobs == () for e in other)
    if chunked:
        assert any(s.work and dict(s.work).get("lp", 0) < len(prompt) for s in engine.step_log)


async def test_logit_bias_outside_the_vocabulary_is_refused(model: LlamaForCausalLM) -> None:
    vocab = model.config.vocab_size
    async with make_engine(model) as engine:
        with pytest.raises(ValueError, match=f"logit_bias token id {vocab} is outside the vocabulary"):
            await collect(engine, "bad", [1, 2], SamplingParams(max_tokens=2, logit_bias={3: 1.0, vocab: 1.0}))
        assert engine.kv_cache.used_blocks == 0


# ---- finishing ---------------------------------------------------------------------------------


async def test_max_tokens_gives_length(model: LlamaForCausalLM) -> None:
    async with make_engine(model) as engine:
        events = await collect(
            engine, "r", prompt_of(5, 0), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        )
    assert [e.finish_reason for e in events] == [None, None, None, "length"]
    assert [e.completion_tokens for e in events] == [1, 2, 3, 4]
    assert all(e.prompt_tokens == 5 and e.logprob is not None and e.logprob <= 0 for e in events)


async def test_eos_and_stop_token_give_stop(model: LlamaForCausalLM) -> None:
    prompt = prompt_of(6, 5)
    expected = reference_greedy(model, prompt, 8)
    eos = expected[2]
    first = expected.index(eos)  # the first time the model emits that token
    async with make_engine(model, eos=(eos,)) as engine:
        events = await collect(engine, "eos", prompt, SamplingParams(temperature=0, max_tokens=8))
        ignoring = await collect(engine, "ignore", prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        stop_id = expected[4]
        stopped = await collect(
            engine,
            "stopid",
            prompt,
            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop_token_ids=(stop_id,)),
        )
    assert [e.token_id for e in events] == expected[: first + 1]
    assert events[-1].finish_reason == "stop" and events[-1].completion_tokens == first + 1
    assert ignoring[-1].finish_reason == "length" and len(ignoring) == 8
    assert stopped[-1].finish_reason == "stop" and stopped[-1].token_id == stop_id
    assert len(stopped) == expected.index(stop_id) + 1


async def test_abort_frees_blocks_at_once(model: LlamaForCausalLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    async with make_engine(model) as engine:
        stream = engine.generate("victim", prompt_of(40, 1), params)
        first = await stream.__anext__()
        assert first.token_id is not None and engine.kv_cache.used_blocks > 0
        engine.abort("victim")
        assert engine.kv_cache.used_blocks == 0 and engine.stats().kv_blocks_reserved == 0
        rest = [ev async for ev in stream]
        assert rest[-1].finish_reason == "abort" and rest[-1].token_id is None
        engine.abort("victim")  # already gone: a no-op

        # Closing the stream aborts too.
        stream = engine.generate("closed", prompt_of(40, 2), params)
        await stream.__anext__()
        await stream.aclose()
        assert engine.kv_cache.used_blocks == 0 and engine.stats().running == 0


async def test_cancelling_many_consumers_leaks_nothing(model: LlamaForCausalLM) -> None:
    engine = make_engine(model, max_batch_size=4, num_kv_blocks=40)
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    started = asyncio.Event()

    async def consume(i: int) -> None:
        async for ev in engine.generate(f"c{i}", prompt_of(20, i), params):
            if ev.completion_tokens >= 2:
                started.set()

    async with engine:
        tasks = [asyncio.create_task(consume(i)) for i in range(10)]  # 4 run, 6 wait
        await started.wait()
        for t in tasks:
            t.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(r, asyncio.CancelledError) for r in results)
        stats = engine.stats()
        assert (stats.running, stats.waiting, stats.kv_blocks_used, stats.kv_blocks_reserved) == (0, 0, 0, 0)
        # The engine still serves afterwards.
        events = await collect(engine, "after", prompt_of(5, 0), GREEDY)
        assert events[-1].finish_reason == "length"


# ---- errors ------------------------------------------------------------------------------------


async def test_requests_that_can_never_fit_fail_at_once(model: LlamaForCausalLM) -> None:
    # 128 tokens of KV; without chunked prefill a prompt longer than max_num_tokens cannot run.
    async with make_engine(model, num_kv_blocks=8, max_num_tokens=64, enable_chunked_prefill=False) as engine:
        with pytest.raises(
            RequestTooLarge,
            match=r"\(100 tokens\) \+ max_tokens \(50\) = 150 tokens need 10 KV blocks, the cache has 8",
        ):
            await collect(engine, "kv", prompt_of(100, 0), SamplingParams(max_tokens=50))
        with pytest.raises(RequestTooLarge, match="= 600 exceeds the model.s context of 512 tokens"):
            await collect(engine, "pos", prompt_of(100, 0), SamplingParams(max_tokens=500))
        with pytest.raises(RequestTooLarge, match="prompt of 70 tokens exceeds max_num_tokens 64"):
            await collect(engine, "chunk", prompt_of(70, 0), SamplingParams(max_tokens=5))
        with pytest.raises(ValueError, match=r"outside \[0, 2048\): \[5000\]"):
            await collect(engine, "vocab", [1, 5000], GREEDY)
        with pytest.raises(ValueError, match="empty prompt"):
            await collect(engine, "empty", [], GREEDY)
        # Nothing was left behind, and a fitting request still runs.
        assert engine.stats().waiting == 0
        assert (await collect(engine, "ok", prompt_of(50, 0), SamplingParams(temperature=0, max_tokens=20)))[
            -1
        ].finish_reason


async def test_duplicate_request_id_is_refused(model: LlamaForCausalLM) -> None:
    async with make_engine(model) as engine:
        stream = engine.generate("dup", prompt_of(5, 0), SamplingParams(max_tokens=50, ignore_eos=True))
        await stream.__anext__()
        with pytest.raises(ValueError, match="'dup' is already in flight"):
            await collect(engine, "dup", prompt_of(5, 0), GREEDY)
        await stream.aclose()


async def test_loop_crash_fails_every_pending_request(model: LlamaForCausalLM, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_engine(model, max_batch_size=2)

    def boom(*args: object, **kwargs: object) -> None:
        raise RuntimeError("device fell off the bus")

    async with engine:
        monkeypatch.setattr(engine, "_execute", boom)
        tasks = [asyncio.create_task(collect(engine, f"r{i}", prompt_of(5, i), GREEDY)) for i in range(3)]
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=10)
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert "device fell off the bus" in str(results[0])
        with pytest.raises(EngineDeadError):
            await collect(engine, "late", prompt_of(5, 0), GREEDY)
        assert engine.kv_cache.used_blocks == 0


async def test_stop_fails_in_flight_requests(model: LlamaForCausalLM) -> None:
    engine = make_engine(model)
    await engine.start()
    task = asyncio.create_task(collect(engine, "r", prompt_of(5, 0), SamplingParams(max_tokens=400, ignore_eos=True)))
    await wait_until(lambda: engine.stats().total_generated_tokens > 0, 30, interval_s=0.001, what="a first token")
    await engine.stop()
    with pytest.raises(EngineStoppedError):
        await asyncio.wait_for(task, timeout=5)
    with pytest.raises(EngineStoppedError):
        await collect(engine, "late", prompt_of(5, 0), GREEDY)


async def test_every_eos_id_stops_and_ignore_eos_ignores_them_all(model: LlamaForCausalLM) -> None:
    # A chat model has several EOS ids (SmolLM2: <|im_end|> ends a turn, <|endoftext|> a document).
    prompt = prompt_of(6, 5)
    expected = reference_greedy(model, prompt, 8)
    never = next(t for t in range(3, 2048) if t not in expected)
    for eos_id in (expected[2], expected[5]):
        async with make_engine(model, eos=(never, eos_id)) as engine:
            events = await collect(engine, f"eos-{eos_id}", prompt, SamplingParams(temperature=0, max_tokens=8))
        assert [e.token_id for e in events] == expected[: expected.index(eos_id) + 1]
        assert events[-1].finish_reason == "stop"
    async with make_engine(model, eos=(expected[5], expected[2])) as engine:
        both = await collect(engine, "both", prompt, SamplingParams(temperature=0, max_tokens=8))
        ignoring = await collect(engine, "ignore", prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    first = min(expected.index(expected[2]), expected.index(expected[5]))
    assert [e.token_id for e in both] == expected[: first + 1] and both[-1].finish_reason == "stop"
    assert [e.token_id for e in ignoring] == expected and ignoring[-1].finish_reason == "length"


def test_engine_refuses_bad_eos_ids(model: LlamaForCausalLM) -> None:
    kv = KVCache.for_model(model.config, num_blocks=4, block_size=16)
    with pytest.raises(ValueError, match="collection of token ids, got 2"):
        Engine(model, kv, 2, EngineConfig())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"eos_token_ids \[2048, 9999\] outside vocabulary \[0, 2048\)"):
        Engine(model, kv, (2, 2048, 9999), EngineConfig())


def test_engine_config_validation_quotes_values(model: LlamaForCausalLM) -> None:
    with pytest.raises(ValueError, match="max_num_tokens \\(4\\) must be >= max_batch_size \\(8\\)"):
        EngineConfig(max_batch_size=8, max_num_tokens=4)
    with pytest.raises(ValueError, match="-1"):
        EngineConfig(max_batch_size=-1)
    kv = KVCache.for_model(model.config, num_blocks=4, block_size=8)
    with pytest.raises(ValueError, match="block_size 8 != EngineConfig.block_size 16"):
        Engine(model, kv, (EOS,), EngineConfig())


# ---- pacing and stats --------------------------------------------------------------------------


async def test_pacing_pads_each_iteration(model: LlamaForCausalLM) -> None:
    pacing = PacingProfile(base_s=0.03, per_token_s=0.002)
    async with make_engine(model, pacing=pacing) as engine:
        t0 = time.monotonic()
        await collect(engine, "r", prompt_of(10, 0), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        elapsed = time.monotonic() - t0
    # One prefill step of 10 tokens and 3 decode steps of 1 token.
    assert elapsed >= (0.03 + 0.002 * 10) + 3 * (0.03 + 0.002) - 1e-3
    assert all(s.step_s >= pacing.step_time_s(sum(n for _, n in s.work)) - 1e-3 for s in engine.step_log)


async def test_stats_report_load_and_latency(model: LlamaForCausalLM) -> None:
    async with make_engine(model) as engine:
        empty = engine.stats()
        assert empty.ttft_p50_s is None and empty.kv_blocks_total == 64
        await asyncio.gather(*(collect(engine, f"r{i}", prompt_of(8, i), GREEDY) for i in range(3)))
        stats = engine.stats()
    assert stats.total_generated_tokens == 24 and stats.total_prompt_tokens == 24
    assert stats.decode_tokens_per_s > 0 and stats.prefill_tokens_per_s > 0
    assert stats.ttft_p50_s is not None and stats.ttft_p99_s is not None and stats.ttft_p50_s <= stats.ttft_p99_s
    assert stats.tbt_p50_s is not None and stats.tbt_p99_s is not None
    assert (stats.running, stats.waiting, stats.kv_blocks_used) == (0, 0, 0)


async def test_prefill_capacity_is_the_paced_slope_not_the_demand(model: LlamaForCausalLM) -> None:
    # Each step is paced to 0.03 s + 0.004 s a token: prefill steps of 8, 24 and 48 prompt
    # tokens give a capacity of 1 / 0.004 = 250 tokens/s, however rarely prompts arrive.
    pacing = PacingProfile(base_s=0.03, per_token_s=0.004)
    async with make_engine(model, pacing=pacing) as engine:
        assert engine.stats().prefill_capacity_tps == 0.0  # no prefill step yet: not measured
        for i, n in enumerate((8, 24, 48)):
            await collect(engine, f"r{i}", prompt_of(n, i), SamplingParams(temperature=0, max_tokens=1))
        capacity = engine.stats().prefill_capacity_tps
    assert 200 <= capacity <= 260, capacity


async def test_waiting_prefill_tokens_counts_queued_prompts(model: LlamaForCausalLM) -> None:
    async with make_engine(model, max_batch_size=1, max_num_tokens=64) as engine:
        long = asyncio.create_task(
            collect(engine, "first", prompt_of(5, 0), SamplingParams(max_tokens=50, ignore_eos=True))
        )
        queued = asyncio.create_task(collect(engine, "second", prompt_of(9, 1), GREEDY))
        # "first" is prefilled and decoding
        await wait_until(lambda: engine.stats().total_generated_tokens > 0, 30, interval_s=0.001, what="a first token")
        stats = engine.stats()
        assert (stats.running, stats.waiting, stats.waiting_prefill_tokens) == (1, 1, 9)
        assert engine.queued_prefill_tokens() == 9
        # The wait a new arrival sees: at the measured capacity, 0 while none is measured.
        capacity = stats.prefill_capacity_tps
        assert engine.queued_prefill_wait_s() == (pytest.approx(9 / capacity) if capacity else 0.0)
        await asyncio.gather(long, queued)
    assert engine.queued_prefill_wait_s() == 0.0


def test_engine_needs_a_complete_model(model: LlamaForCausalLM) -> None:
    empty = LlamaForCausalLM(model.config)
    engine = Engine.create(empty, (EOS,), EngineConfig(num_kv_blocks=4))

    async def start() -> None:
        await engine.start()

    with pytest.raises(RuntimeError, match="not complete"):
        asyncio.run(start())
