"""SCORPIO in the engine (scheduling_policy="scorpio", docs/algorithms.md 4): greedy outputs equal
FCFS's, decode rows run by TPOT credits, the queue is least-deadline-first, and requests whose
SLO cannot be met are refused with a retryable SLOUnattainable before they start."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import pytest

from services.common.waiting import wait_until
from services.worker.config import WorkerConfig
from services.worker.engine.engine import Engine, EngineConfig, PacingProfile, TokenEvent
from services.worker.engine.sampling import SamplingParams
from services.worker.engine.slo import RequestSLO, SLOUnattainable
from services.worker.model.llama import LlamaForCausalLM
from tests.unit import test_engine
from tests.unit.test_engine import make_engine, prompt_of, reference_greedy

model = test_engine.model  # the same tiny synthetic model, as a fixture of this module


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


async def collect(
    engine: Engine,
    request_id: str,
    prompt: Sequence[int],
    params: SamplingParams,
    slo: RequestSLO | None = None,
    **kwargs: object,
) -> list[TokenEvent]:
    return [ev async for ev in engine.generate(request_id, prompt, params, slo=slo, **kwargs)]  # type: ignore[arg-type]


async def drain(stream: AsyncIterator[TokenEvent]) -> list[TokenEvent]:
    return [ev async for ev in stream]


def tokens(events: list[TokenEvent]) -> list[int | None]:
    return [e.token_id for e in events]


def decode_steps(engine: Engine, request_id: str, prompt_len: int) -> list[int]:
    """Indexes of the steps that decoded a token of `request_id` (after its prompt's chunks)."""
    done, steps = 0, []
    for s in engine.step_log:
        n = dict(s.work).get(request_id, 0)
        if n and done >= prompt_len:
            steps.append(s.index)
        done += n
    return steps


def scorpio_engine(model: LlamaForCausalLM, **overrides: object) -> Engine:
    return make_engine(model, scheduling_policy="scorpio", **overrides)


# ---- batching by credits -----------------------------------------------------------------------


@pytest.mark.parametrize("chunked", [False, True], ids=["whole-prefill", "chunked-prefill"])
async def test_greedy_outputs_equal_fcfs(model: LlamaForCausalLM, chunked: bool) -> None:
    """Credits only delay decode steps: every request gives the tokens it gives under FCFS (and
    the no-cache model), while some decode rows did sit iterations out."""
    requests = {
        "tight": (prompt_of(9, 1), greedy(14), RequestSLO(ttft_s=60, tpot_s=5)),
        "loose": (prompt_of(5, 2), greedy(10), RequestSLO(tpot_s=20)),
        "looser": (prompt_of(13, 3), greedy(8), RequestSLO(ttft_s=120, tpot_s=35)),
        "none": (prompt_of(7, 4), greedy(12), None),
        "ttft-only": (prompt_of(4, 5), greedy(6), RequestSLO(ttft_s=60)),
    }
    overrides = {"enable_chunked_prefill": chunked, "max_num_tokens": 8 if chunked else 64, "block_size": 4}
    outputs: dict[str, dict[str, list[int | None]]] = {}
    for policy in ("fcfs", "scorpio"):
        async with make_engine(model, scheduling_policy=policy, **overrides) as engine:
            results = await asyncio.wait_for(
                asyncio.gather(*(collect(engine, r, p, s, slo) for r, (p, s, slo) in requests.items())), 120
            )
            outputs[policy] = {r: tokens(ev) for r, ev in zip(requests, results, strict=True)}
            assert engine.kv_cache.used_blocks == 0 and engine.stats().slo_rejected_total == 0
            if policy == "scorpio":
                loose_steps = decode_steps(engine, "loose", 5)
                tight_steps = decode_steps(engine, "tight", 9)
                assert len(loose_steps) == 9 and len(tight_steps) == 13
                # The loose request decoded in fewer iterations than it was decoding for.
                assert loose_steps[-1] - loose_steps[0] + 1 > len(loose_steps)
    assert outputs["scorpio"] == outputs["fcfs"]
    for r, (prompt, params, _) in requests.items():
        assert outputs["fcfs"][r] == reference_greedy(model, prompt, params.max_tokens), r


async def test_tight_request_runs_every_iteration_the_loose_one_every_fourth(model: LlamaForCausalLM) -> None:
    """TPOT SLOs 1 s and 4 s: TRP 1 and 1/4. Both are prefilled in step 1; from step 2 the tight
    one decodes every step, the loose one at every 4th (its credit reaches 1 at its 4th)."""
    async with scorpio_engine(model) as engine:
        tight, loose = await asyncio.wait_for(
            asyncio.gather(
                collect(engine, "tight", prompt_of(6, 1), greedy(24), RequestSLO(tpot_s=1.0)),
                collect(engine, "loose", prompt_of(6, 2), greedy(6), RequestSLO(tpot_s=4.0)),
            ),
            60,
        )
    steps = list(engine.step_log)
    assert steps[0].work == (("tight", 6), ("loose", 6))
    assert decode_steps(engine, "tight", 6) == list(range(2, 25))
    assert decode_steps(engine, "loose", 6) == [5, 9, 13, 17, 21]
    assert len(tight) == 24 and len(loose) == 6 and loose[-1].finish_reason == "length"


async def test_requests_without_slo_run_as_under_fcfs(model: LlamaForCausalLM) -> None:
    """No SLOs: the same steps as FCFS, step for step."""
    logs = {}
    for policy in ("fcfs", "scorpio"):
        async with make_engine(model, scheduling_policy=policy, max_batch_size=2, max_num_tokens=12) as engine:
            await asyncio.wait_for(
                asyncio.gather(*(collect(engine, f"r{i}", prompt_of(5, i), greedy(3 + i)) for i in range(4))), 60
            )
            logs[policy] = [(s.admitted, s.work) for s in engine.step_log]
            report = engine.scorpio_report()
            if policy == "fcfs":
                assert report is None and engine.stats().est_tpot_s is None
            else:
                assert report is not None and report["tpot_model"]["points"] == len(engine.step_log)
                assert report["output_length"]["scored"] == 4 and report["rejected"] == {"ttft": 0, "tpot": 0}
    assert logs["scorpio"] == logs["fcfs"]


# ---- least deadline first ----------------------------------------------------------------------


async def test_queue_is_least_deadline_first(model: LlamaForCausalLM) -> None:
    async with scorpio_engine(model, max_batch_size=1) as engine:
        first = asyncio.create_task(collect(engine, "running", prompt_of(5, 0), greedy(30)))
        await wait_until(lambda: engine.stats().total_generated_tokens > 0, 30, interval_s=0.001, what="a token")
        queued = {
            "no-slo": None,
            "late": RequestSLO(ttft_s=300),
            "tpot-only": RequestSLO(tpot_s=100),
            "soon": RequestSLO(ttft_s=100),
        }
        tasks = [
            asyncio.create_task(collect(engine, r, prompt_of(4, i), greedy(2), slo))
            for i, (r, slo) in enumerate(queued.items())
        ]
        await asyncio.wait_for(asyncio.gather(first, *tasks), 60)
    admitted = [r for s in engine.step_log for r in s.admitted]
    # By deadline; those without one after, in arrival order.
    assert admitted == ["running", "soon", "late", "no-slo", "tpot-only"]


# ---- refusals ----------------------------------------------------------------------------------


async def test_impossible_ttft_is_refused_at_arrival(model: LlamaForCausalLM) -> None:
    """1 ms to the first token behind a queue, with emulated steps of 20 ms and more: refused at
    once with a retry-after; the queue is served."""
    pacing = PacingProfile(base_s=0.02, per_token_s=0.002)
    async with scorpio_engine(model, pacing=pacing, max_batch_size=2) as engine:
        await asyncio.wait_for(collect(engine, "warm-up", prompt_of(8, 9), greedy(2)), 30)  # measures the prefill rate
        assert (engine.scorpio_report() or {})["prefill_tokens_per_s"] is not None
        queue = [asyncio.create_task(collect(engine, f"q{i}", prompt_of(30, i), greedy(4))) for i in range(4)]
        await wait_until(lambda: engine.stats().running == 2, 30, interval_s=0.001, what="two running")
        with pytest.raises(SLOUnattainable, match=r"'hasty' refused: TTFT SLO 0.001 s; estimated TTFT") as info:
            await asyncio.wait_for(collect(engine, "hasty", prompt_of(10, 7), greedy(4), RequestSLO(ttft_s=0.001)), 30)
        assert info.value.slo == "ttft" and info.value.retry_after_s > 0
        assert engine.stats().slo_rejected_total == 1
        # A reachable deadline behind the same queue is served.
        calm = await asyncio.wait_for(collect(engine, "calm", prompt_of(10, 7), greedy(4), RequestSLO(ttft_s=30)), 30)
        results = await asyncio.wait_for(asyncio.gather(*queue), 30)
    assert len(calm) == 4 and all(len(r) == 4 for r in results)


async def test_a_lost_deadline_is_refused_while_queued(model: LlamaForCausalLM) -> None:
    """Before any prefill was measured a deadline cannot be judged at arrival; queued behind a
    long request (batch size 1), the request is refused once its deadline has passed."""
    pacing = PacingProfile(base_s=0.01, per_token_s=0.0)
    async with scorpio_engine(model, pacing=pacing, max_batch_size=1) as engine:
        long = engine.generate("long", prompt_of(5, 0), greedy(40))
        await asyncio.wait_for(long.__anext__(), 30)
        with pytest.raises(SLOUnattainable, match="'late' refused: TTFT SLO 0.05 s cannot be met any more") as info:
            await asyncio.wait_for(collect(engine, "late", prompt_of(6, 1), greedy(4), RequestSLO(ttft_s=0.05)), 30)
        assert info.value.slo == "ttft" and engine.stats().slo_rejected_total == 1
        assert engine.stats().waiting == 0
        rest = await asyncio.wait_for(drain(long), 30)
    assert len(rest) == 39 and rest[-1].finish_reason == "length"


async def test_tpot_admission_refuses_when_the_estimate_exceeds_the_slo(model: LlamaForCausalLM) -> None:
    """Emulated steps of 10 ms + 20 ms per token: alone a request decodes in 30 ms, next to three
    running ones in 90 ms. A 60 ms TPOT SLO passes alone but is refused when it would start in a
    batch of four; 1 ms is refused at once, even alone."""
    pacing = PacingProfile(base_s=0.01, per_token_s=0.02)
    async with scorpio_engine(model, pacing=pacing, max_batch_size=4) as engine:
        # Measurements: steps of 1 to 3 decodes and of prompts.
        await asyncio.wait_for(
            asyncio.gather(*(collect(engine, f"w{i}", prompt_of(2 + i, i), greedy(3 + 3 * i)) for i in range(3))), 60
        )
        fit = (engine.scorpio_report() or {})["tpot_model"]
        assert fit["points"] >= 8 and fit["r2"] > 0.9, fit
        with pytest.raises(SLOUnattainable, match=r"'hopeless' refused: TPOT SLO 0.001 s; .* even alone") as alone:
            await asyncio.wait_for(
                collect(engine, "hopeless", prompt_of(3, 5), greedy(4), RequestSLO(tpot_s=0.001)), 30
            )
        assert alone.value.slo == "tpot"

        background = [engine.generate(f"bg{i}", prompt_of(2, 10 + i), greedy(60)) for i in range(3)]
        for stream in background:
            await asyncio.wait_for(stream.__anext__(), 30)
        estimate = engine.stats().est_tpot_s
        assert estimate is not None and 0.06 < estimate < 0.09, estimate  # VBS 3: ~70 ms
        with pytest.raises(SLOUnattainable, match=r"'joiner' refused: TPOT SLO 0.06 s; the estimated TPOT") as info:
            await asyncio.wait_for(collect(engine, "joiner", prompt_of(3, 6), greedy(4), RequestSLO(tpot_s=0.06)), 30)
        assert info.value.slo == "tpot" and info.value.retry_after_s > 0
        assert "with the 3 running" in str(info.value)
        assert engine.stats().slo_rejected_total == 2
        for stream in background:
            await stream.aclose()
        # Alone it fits.
        ok = await asyncio.wait_for(collect(engine, "joiner", prompt_of(3, 6), greedy(4), RequestSLO(tpot_s=0.06)), 30)
        assert len(ok) == 4
        assert engine.kv_cache.used_blocks == 0


async def test_fcfs_ignores_slos(model: LlamaForCausalLM) -> None:
    pacing = PacingProfile(base_s=0.01, per_token_s=0.0)
    async with make_engine(model, pacing=pacing) as engine:
        await asyncio.wait_for(collect(engine, "warm-up", prompt_of(8, 9), greedy(2)), 30)
        events = await asyncio.wait_for(
            collect(engine, "r", prompt_of(6, 1), greedy(3), RequestSLO(ttft_s=1e-6, tpot_s=1e-6)), 30
        )
        assert len(events) == 3 and engine.stats().slo_rejected_total == 0


async def test_resumed_requests_are_never_refused(model: LlamaForCausalLM) -> None:
    """A resumed (migrated) request has sent tokens already: it runs whatever its SLO."""
    pacing = PacingProfile(base_s=0.01, per_token_s=0.0)
    prompt = prompt_of(6, 3)
    whole = reference_greedy(model, prompt, 6)
    async with scorpio_engine(model, pacing=pacing) as engine:
        await asyncio.wait_for(collect(engine, "warm-up", prompt_of(8, 9), greedy(2)), 30)
        events = await asyncio.wait_for(
            collect(engine, "r", prompt, greedy(6), RequestSLO(ttft_s=1e-6, tpot_s=1e-6), resume_token_ids=whole[:2]),
            30,
        )
    assert tokens(events) == whole[2:] and engine.stats().slo_rejected_total == 0


async def test_no_request_is_lost(model: LlamaForCausalLM) -> None:
    """A mix of feasible and infeasible SLOs: every stream ends, in its tokens or in a refusal,
    and the engine is empty afterwards."""
    pacing = PacingProfile(base_s=0.005, per_token_s=0.001)
    slos = [
        None,
        RequestSLO(ttft_s=0.0005),
        RequestSLO(tpot_s=0.0005),
        RequestSLO(ttft_s=60, tpot_s=10),
        RequestSLO(ttft_s=0.02, tpot_s=0.02),
        RequestSLO(tpot_s=30),
    ]
    async with scorpio_engine(model, pacing=pacing, max_batch_size=3) as engine:
        await asyncio.wait_for(collect(engine, "warm-up", prompt_of(8, 9), greedy(3)), 30)
        tasks = [
            asyncio.create_task(
                collect(engine, f"r{i}", prompt_of(4 + i % 7, i), greedy(3 + i % 5), slos[i % len(slos)])
            )
            for i in range(18)
        ]
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 120)
        stats = engine.stats()
        assert (stats.running, stats.waiting, stats.kv_blocks_used, stats.kv_blocks_reserved) == (0, 0, 0, 0)
    refused = 0
    for i, result in enumerate(results):
        if isinstance(result, SLOUnattainable):
            refused += 1
            assert slos[i % len(slos)] is not None, i
        else:
            assert isinstance(result, list) and len(result) == 3 + i % 5, (i, result)
            assert result[-1].finish_reason == "length"
    assert refused == stats.slo_rejected_total
    assert refused >= 3  # at least every 0.5 ms TTFT or TPOT request of the first round
    assert all(not isinstance(r, SLOUnattainable) for r in results[::6])  # no SLO: never refused


def test_configs_validate_the_policy() -> None:
    assert EngineConfig().scheduling_policy == "fcfs"
    assert EngineConfig(scheduling_policy="scorpio").scheduling_policy == "scorpio"
    with pytest.raises(ValueError, match="'edf'"):
        EngineConfig(scheduling_policy="edf")  # type: ignore[arg-type]
    assert WorkerConfig().scheduling_policy == "fcfs"
    with pytest.raises(ValueError, match="fcfs|scorpio"):
        WorkerConfig(scheduling_policy="edf")
