"""The engine's queue policy: which queued request starts first, which decode rows run, which
requests are refused for their SLOs. The budget accounting (`scheduler.schedule`) is the same for
every policy; a policy is called at fixed points of a step (SGLang's `schedule_policy.py` keeps
queue order apart from budget accounting in the same way):

- `arrive` when a request is added (it may refuse it at once);
- `order` when a step is planned: the queue in admission order, and the requests to refuse;
- `held` next: the decode rows that sit the step out;
- `gate` on what the scheduler would admit: the requests to refuse instead;
- `observe` when the step's results are booked, before its rows advance;
- `finished` when a request ends with a token.

Refusals come back as data; the engine takes the refused requests out of its queue. FCFS admits
in arrival order and runs every decode every step; SCORPIO (docs/algorithms.md 4) is below.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import structlog

from services.worker.engine.request import EngineRequest, RequestMode, RequestStatus
from services.worker.engine.scorpio import (
    Member,
    ScorpioState,
    SLOTicket,
    TPOTDecision,
    deadline_s,
    judge_tpot,
    judge_ttft,
    trp,
    vbs,
)
from services.worker.engine.slo import SLOKind, SLOUnattainable
from services.worker.engine.step import StepPlan

log = structlog.get_logger(__name__)

# SCORPIO logs its fits (scorpio_fit) once per this many steps.
_SCORPIO_LOG_EVERY_STEPS = 1000

Refusal = tuple[EngineRequest, SLOUnattainable]


class QueuePolicy(Protocol):
    """See the module docstring for when each method is called."""

    def arrive(
        self, seq: EngineRequest, plain: bool, waiting: Iterable[EngineRequest], running: Sequence[EngineRequest]
    ) -> None:
        """A request is added; raise SLOUnattainable to refuse it. `plain`: it has sent no token
        and needs nothing from a peer."""

    def order(
        self, waiting: Sequence[EngineRequest], running: Sequence[EngineRequest], now_s: float
    ) -> tuple[list[EngineRequest], list[Refusal]]:
        """The queued requests in the order to admit them, and those to refuse now."""
        ...

    def held(self, running: Sequence[EngineRequest]) -> frozenset[str]:
        """Running requests whose decode row sits this step out."""
        ...

    def gate(self, admitted: Sequence[EngineRequest], running: Sequence[EngineRequest]) -> list[Refusal]:
        """Of the requests the scheduler would admit now (in its order), those to refuse."""
        ...

    def observe(self, plan: StepPlan, step_s: float, queue_s: float, step_index: int) -> None:
        """A step ran: `step_s` from the model's start to its results, `queue_s` since the step began."""

    def finished(self, seq: EngineRequest) -> None:
        """`seq` ended with a token (stop or length)."""

    def offload_order(self, waiting: Iterable[EngineRequest]) -> list[EngineRequest]:
        """The queue in admission order, without refusing anything (read between and during steps)."""
        ...

    def est_tpot_s(self, running: Sequence[EngineRequest]) -> float | None: ...

    @property
    def rejected_total(self) -> int: ...

    def report(self, running: Sequence[EngineRequest]) -> dict[str, Any] | None: ...


class FcfsPolicy:
    """Arrival order; every decode runs every step; nothing is refused."""

    def arrive(
        self, seq: EngineRequest, plain: bool, waiting: Iterable[EngineRequest], running: Sequence[EngineRequest]
    ) -> None:
        return None

    def order(
        self, waiting: Sequence[EngineRequest], running: Sequence[EngineRequest], now_s: float
    ) -> tuple[list[EngineRequest], list[Refusal]]:
        return list(waiting), []

    def held(self, running: Sequence[EngineRequest]) -> frozenset[str]:
        return frozenset()

    def gate(self, admitted: Sequence[EngineRequest], running: Sequence[EngineRequest]) -> list[Refusal]:
        return []

    def observe(self, plan: StepPlan, step_s: float, queue_s: float, step_index: int) -> None:
        return None

    def finished(self, seq: EngineRequest) -> None:
        return None

    def offload_order(self, waiting: Iterable[EngineRequest]) -> list[EngineRequest]:
        return list(waiting)

    def est_tpot_s(self, running: Sequence[EngineRequest]) -> float | None:
        return None

    @property
    def rejected_total(self) -> int:
        return 0

    def report(self, running: Sequence[EngineRequest]) -> dict[str, Any] | None:
        return None


class ScorpioPolicy:
    """SCORPIO (scheduling_policy="scorpio", docs/algorithms.md 4). The pure part (credits, fits, the
    checks) is `services/worker/engine/scorpio.py`.

    Refusals: at arrival when the TPOT SLO is out of reach even alone, or the first token cannot
    come by the deadline behind the prefill work queued ahead; while queued once the deadline is
    lost (its own prefill would end past it); at admission when the running set with it would
    miss the set's tightest TPOT SLO. Only plain requests that have sent no token are refused.
    Credits are taken over the decode rows of each iteration (TRP against the tightest of them,
    so one always runs); prefills are not subject to them. A request without SLOs is never
    refused, is queued after those with a deadline and decodes every iteration (TRP 1). The mean
    length L an admission estimates with is each request's prompt plus the output it is expected
    to reach (predicted, or what it has if more): the set's length near its end."""

    def __init__(self) -> None:
        self.state = ScorpioState()

    @staticmethod
    def _member(seq: EngineRequest) -> Member:
        """`seq` in an admission's set: its TPOT SLO and the length it is expected to reach."""
        t = seq.scorpio
        if t is None:
            return Member(None, seq.num_tokens)
        return Member(t.tpot_s, len(seq.prompt) + max(len(seq.output), t.predicted_output_tokens))

    def est_tpot_s(self, running: Sequence[EngineRequest]) -> float | None:
        """The fitted step time of the running set: the TPOT of its tightest request."""
        fit = self.state.tpot.fit()
        if fit is None or not running:
            return None
        members = [self._member(s) for s in running]
        return fit.estimate(vbs(m.tpot_s for m in members), sum(m.length_tokens for m in members) / len(members))

    @property
    def rejected_total(self) -> int:
        return self.state.rejected_total

    def report(self, running: Sequence[EngineRequest]) -> dict[str, Any] | None:
        return {**self.state.report(), "est_tpot_s": self.est_tpot_s(running)}

    def _refusal(self, seq: EngineRequest, kind: SLOKind, message: str, retry_after_s: float) -> SLOUnattainable:
        self.state.rejected[kind] += 1
        log.info("slo_rejected", request_id=seq.request_id, slo=kind, retry_after_s=retry_after_s, reason=message)
        return SLOUnattainable(message, slo=kind, retry_after_s=retry_after_s)

    def _tpot_retry_s(self, running: Sequence[EngineRequest], step_s: float) -> float:
        """When the running set is expected to lose a member: the soonest expected finish, each
        request's remaining predicted tokens at one per 1/TRP iterations of `step_s`."""
        members = {s.request_id: self._member(s) for s in running}
        if not members or step_s <= 0:
            return step_s
        rates = trp({r: m.tpot_s for r, m in members.items()})
        return min(
            max(1.0, members[s.request_id].length_tokens - s.num_tokens) / rates[s.request_id] * step_s for s in running
        )

    @staticmethod
    def _tpot_message(seq: EngineRequest, decision: TPOTDecision, others: int) -> str:
        assert seq.scorpio is not None and decision.est_tpot_s is not None and decision.min_tpot_s is not None
        where = "even alone" if others == 0 else f"with the {others} running"
        return (
            f"request {seq.request_id!r} refused: TPOT SLO {seq.scorpio.tpot_s:.4g} s; the estimated TPOT"
            f" {decision.est_tpot_s:.4g} s {where} (VBS {decision.vbs:.3g}, mean length {decision.mean_len:.0f}"
            f" tokens) exceeds the set's tightest TPOT SLO {decision.min_tpot_s:.4g} s"
        )

    def arrive(
        self, seq: EngineRequest, plain: bool, waiting: Iterable[EngineRequest], running: Sequence[EngineRequest]
    ) -> None:
        """Give `seq` its ticket; raise SLOUnattainable for a plain request whose SLO is out of
        reach at once (see the class docstring)."""
        sc = self.state
        slo = seq.slo
        seq.scorpio = ticket = SLOTicket(
            deadline_s=deadline_s(seq.arrival_s, slo.ttft_s if slo is not None and plain else None),
            # Hand-offs and ZigZag requests on a loading instance never decode here.
            tpot_s=slo.tpot_s
            if slo is not None and not (seq.mode.hands_off or seq.mode is RequestMode.ZIGZAG_FIRST_LAYERS)
            else None,
            predicted_output_tokens=sc.lengths.predict(len(seq.prompt), seq.params.max_tokens),
            refusable=plain and slo is not None,
        )
        if not ticket.refusable:
            return
        if ticket.tpot_s is not None:
            alone = judge_tpot(self._member(seq), [], sc.tpot.fit())
            if not alone.admit:
                assert alone.est_tpot_s is not None
                raise self._refusal(seq, "tpot", self._tpot_message(seq, alone, 0), alone.est_tpot_s)
        if math.isfinite(ticket.deadline_s):
            ahead = sum(
                s.prefill_len for s in waiting if s.scorpio is not None and s.scorpio.deadline_s <= ticket.deadline_s
            ) + sum(max(0, s.prefill_len - s.num_computed) for s in running)
            rate = sc.queue_tokens_per_s
            guard = judge_ttft(
                seq.arrival_s, ticket.deadline_s, ahead, seq.prefill_len, rate, self.est_tpot_s(running) or 0.0
            )
            if not guard.admit:
                assert slo is not None and slo.ttft_s is not None
                est = "unknown" if guard.est_ttft_s is None else f"{guard.est_ttft_s:.4g} s"
                raise self._refusal(
                    seq,
                    "ttft",
                    f"request {seq.request_id!r} refused: TTFT SLO {slo.ttft_s:.4g} s; estimated TTFT {est}"
                    f" ({ahead} prompt tokens queued ahead of its {seq.prefill_len}, at {rate or 0:.4g} tokens/s)",
                    guard.retry_after_s,
                )

    def offload_order(self, waiting: Iterable[EngineRequest]) -> list[EngineRequest]:
        """Least deadline first, as `order` admits them (arrival order among equal deadlines)."""
        return sorted(waiting, key=lambda s: s.scorpio.deadline_s if s.scorpio is not None else math.inf)

    def order(
        self, waiting: Sequence[EngineRequest], running: Sequence[EngineRequest], now_s: float
    ) -> tuple[list[EngineRequest], list[Refusal]]:
        """The queue in least-deadline-first order (arrival order among equal deadlines and those
        without one), less the requests whose deadline is lost: the current step, the prefill
        queued ahead of it in this order and its own, at the rate the queue has been served at
        (`ScorpioState.queue_tokens_per_s`), would end past it. Refused as soon as that is so,
        not when the deadline has passed: a request that waits out its budget and then misses it
        held nothing, but one admitted late takes the batch from others."""
        rate = self.state.queue_tokens_per_s
        step_s = self.est_tpot_s(running) or 0.0
        kept: list[EngineRequest] = []
        refused: list[Refusal] = []
        ahead = sum(max(0, s.prefill_len - s.num_computed) for s in running)
        for seq in self.offload_order(waiting):
            t = seq.scorpio
            if t is not None and t.refusable and math.isfinite(t.deadline_s):
                guard = judge_ttft(now_s, t.deadline_s, ahead, seq.prefill_len, rate, step_s)
                if not guard.admit:
                    assert seq.slo is not None and seq.slo.ttft_s is not None
                    message = (
                        f"request {seq.request_id!r} refused: TTFT SLO {seq.slo.ttft_s:.4g} s cannot be met any"
                        f" more: queued {now_s - seq.arrival_s:.4g} s, {ahead} prompt tokens ahead of its"
                        f" {seq.prefill_len} (queue served at {rate or 0:.4g} tokens/s)"
                    )
                    refused.append((seq, self._refusal(seq, "ttft", message, guard.retry_after_s)))
                    continue
            ahead += seq.prefill_len
            kept.append(seq)
        return kept, refused

    def held(self, running: Sequence[EngineRequest]) -> frozenset[str]:
        """This iteration's credits: the decode rows that sit it out. Prefills are not subject
        to credits; a decode row of a request without a TPOT SLO runs every iteration."""
        decoding = {
            s.request_id: s.scorpio.tpot_s if s.scorpio is not None else None
            for s in running
            if s.pending == 1
            and s.num_computed >= s.prefill_len
            and s.status is not RequestStatus.WAITING_FOR_KV
            and s.mode is not RequestMode.ZIGZAG_FIRST_LAYERS
        }
        chosen = self.state.batcher.step(decoding)
        return frozenset(decoding.keys() - set(chosen))

    def gate(self, admitted: Sequence[EngineRequest], running: Sequence[EngineRequest]) -> list[Refusal]:
        """Of the requests the capacity scheduler would start, in its order: one with a TPOT SLO
        starts only if the fitted step time of the running set with it (and those started before
        it in this step) meets the set's tightest TPOT SLO; otherwise it is refused."""
        fit = self.state.tpot.fit()
        if fit is None or not admitted:
            return []  # no measurement yet: admitted blind
        members = [self._member(s) for s in running]
        refused: list[Refusal] = []
        for seq in admitted:
            member = self._member(seq)
            t = seq.scorpio
            if t is not None and t.refusable and t.tpot_s is not None:
                decision = judge_tpot(member, members, fit)
                if not decision.admit:
                    assert decision.est_tpot_s is not None
                    message = self._tpot_message(seq, decision, len(members))
                    retry = self._tpot_retry_s(running, self.est_tpot_s(running) or decision.est_tpot_s)
                    refused.append((seq, self._refusal(seq, "tpot", message, retry)))
                    continue
            members.append(member)
        return refused

    def observe(self, plan: StepPlan, step_s: float, queue_s: float, step_index: int) -> None:
        """Feed the fits from a step (before its rows' `num_computed` advance). The TPOT model:
        B is the step's tokens (a decode row is 1; under pacing a step costs base + per_token *
        tokens, exactly the model's b*B + d), L the mean context length of its rows, the time
        measured; steps with ZigZag layer ranges are left out. The backlog rate: what the queue
        was served at, the step's scheduling and any wait for a KV pull in."""
        sc = self.state
        if not plan.inputs.partials and not plan.inputs.continuations:
            contexts = [r.seq.num_computed + r.num_tokens for r in plan.rows if r.num_tokens > 0]
            if contexts:
                sc.tpot.observe(sum(r.num_tokens for r in plan.rows), sum(contexts) / len(contexts), step_s)
                sc.prefill.observe(plan.prefill_tokens, step_s)
                if step_index % _SCORPIO_LOG_EVERY_STEPS == 0:
                    log.info("scorpio_fit", **sc.report())
        if plan.backlogged:
            sc.backlog.observe(plan.prefill_tokens, queue_s)

    def finished(self, seq: EngineRequest) -> None:
        if seq.scorpio is not None:
            self.state.lengths.observe(len(seq.prompt), len(seq.output), seq.scorpio.predicted_output_tokens)
