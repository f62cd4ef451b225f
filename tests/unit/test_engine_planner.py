"""The engine's step without a model: `Engine.plan` decides a step, the test hands it the model's
outputs, `Engine.apply` books them (as vLLM's tests/v1/core/test_scheduler.py steps its
scheduler with hand-built runner outputs). The model is a stub that fails any use beyond its
config; the engine's loop is never started."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
import torch

from services.model_format.config import LlamaConfig
from services.worker.engine.engine import Engine, EngineConfig, EngineStoppedError, KVBlocks, TokenEvent
from services.worker.engine.kv_cache import KVCache
from services.worker.engine.policy import FcfsPolicy
from services.worker.engine.request import EngineRequest, RequestMode, RequestStatus
from services.worker.engine.sampling import SampleOutput, SamplingParams
from services.worker.engine.scheduler import CapacityPolicy
from services.worker.engine.step import StepOutputs, StepPlan

EOS = 2
BLOCK = 4
HIDDEN = 8
CONFIG = LlamaConfig(
    vocab_size=64,
    hidden_size=HIDDEN,
    intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=4,
    max_position_embeddings=256,
)


class NoModel:
    """What the engine reads of a model outside a step; anything else (running it) fails."""

    def __init__(self, layers_loaded: int = CONFIG.num_hidden_layers) -> None:
        self.config = CONFIG
        self.num_layers_loaded = layers_loaded
        self.is_complete = layers_loaded == CONFIG.num_hidden_layers
        # As a ZigZag request's admission checks: the embedding is here (it need not bring it).
        self.loaded_groups = ["embed", *(f"layers.{i}" for i in range(layers_loaded))]
        self.dtype = torch.float32
        self.device = torch.device("cpu")

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the planner used model.{name}")


def make_engine(layers_loaded: int = CONFIG.num_hidden_layers, **overrides: Any) -> Engine:
    fields: dict[str, Any] = {
        "max_batch_size": 4,
        "max_num_tokens": 64,
        "block_size": BLOCK,
        "num_kv_blocks": 64,
        "enable_prefix_caching": False,
        **overrides,
    }
    cfg = EngineConfig(**fields)
    kv = KVCache(
        num_layers=CONFIG.num_hidden_layers,
        num_blocks=cfg.num_kv_blocks or 64,
        block_size=BLOCK,
        num_kv_heads=CONFIG.num_key_value_heads,
        head_dim=CONFIG.head_dim,
    )
    return Engine(NoModel(layers_loaded), kv, (EOS,), cfg)  # type: ignore[arg-type]


def prompt(n: int, first: int = 3) -> list[int]:
    return [first + i % 50 for i in range(n)]


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=kw.pop("ignore_eos", True), **kw)


def add(engine: Engine, request_id: str, n: int, max_tokens: int = 8, **kw: Any) -> EngineRequest:
    params = kw.pop("params", None) or greedy(max_tokens)
    return engine._add(request_id, prompt(n), params, **kw)


def outputs_for(plan: StepPlan, tokens: Mapping[str, int] | None = None, default: int = 7) -> StepOutputs:
    """What a model would return for `plan`: a token per sampling row (`tokens[request_id]`,
    else `default`), a prompt log-prob per target, hidden states per ZigZag partial."""
    inp = plan.inputs
    ids = [plan.rows[r].seq.request_id for r in inp.sample_rows]
    picks = [(tokens or {}).get(i, default) for i in ids]
    sampled = SampleOutput(picks, [-0.5] * len(picks), [()] * len(picks)) if picks else None
    prompt_lps = [[(-1.0, ())] * len(w.targets) for w in inp.prompt_work]
    hidden = [torch.zeros(p.num_tokens, HIDDEN) for p in inp.partials]
    return StepOutputs(sampled, prompt_lps, hidden, started_s=plan.now_s, compute_s=0.01)


def step(engine: Engine, now_s: float, tokens: Mapping[str, int] | None = None) -> StepPlan:
    plan = engine.plan(now_s)
    engine.apply(plan, outputs_for(plan, tokens), now_s + 0.02)
    return plan


def events(seq: EngineRequest) -> list[TokenEvent]:
    out: list[TokenEvent] = []
    while not seq.queue.empty():
        item = seq.queue.get_nowait()
        assert isinstance(item, TokenEvent), item
        out.append(item)
    return out


def test_admission_stops_at_the_batch_size() -> None:
    engine = make_engine(max_batch_size=2, max_num_tokens=16, enable_chunked_prefill=False)
    a, b, c = add(engine, "a", 6), add(engine, "b", 6), add(engine, "c", 3)
    plan = engine.plan(0.0)
    assert plan.admitted == ("a", "b") and plan.work == (("a", 6), ("b", 6))
    assert (a.status, b.status, c.status) == (RequestStatus.RUNNING, RequestStatus.RUNNING, RequestStatus.WAITING)
    inp = plan.inputs
    assert inp.input_ids == a.prompt + b.prompt
    assert (inp.query_lens, inp.context_lens, inp.sample_rows) == ([6, 6], [0, 0], [0, 1])
    # Each admitted request holds the blocks its first step writes to.
    assert [engine.kv_cache.num_blocks_of(r) for r in "abc"] == [2, 2, 0]
    assert plan.prefill_tokens == 12 and list(engine._waiting) == [c]


def test_admission_under_the_token_budget_keeps_arrival_order_and_puts_decodes_first() -> None:
    engine = make_engine(max_num_tokens=10, enable_chunked_prefill=False)
    add(engine, "a", 6)
    add(engine, "b", 6)
    add(engine, "c", 2)
    # b does not fit the 4 tokens left, and c, which would, does not overtake it.
    first = step(engine, 0.0)
    assert first.admitted == ("a",) and first.work == (("a", 6),)
    # a decodes (1 token), then b and c fit the 9 left.
    second = engine.plan(1.0)
    assert second.admitted == ("b", "c") and second.work == (("a", 1), ("b", 6), ("c", 2))
    assert second.inputs.context_lens == [6, 0, 0] and second.inputs.sample_rows == [0, 1, 2]
    assert second.prefill_tokens == 8


def test_admission_waits_for_the_kv_reservation() -> None:
    # GUARANTEED_NO_EVICT: a request reserves prompt + max_tokens (16 tokens, 4 blocks) to start.
    engine = make_engine(num_kv_blocks=6)
    add(engine, "a", 8, max_tokens=8)
    b = add(engine, "b", 8, max_tokens=8)
    plan = step(engine, 0.0)
    assert plan.admitted == ("a",) and b.status is RequestStatus.WAITING
    assert engine.stats().kv_blocks_reserved == 4


def test_chunked_prefill_progresses_across_steps() -> None:
    engine = make_engine(max_num_tokens=8)
    r = add(engine, "r", 20, max_tokens=3)
    plans = [step(engine, float(i), {"r": 10 + i}) for i in range(3)]
    # 8 + 8 + 4 prompt tokens; only the step that completes the prompt samples.
    assert [p.work for p in plans] == [(("r", 8),), (("r", 8),), (("r", 4),)]
    assert [p.inputs.context_lens for p in plans] == [[0], [8], [16]]
    assert [p.inputs.input_ids for p in plans] == [r.prompt[0:8], r.prompt[8:16], r.prompt[16:20]]
    assert [p.inputs.sample_rows for p in plans] == [[], [], [0]]
    assert r.num_computed == 20 and r.output == [12]
    assert [(e.token_id, e.completion_tokens, e.finish_reason) for e in events(r)] == [(12, 1, None)]
    # A request arriving now gets what the decode leaves of the budget: a 7-token chunk.
    q = add(engine, "q", 12)
    plan = step(engine, 3.0)
    assert plan.work == (("r", 1), ("q", 7)) and plan.admitted == ("q",)
    assert plan.inputs.input_ids == [12, *q.prompt[:7]] and plan.inputs.sample_rows == [0]
    assert plan.prefill_tokens == 7 and (r.num_computed, q.num_computed) == (21, 7)


def test_a_finished_request_leaves_the_batch_and_frees_its_blocks() -> None:
    engine = make_engine()
    r = add(engine, "r", 5, max_tokens=2)
    s = add(engine, "s", 5, params=greedy(8, ignore_eos=False))
    step(engine, 0.0, {"r": 7, "s": 9})
    step(engine, 1.0, {"r": 8, "s": EOS})  # r reaches max_tokens, s samples its stop token
    assert [(e.token_id, e.finish_reason) for e in events(r)] == [(7, None), (8, "length")]
    assert [(e.token_id, e.finish_reason) for e in events(s)] == [(9, None), (EOS, "stop")]
    assert (r.status, s.status) == (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED)
    assert engine._running == [] and engine.kv_cache.used_blocks == 0
    assert engine.plan(2.0).is_empty
    stats = engine.stats()
    assert (stats.running, stats.total_generated_tokens, stats.total_prompt_tokens) == (0, 4, 10)


def test_an_abort_between_plan_and_apply_books_nothing_for_it() -> None:
    engine = make_engine()
    a, b = add(engine, "a", 5), add(engine, "b", 5)
    plan = engine.plan(0.0)
    assert plan.work == (("a", 5), ("b", 5))
    engine.abort("a")  # while the model would be running the step
    assert a.status is RequestStatus.FINISHED_ABORTED and engine.kv_cache.num_blocks_of("a") == 0
    engine.apply(plan, outputs_for(plan, {"a": 11, "b": 12}), 0.5)
    assert [(e.token_id, e.finish_reason) for e in events(a)] == [(None, "abort")]
    assert (a.num_computed, a.output) == (0, [])
    assert [e.token_id for e in events(b)] == [12] and b.num_computed == 5
    assert engine.stats().total_generated_tokens == 1 and engine._running == [b]
    assert engine.step_log[-1].work == (("a", 5), ("b", 5))


def run_until(engine: Engine, done: Any, limit: int = 100) -> list[StepPlan]:
    plans: list[StepPlan] = []
    for i in range(limit):
        if done():
            return plans
        plans.append(step(engine, float(i), {}))
    raise AssertionError(f"not done after {limit} steps")


def test_max_utilization_pauses_the_latest_request_and_recomputes_it_after() -> None:
    # 6 blocks of 4 tokens: two requests of 8 + 12 tokens both start (MAX_UTILIZATION reserves
    # only their next step), and both decode until their 13th token needs a 4th block each.
    engine = make_engine(num_kv_blocks=6, capacity_policy=CapacityPolicy.MAX_UTILIZATION)
    a, b = add(engine, "a", 8, max_tokens=12), add(engine, "b", 8, max_tokens=12)
    plans = [step(engine, 0.0)]
    c = add(engine, "c", 4, max_tokens=2)  # queued: the pool has no block to spare from here on
    plans += run_until(engine, lambda: b.status is RequestStatus.PREEMPTED)
    paused_at = plans[-1]
    assert plans[0].admitted == ("a", "b")
    assert all(p.work == (("a", 1), ("b", 1)) and not p.admitted for p in plans[1:-1])
    # The step that paused b runs a alone; b waits at the queue's front, before c, with its 5
    # tokens folded into the prompt it is recomputed from.
    assert paused_at.work == (("a", 1),) and engine.preemptions == {"recompute": 1, "swap": 0}
    assert (b.num_computed, b.resumed, len(b.output)) == (0, 5, 5) and list(engine._waiting) == [b, c]
    assert engine.kv_cache.num_blocks_of("b") == 0 and c.status is RequestStatus.WAITING
    run_until(engine, lambda: b.status is RequestStatus.RUNNING)
    # b comes back once a has finished: prompt and output prefilled again, then the next token.
    assert a.status is RequestStatus.FINISHED_LENGTH
    back = engine.step_log[-1]
    assert back.admitted == ("b", "c") and back.work == (("b", 13), ("c", 4))
    run_until(engine, lambda: b.status.is_finished() and c.status.is_finished())
    for seq, n in ((a, 12), (b, 12), (c, 2)):
        stream = events(seq)
        # Every token sent once, in order.
        assert [e.completion_tokens for e in stream] == list(range(1, n + 1))
        assert stream[-1].finish_reason == "length"
    assert engine.kv_cache.used_blocks == 0


def test_max_utilization_swaps_out_and_back_in() -> None:
    engine = make_engine(num_kv_blocks=6, capacity_policy=CapacityPolicy.MAX_UTILIZATION, preemption_mode="swap")
    a, b = add(engine, "a", 8, max_tokens=12), add(engine, "b", 8, max_tokens=12)
    run_until(engine, lambda: b.status is RequestStatus.SWAPPED)
    assert b.swapped is not None and b.swapped.num_tokens == 12 and engine.preemptions["swap"] == 1
    back = run_until(engine, lambda: b.status is RequestStatus.RUNNING)[-1]
    assert a.status is RequestStatus.FINISHED_LENGTH and b.swapped is None
    # Swapped back in with its KV: it goes on decoding from token 12, nothing recomputed.
    assert back.admitted == () and back.work == (("b", 1),) and back.inputs.context_lens == [12]
    run_until(engine, lambda: b.status.is_finished())
    assert [e.completion_tokens for e in events(b)] == list(range(1, 13))


def test_hand_off_parks_the_kv_after_the_first_token() -> None:
    engine = make_engine()
    h = add(engine, "h", 6, handoff=True)
    assert h.mode is RequestMode.PREFILL_HANDOFF
    step(engine, 0.0, {"h": 9})
    (event,) = events(h)
    assert (event.token_id, event.finish_reason, event.kv_tokens) == (9, None, 6)
    assert event.parked_kv is not None and engine.kv_cache.num_blocks_of(event.parked_kv) == 2
    assert h.status is RequestStatus.FINISHED_HANDED_OFF and engine._running == []


def test_a_request_taking_its_kv_from_a_peer_waits_for_it_outside_the_batch() -> None:
    async def never(blocks: KVBlocks) -> object:
        raise AssertionError("the planner started a pull")

    engine = make_engine(max_num_tokens=8)
    d = add(engine, "d", 6, kv_fill=never, resume_token_ids=[9])
    add(engine, "r", 4)
    assert d.mode is RequestMode.DECODE_FROM_KV
    plan = engine.plan(0.0)
    # Admitted with blocks for its pulled KV (prompt + resumed - 1 tokens), but no row and none
    # of the token budget: the engine starts the pull after planning (`plan.fills`).
    assert plan.admitted == ("d", "r") and plan.work == (("r", 4),) and plan.fills == (d,)
    assert d.status is RequestStatus.WAITING_FOR_KV and engine.kv_cache.num_blocks_of("d") == 2
    engine.apply(plan, outputs_for(plan), 0.1)
    # While its KV arrives it holds its slot and runs nothing.
    assert engine.plan(1.0).work == (("r", 1),)


def test_zigzag_first_layers_run_as_partials_until_the_next_layer_loads() -> None:
    engine = make_engine(layers_loaded=1)
    z = add(engine, "z", 6, zigzag=True)
    assert z.mode is RequestMode.ZIGZAG_FIRST_LAYERS
    plan = engine.plan(0.0)
    assert plan.admitted == ("z",) and plan.rows == () and not plan.is_empty
    (part,) = plan.inputs.partials
    assert (part.seq, part.layer_start, part.layer_end, part.num_tokens) == (z, 0, 1, 6)
    outputs = outputs_for(plan)
    engine.apply(plan, outputs, 0.1)
    assert z.zz_layers == 1 and z.zz_hidden is outputs.hidden[0]
    assert engine.plan(1.0).is_empty  # layer 1 is not loaded yet
    engine.model.num_layers_loaded = 2  # type: ignore[misc]
    assert engine.plan(2.0).inputs.partials[0].layer_start == 1


class RecordingPolicy(FcfsPolicy):
    def __init__(self) -> None:
        self.calls: list[str] = []

    def order(self, *args: Any) -> Any:
        self.calls.append("order")
        return super().order(*args)

    def held(self, *args: Any) -> Any:
        self.calls.append("held")
        return super().held(*args)

    def gate(self, *args: Any) -> Any:
        self.calls.append("gate")
        return super().gate(*args)

    def observe(self, *args: Any) -> None:
        self.calls.append("observe")

    def finished(self, *args: Any) -> None:
        self.calls.append("finished")


def test_plan_and_apply_call_the_policy_at_fixed_points_and_read_no_clock() -> None:
    engine = make_engine()
    policy = RecordingPolicy()
    engine._policy = policy
    add(engine, "r", 4, max_tokens=1)

    def no_clock() -> float:
        raise AssertionError("read the clock")

    engine._clock = no_clock
    plan = engine.plan(5.0)
    assert policy.calls == ["order", "held", "gate"]
    engine.apply(plan, outputs_for(plan), 5.25)
    assert policy.calls == ["order", "held", "gate", "observe", "finished"]
    record = engine.step_log[-1]
    assert record.step_s == pytest.approx(5.25 - plan.now_s) and record.compute_s == pytest.approx(0.01)


def test_a_plan_and_its_outputs_must_match() -> None:
    engine = make_engine()
    add(engine, "a", 4)
    add(engine, "b", 4)
    plan = engine.plan(0.0)
    one_token = StepOutputs(SampleOutput([7], [0.0], [()]))
    with pytest.raises(ValueError):
        engine.apply(plan, one_token, 0.1)


async def test_generate_still_needs_the_loop() -> None:
    # The planner's tests queue through `_add`; `generate` refuses while the loop is not running.
    engine = make_engine()
    with pytest.raises(EngineStoppedError, match="not running"):
        await anext(engine.generate("x", prompt(4), greedy(2)))
    assert not engine._by_id
