"""The engine's side of ZigZag live scaling (docs/algorithms.md 3): a loading instance runs a
prompt through the layers it holds, as they arrive, until its full partner relays the request;
the partner pulls the KV of those layers, runs the rest on the hidden states and decodes. Split
this way, at any layer, a request gives exactly the tokens of a whole run. (The data plane
between the two is tested in tests/integration/test_zigzag_worker.py.)"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from services.common.waiting import wait_until
from services.model_format import synth
from services.model_format.checkpoint import Checkpoint
from services.worker.engine.engine import (
    Engine,
    EngineConfig,
    EngineStoppedError,
    KVBlocks,
    PacingProfile,
    Relayed,
    RelayOutcome,
    TokenEvent,
)
from services.worker.engine.sampling import SamplingParams
from services.worker.model.llama import LlamaForCausalLM
from tests.unit.test_engine import collect, make_engine, prompt_of

PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # The tiny preset with 4 decoder layers, so a request can split at 0, 1, 2 or all of them.
    return synth.synthesize(
        tmp_path_factory.mktemp("zigzag") / "tiny4", "tiny", seed=0, overrides={"num_hidden_layers": 4}
    )


def partial_model(path: Path, layers: int, *, embed: bool = True) -> tuple[LlamaForCausalLM, Checkpoint]:
    """The model as a loading instance holds it: decoder layers [0, layers), and the embedding
    (which a live load streams after the layers) when `embed`."""
    ckpt = Checkpoint(path)
    model = LlamaForCausalLM(ckpt.config)
    model.load_groups(ckpt.iter_groups([*(["embed"] if embed else []), *(f"layers.{i}" for i in range(layers))]))
    return model, ckpt


def full_model(path: Path) -> LlamaForCausalLM:
    """The complete model, loaded the same way as a partial one."""
    model, ckpt = partial_model(path, 4)
    load_layer(model, ckpt, "head")
    return model


async def whole_run(full: LlamaForCausalLM, prompt: Sequence[int]) -> list[int | None]:
    """The greedy tokens of `prompt` served whole: what every split must give."""
    async with make_engine(full) as whole:
        return [e.token_id for e in await collect(whole, "r", prompt, PARAMS)]


def load_layer(model: LlamaForCausalLM, ckpt: Checkpoint, group: str) -> None:
    model.load_groups(ckpt.iter_groups([group]))


def loading_engine(model: LlamaForCausalLM, **overrides: object) -> Engine:
    fields: dict[str, object] = {"max_batch_size": 4, "max_num_tokens": 128, "num_kv_blocks": 64, "num_threads": 1}
    return Engine.create(model, [2], EngineConfig(**{**fields, **overrides}))  # type: ignore[arg-type]


def relay_from(source: Engine, request_id: str, *, fail: bool = False):
    """The partner's relay: ask the loading engine to stop the request, copy the KV of the
    layers it ran (as the data plane does) and bring the hidden states."""

    async def fill(blocks: KVBlocks) -> Relayed:
        outcome = await source.relay(request_id)
        if fail:
            raise ConnectionError("the loading instance died mid-relay")
        if outcome.layers == 0 or outcome.parked_kv is None:
            return Relayed(0)
        table = blocks.allocate(blocks.request_id, outcome.num_tokens)
        src = source.kv_cache.block_table(outcome.parked_kv)[: len(table)]
        (sk, sv), (dk, dv) = source.kv_cache.storage(), blocks._cache.storage()
        dk[: outcome.layers, table] = sk[: outcome.layers, src]
        dv[: outcome.layers, table] = sv[: outcome.layers, src]
        source.release_parked(outcome.parked_kv)
        return Relayed(outcome.layers, outcome.hidden)

    return fill


async def zigzag(
    new: Engine, old: Engine, request_id: str, prompt: Sequence[int], params: SamplingParams
) -> tuple[list[TokenEvent], list[TokenEvent]]:
    first = asyncio.create_task(collect_stream(new.generate(request_id, prompt, params, zigzag=True)))
    await wait_until(lambda: request_id in new._by_id, 5, what="the zigzag request on the loading instance")
    rest = await collect_stream(old.generate(request_id, prompt, params, relay_fill=relay_from(new, request_id)))
    return await first, rest


async def collect_stream(stream) -> list[TokenEvent]:
    return [ev async for ev in stream]


@pytest.mark.parametrize("layers", [0, 1, 2, 4], ids=lambda k: f"k={k}")
@pytest.mark.parametrize("params", [PARAMS, SEEDED], ids=["greedy", "seeded"])
async def test_a_request_split_at_any_layer_gives_the_tokens_of_a_whole_run(
    ckpt: Path, layers: int, params: SamplingParams
) -> None:
    full = full_model(ckpt)
    prompts = [prompt_of(n, seed) for seed, n in enumerate((7, 23, 40))]
    async with make_engine(full) as whole:
        expected = await asyncio.gather(*(collect(whole, f"r{i}", p, params) for i, p in enumerate(prompts)))
    model, _ = partial_model(ckpt, layers)
    new = loading_engine(model)
    await new.start(partial=True)
    try:
        async with make_engine(full) as old:
            # The loading instance has run every layer it holds before the partner takes over.
            for i, p in enumerate(prompts):
                first, rest = await zigzag_after_progress(new, old, f"r{i}", p, params, layers)
                assert len(first) == 1 and first[0].zigzag_layers == layers and first[0].token_id is None
                assert [e.token_id for e in rest] == [e.token_id for e in expected[i]], (layers, i)
            assert old.zigzag == {
                "relayed": 0,
                "continued": len(prompts) if layers else 0,
                "recomputed": 0 if layers else len(prompts),
                "partner_embedded": 0,
            }
            assert old.kv_cache.used_blocks == 0
        assert new.zigzag["relayed"] == len(prompts)
        assert new.kv_cache.used_blocks == 0 and new.stats().kv_blocks_parked == 0
    finally:
        await new.stop()


def embedded(model: LlamaForCausalLM, prompt: Sequence[int]) -> torch.Tensor:
    return model.embed(torch.tensor(prompt, dtype=torch.long))


def layers_run(engine: Engine, request_id: str) -> int | None:
    seq = engine._by_id.get(request_id)
    return None if seq is None else seq.zz_layers


@pytest.mark.parametrize("params", [PARAMS, SEEDED], ids=["greedy", "seeded"])
async def test_a_loading_instance_without_its_embedding_runs_prompts_the_partner_embedded(
    ckpt: Path, params: SamplingParams
) -> None:
    full = full_model(ckpt)
    prompts = [prompt_of(n, seed) for seed, n in enumerate((7, 23, 40))]
    async with make_engine(full) as whole:
        expected = await asyncio.gather(*(collect(whole, f"r{i}", p, params) for i, p in enumerate(prompts)))
    # Layers 0 and 1 arrived; the embedding (streamed after every layer) has not.
    model, ckpt_ = partial_model(ckpt, 2, embed=False)
    new = loading_engine(model)
    await new.start(partial=True)
    try:
        with pytest.raises(ValueError, match="embedding is not loaded here yet"):
            await collect_stream(new.generate("bare", prompts[0], params, zigzag=True))
        with pytest.raises(ValueError, match=r"expected \(7, 128\)"):
            await collect_stream(
                new.generate("short", prompts[0], params, zigzag=True, zigzag_embedded=embedded(full, prompts[1]))
            )
        async with make_engine(full) as old:
            for i, p in enumerate(prompts):
                # The partner's lookup of the same weights (services/worker/zigzag.py `embed_from`).
                first = asyncio.create_task(
                    collect_stream(new.generate(f"r{i}", p, params, zigzag=True, zigzag_embedded=embedded(full, p)))
                )
                loaded = model.num_layers_loaded
                await wait_until(
                    lambda i=i, k=loaded: layers_run(new, f"r{i}") == k, 10, what="the prompt through the loaded layers"
                )
                if i == 1:
                    # The next layer lands: the request runs it too, from its hidden states.
                    load_layer(model, ckpt_, "layers.2")
                    new.notify_layers()
                    await wait_until(lambda: layers_run(new, "r1") == 3, 10, what="the prompt through the third layer")
                rest = await collect_stream(old.generate(f"r{i}", p, params, relay_fill=relay_from(new, f"r{i}")))
                assert (await first)[0].zigzag_layers == (2 if i == 0 else 3)
                assert [e.token_id for e in rest] == [e.token_id for e in expected[i]], i
            assert old.zigzag["continued"] == len(prompts) and old.zigzag["recomputed"] == 0
        assert new.zigzag["partner_embedded"] == len(prompts)
        assert new.kv_cache.used_blocks == 0
    finally:
        await new.stop()


@pytest.mark.parametrize("params", [PARAMS, SEEDED], ids=["greedy", "seeded"])
async def test_every_layer_but_no_embedding_or_head_leaves_the_partner_only_the_head(
    ckpt: Path, params: SamplingParams
) -> None:
    """The last stretch of a live load: every decoder layer is here, the embedding and the head
    are not. The loading instance runs all L layers of prompts its partner embedded; the partner
    pulls the KV of every layer and applies only the head."""
    full = full_model(ckpt)
    num_layers = full.config.num_hidden_layers
    prompts = [prompt_of(n, seed) for seed, n in enumerate((9, 31))]
    async with make_engine(full) as whole:
        expected = await asyncio.gather(*(collect(whole, f"r{i}", p, params) for i, p in enumerate(prompts)))
    model, _ = partial_model(ckpt, num_layers, embed=False)
    assert model.num_layers_loaded == num_layers and not model.is_complete
    new = loading_engine(model)
    await new.start(partial=True)
    try:
        with pytest.raises(EngineStoppedError, match="still loading"):
            await collect_stream(new.generate("whole", prompts[0], params))
        async with make_engine(full) as old:
            for i, p in enumerate(prompts):
                first = asyncio.create_task(
                    collect_stream(new.generate(f"r{i}", p, params, zigzag=True, zigzag_embedded=embedded(full, p)))
                )
                await wait_until(
                    lambda i=i: layers_run(new, f"r{i}") == num_layers, 10, what="the prompt through every layer"
                )
                rest = await collect_stream(old.generate(f"r{i}", p, params, relay_fill=relay_from(new, f"r{i}")))
                assert (await first)[0].zigzag_layers == num_layers
                assert [e.token_id for e in rest] == [e.token_id for e in expected[i]], i
            assert old.zigzag["continued"] == len(prompts) and old.zigzag["recomputed"] == 0
            assert old.kv_cache.used_blocks == 0
        assert new.kv_cache.used_blocks == 0 and new.stats().kv_blocks_parked == 0
    finally:
        await new.stop()


async def zigzag_after_progress(
    new: Engine, old: Engine, request_id: str, prompt: Sequence[int], params: SamplingParams, layers: int
) -> tuple[list[TokenEvent], list[TokenEvent]]:
    first = asyncio.create_task(collect_stream(new.generate(request_id, prompt, params, zigzag=True)))
    await wait_until(
        lambda: (seq := new._by_id.get(request_id)) is not None and seq.zz_layers == layers,
        5,
        what=f"the request through {layers} layers on the loading instance",
    )
    rest = await collect_stream(old.generate(request_id, prompt, params, relay_fill=relay_from(new, request_id)))
    return await first, rest


async def test_layers_arriving_while_a_request_waits_are_run_in_turn(ckpt: Path) -> None:
    """FCFS with requests whose next layer is loaded first: each arriving layer runs for every
    waiting request; the relay then carries all of them."""
    full = full_model(ckpt)
    prompt = prompt_of(19, 3)
    expected = await whole_run(full, prompt)
    model, source = partial_model(ckpt, 1)
    new = loading_engine(model)
    await new.start(partial=True)
    try:
        streams = [
            asyncio.create_task(collect_stream(new.generate(f"r{i}", prompt, PARAMS, zigzag=True))) for i in range(2)
        ]
        for k in (1, 2, 3):
            await wait_until(lambda k=k: through(new, 2, k), 5, what=f"both through {k} layers")
            load_layer(model, source, f"layers.{k}")
            new.notify_layers()
        await wait_until(lambda: through(new, 2, 4), 5, what="both through all 4 layers")
        assert new.stats().zigzag_running == 2
        async with make_engine(full) as old:
            for i in range(2):
                rest = await collect_stream(old.generate(f"r{i}", prompt, PARAMS, relay_fill=relay_from(new, f"r{i}")))
                assert [e.token_id for e in rest] == expected
                assert (await streams[i])[0].zigzag_layers == 4
    finally:
        await new.stop()


def through(engine: Engine, n: int, layers: int) -> bool:
    """Requests r0..r{n-1} have run exactly `layers` layers on the loading engine."""
    seqs = [engine._by_id.get(f"r{i}") for i in range(n)]
    return all(s is not None and s.zz_layers == layers for s in seqs)


async def test_a_prompt_run_through_every_layer_while_loading_serves_from_the_prefix_cache(ckpt: Path) -> None:
    """The load completed under a ZigZag request: its prompt's KV is whole here. When the
    request then moves here whole (its partner's backlog rebalanced onto this instance), its
    first-layer hop is cancelled, and the prompt's full blocks serve it from the prefix cache,
    with the tokens of a whole run."""
    full = full_model(ckpt)
    prompt = prompt_of(40, 5)
    model, source = partial_model(ckpt, 1)
    new = loading_engine(model)
    await new.start(partial=True)
    try:
        stream = asyncio.create_task(collect_stream(new.generate("r0", prompt, PARAMS, zigzag=True)))
        for k in (1, 2, 3):
            await wait_until(lambda k=k: through(new, 1, k), 5, what=f"through {k} layers")
            load_layer(model, source, f"layers.{k}")
            new.notify_layers()
        await wait_until(lambda: through(new, 1, 4), 5, what="through all 4 layers")
        load_layer(model, source, "head")
        new.abort("r0")  # the gateway cancels the first-layer hop
        await stream
        before = new.stats().prefix_hit_tokens
        served = [e.token_id for e in await collect(new, "r0-moved", prompt, PARAMS)]
        assert new.stats().prefix_hit_tokens - before >= new.kv_cache.block_size
        assert served == await whole_run(full, prompt)
    finally:
        await new.stop()


async def test_the_whole_request_supersedes_its_first_layer_hop_still_held_here(ckpt: Path) -> None:
    """The partner released a queued ZigZag request (rebalanced onto this instance, loaded now)
    and the gateway routes it here whole, under the same id, before the cancel of its
    first-layer hop has reached this instance: the whole request takes the id over (it was
    refused as 'already in flight', found by the chaos suite), the hop's stream ends aborted,
    and the tokens are those of a whole run."""
    full = full_model(ckpt)
    prompt = prompt_of(40, 6)
    model, source = partial_model(ckpt, 1)
    new = loading_engine(model)
    await new.start(partial=True)
    try:
        hop = asyncio.create_task(collect_stream(new.generate("r0", prompt, PARAMS, zigzag=True)))
        await wait_until(lambda: through(new, 1, 1), 5, what="through 1 layer")
        for group in ("layers.1", "layers.2", "layers.3", "head"):
            load_layer(model, source, group)
        new.notify_layers()
        served = [e.token_id for e in await collect(new, "r0", prompt, PARAMS)]
        assert served == await whole_run(full, prompt)
        events = await asyncio.wait_for(hop, 5)
        assert [e.finish_reason for e in events] == ["abort"]
    finally:
        await new.stop()


async def test_a_loading_engine_refuses_whole_requests(ckpt: Path) -> None:
    model, _ = partial_model(ckpt, 2)
    new = loading_engine(model)
    with pytest.raises(RuntimeError, match="model is not complete"):
        await new.start()
    await new.start(partial=True)
    try:
        with pytest.raises(EngineStoppedError, match=r"still loading \(2 of 4 layers\)"):
            await collect(new, "r", prompt_of(5, 1), PARAMS)
        with pytest.raises(ValueError, match="cannot ask for prompt_logprobs"):
            await collect_stream(
                new.generate("r", [1, 5], SamplingParams(temperature=0, prompt_logprobs=1), zigzag=True)
            )
    finally:
        await new.stop()


async def test_an_abort_while_its_next_layers_compute_leaves_the_engine_alive(ckpt: Path) -> None:
    """The gateway aborts a ZigZag request (its partner took it over, or the client left) while
    the step running its next layers is queued for the compute thread: the step must not read
    the request's state the abort cleared (it crashed the engine loop in bench.live_scaling)."""
    model, ckpt_groups = partial_model(ckpt, 1)
    new = loading_engine(model)
    await new.start(partial=True)
    try:
        first = asyncio.create_task(collect_stream(new.generate("r", prompt_of(30, 7), PARAMS, zigzag=True)))
        await wait_until(lambda: getattr(new._by_id.get("r"), "zz_layers", 0) == 1, 5, what="layer 0 run")
        gate = threading.Event()
        assert new._executor is not None
        new._executor.submit(gate.wait, 10)  # the compute thread is busy until released
        load_layer(model, ckpt_groups, "layers.1")
        new.notify_layers()
        await wait_until(lambda: "r" in new._in_step, 5, what="the step of layer 1 dispatched")
        new.abort("r")
        gate.set()
        events = await asyncio.wait_for(first, 10)
        assert events[-1].finish_reason == "abort"
        load_layer(model, ckpt_groups, "layers.2")
        second = asyncio.create_task(collect_stream(new.generate("s", prompt_of(9, 3), PARAMS, zigzag=True)))
        await wait_until(lambda: getattr(new._by_id.get("s"), "zz_layers", 0) == 3, 5, what="the engine still runs")
        assert new.stats().running == 1
        new.abort("s")
        await second
    finally:
        await new.stop()


async def test_a_relay_before_the_request_arrives_ends_it_at_once(ckpt: Path) -> None:
    model, _ = partial_model(ckpt, 2)
    new = loading_engine(model)
    await new.start(partial=True)
    try:
        assert await new.relay("late") == RelayOutcome(0, 0)
        events = await collect_stream(new.generate("late", prompt_of(9, 2), PARAMS, zigzag=True))
        assert [e.zigzag_layers for e in events] == [0] and new.kv_cache.used_blocks == 0
    finally:
        await new.stop()


async def test_a_failed_relay_is_recomputed_on_the_partner(ckpt: Path) -> None:
    full = full_model(ckpt)
    prompt = prompt_of(17, 5)
    expected = await whole_run(full, prompt)
    model, _ = partial_model(ckpt, 3)
    new = loading_engine(model)
    await new.start(partial=True)
    try:
        first = asyncio.create_task(collect_stream(new.generate("r", prompt, PARAMS, zigzag=True)))
        await wait_until(lambda: getattr(new._by_id.get("r"), "zz_layers", 0) == 3, 5, what="3 layers run")
        async with make_engine(full) as old:
            rest = await collect_stream(old.generate("r", prompt, PARAMS, relay_fill=relay_from(new, "r", fail=True)))
            assert [e.token_id for e in rest] == expected
            assert old.zigzag["recomputed"] == 1
        await first
    finally:
        await new.stop()


@pytest.mark.parametrize(
    ("partner_order", "expected"),
    [("relay_first", ["busy", "zz", "own"]), ("arrival", ["busy", "own", "zz"])],
)
async def test_the_partner_order_of_zigzag_work(ckpt: Path, partner_order: str, expected: list[str]) -> None:
    """By default a relayed request goes ahead of the partner's own waiting requests, so the
    pair runs as a pipeline; with `zigzag_partner_order="arrival"` it queues in arrival order
    with them. Here the partner's own request arrives first, while the partner is busy."""
    full = full_model(ckpt)
    model, _ = partial_model(ckpt, 2)
    new = loading_engine(model)
    await new.start(partial=True)
    pacing = PacingProfile(base_s=0.01, per_token_s=0)
    order: list[str] = []

    async def run(engine: Engine, rid: str, **kw: object) -> None:
        async for ev in engine.generate(rid, prompt_of(9, 1), PARAMS, **kw):  # type: ignore[arg-type]
            if ev.completion_tokens == 1:
                order.append(rid)

    try:
        async with make_engine(full, max_batch_size=1, pacing=pacing, zigzag_partner_order=partner_order) as old:
            busy = asyncio.create_task(run(old, "busy"))
            await wait_until(lambda: old.stats().running == 1, 5, what="the partner busy")
            own = asyncio.create_task(run(old, "own"))
            await wait_until(lambda: old.stats().waiting == 1, 5, what="the partner's own request queued")
            zz = asyncio.create_task(collect_stream(new.generate("zz", prompt_of(9, 1), PARAMS, zigzag=True)))
            relayed = asyncio.create_task(run(old, "zz", relay_fill=relay_from(new, "zz")))
            await wait_until(lambda: old.stats().waiting == 2, 5, what="the relayed request queued")
            await asyncio.gather(busy, relayed, own, zz)
        assert order == expected
    finally:
        await new.stop()


async def test_a_relay_waits_for_the_layers_the_loading_instance_can_still_run(ckpt: Path) -> None:
    """Relayed the moment it arrives, a request first runs every layer loaded there (one step),
    so the partner gets that work done, not an untouched prompt."""
    model, _ = partial_model(ckpt, 3)
    new = loading_engine(model, pacing=PacingProfile(base_s=0.02, per_token_s=0))
    await new.start(partial=True)
    try:
        first = asyncio.create_task(collect_stream(new.generate("r", prompt_of(30, 7), PARAMS, zigzag=True)))
        await wait_until(lambda: "r" in new._by_id, 5, what="the request on the loading instance")
        outcome = await new.relay("r")
        assert outcome.layers == 3 and outcome.parked_kv is not None and outcome.hidden is not None
        assert [e.zigzag_layers for e in await first] == [3]
        assert new.release_parked(outcome.parked_kv) > 0
    finally:
        await new.stop()


async def test_zigzag_on_a_prefill_instance_hands_the_whole_kv_to_decode(ckpt: Path) -> None:
    """Disaggregated: the partner is a prefill instance. It takes the request over from the
    loading instance, runs the rest of the prompt, emits the first token and hands the KV of
    every layer (the relayed first layers included) to the decode instance, which continues
    with the whole run's tokens."""
    from tests.unit.test_engine_handoff import copy_fill

    full = full_model(ckpt)
    prompt = prompt_of(26, 9)
    expected = await whole_run(full, prompt)
    model, _ = partial_model(ckpt, 2)
    new = loading_engine(model)
    await new.start(partial=True)
    try:
        async with make_engine(full) as prefill, make_engine(full) as decode:
            first = asyncio.create_task(collect_stream(new.generate("r", prompt, PARAMS, zigzag=True)))
            await wait_until(lambda: getattr(new._by_id.get("r"), "zz_layers", 0) == 2, 5, what="2 layers run")
            (head,) = [
                ev async for ev in prefill.generate("r", prompt, PARAMS, handoff=True, relay_fill=relay_from(new, "r"))
            ]
            assert head.parked_kv is not None and head.kv_tokens == len(prompt)
            assert prefill.zigzag["continued"] == 1
            fill = copy_fill(prefill.kv_cache, head.parked_kv, head.kv_tokens)
            rest = [ev async for ev in decode.generate("r", prompt, PARAMS, [head.token_id], kv_fill=fill)]
            assert [head.token_id] + [e.token_id for e in rest] == expected
            assert (await first)[0].zigzag_layers == 2
            prefill.release_parked(head.parked_kv)
    finally:
        await new.stop()


@pytest.mark.parametrize("budget", [13, 32], ids=lambda b: f"budget={b}")
@pytest.mark.parametrize("params", [PARAMS, SEEDED], ids=["greedy", "seeded"])
async def test_a_relayed_prompt_longer_than_one_iteration_continues_in_chunks(
    ckpt: Path, budget: int, params: SamplingParams
) -> None:
    """With chunked prefill (the default) the partner runs a relayed prompt longer than
    `max_num_tokens` in chunks, as any prefill: each chunk runs layers [k, L) on its slice of the
    hidden states the loading instance brought, over the earlier chunks' KV, and only the last
    samples. With a plain request sharing the steps, both give the tokens of a whole run."""
    full = full_model(ckpt)
    prompt, other = prompt_of(40, 7), prompt_of(21, 8)
    async with make_engine(full) as whole:
        expected = [e.token_id for e in await collect(whole, "long", prompt, params)]
        expected_other = [e.token_id for e in await collect(whole, "plain", other, params)]
    model, _ = partial_model(ckpt, 2)
    new = loading_engine(model)
    await new.start(partial=True)
    try:
        config = EngineConfig(max_batch_size=4, max_num_tokens=budget, num_kv_blocks=64, num_threads=1)
        async with Engine.create(full, [2], config) as old:
            assert old.config.enable_chunked_prefill
            first = asyncio.create_task(collect_stream(new.generate("long", prompt, params, zigzag=True)))
            await wait_until(
                lambda: (seq := new._by_id.get("long")) is not None and seq.zz_layers == 2,
                5,
                what="the request through 2 layers on the loading instance",
            )
            plain = asyncio.create_task(collect(old, "plain", other, params))
            rest = await asyncio.wait_for(
                collect_stream(old.generate("long", prompt, params, relay_fill=relay_from(new, "long"))), 60
            )
            assert [e.token_id for e in rest] == expected
            assert [e.token_id for e in await asyncio.wait_for(plain, 60)] == expected_other
            assert old.zigzag == {"relayed": 0, "continued": 1, "recomputed": 0, "partner_embedded": 0}
            chunks = [n for rec in old.step_log for rid, n in rec.work if rid == "long" and n > 1]
            assert sum(chunks) == len(prompt) and len(chunks) >= -(-len(prompt) // budget), chunks
            (relayed,) = await asyncio.wait_for(first, 10)
            assert relayed.zigzag_layers == 2 and relayed.token_id is None
        assert old.kv_cache.used_blocks == 0
        assert new.kv_cache.used_blocks == 0 and new.stats().kv_blocks_parked == 0
    finally:
        await new.stop()


async def test_a_queued_request_pulled_ahead_by_a_loading_instance_gives_whole_run_tokens(ckpt: Path) -> None:
    """ZigZag pulled (BlitzScale's NewPrefill): while the partner is busy, its own waiting
    requests are offered in admission order; one marked a continuation (`attach_relay`) has its
    first layers run ahead by the loading engine and is taken over when admitted, with exactly the
    tokens of a whole run. A request already running, or one asking for prompt log-probs, is
    never offered, and one no longer waiting cannot be attached."""
    full = full_model(ckpt)
    prompts = {rid: prompt_of(n, seed) for seed, (rid, n) in enumerate((("busy", 9), ("a", 17), ("b", 30)))}
    async with make_engine(full) as whole:
        expected = {rid: [e.token_id for e in await collect(whole, rid, p, PARAMS)] for rid, p in prompts.items()}
    model, _ = partial_model(ckpt, 2)
    new = loading_engine(model)
    await new.start(partial=True)
    pacing = PacingProfile(base_s=0.05, per_token_s=0)
    try:
        async with make_engine(full, max_batch_size=1, pacing=pacing) as old:
            streams = {"busy": asyncio.create_task(collect_stream(old.generate("busy", prompts["busy"], PARAMS)))}
            await wait_until(lambda: old.stats().running == 1, 5, what="the partner busy")
            logprobs = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, prompt_logprobs=1)
            streams["lp"] = asyncio.create_task(collect_stream(old.generate("lp", prompts["a"], logprobs)))
            for rid in ("a", "b"):
                streams[rid] = asyncio.create_task(collect_stream(old.generate(rid, prompts[rid], PARAMS)))
            await wait_until(lambda: old.stats().waiting == 3, 5, what="three requests queued on the partner")
            offered = old.offload_candidates(4)
            assert [rid for rid, _, _ in offered] == ["a", "b"]
            assert old.offload_candidates(4, exclude={"a"})[0][0] == "b"
            assert not old.attach_relay("busy", relay_from(new, "busy"))  # running, not waiting
            ahead = {}
            for rid, prompt, params in offered:
                ahead[rid] = asyncio.create_task(collect_stream(new.generate(rid, prompt, params, zigzag=True)))
                assert old.attach_relay(rid, relay_from(new, rid))
            assert old.offload_candidates(4) == []  # attached ones are continuations now
            outputs = {rid: await task for rid, task in streams.items()}
            firsts = {rid: await task for rid, task in ahead.items()}
        for rid in ("busy", "a", "b"):
            assert [e.token_id for e in outputs[rid]] == expected[rid], rid
        assert all(len(f) == 1 and f[0].zigzag_layers == 2 for f in firsts.values()), firsts
        assert old.zigzag["continued"] == 2 and old.zigzag["recomputed"] == 0
        assert old.kv_cache.used_blocks == 0 and new.kv_cache.used_blocks == 0
    finally:
        await new.stop()
