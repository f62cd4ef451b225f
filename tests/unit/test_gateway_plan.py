"""The gateway's attempt loop, its pure pieces without a gRPC server: the plan of an attempt on a
route (`attempts.plan_attempt`), what a worker message means (`replies.classify`), the choice's
text (`text.TextAssembler`: detokenizing, stop strings, log-prob offsets), the effects each
verdict carries (exclusions, reports, releases), and the one client-facing error of a failure
(`attempts.error_for`). Every input is built by hand, small enough to check the answer by eye."""

from __future__ import annotations

import grpc
import pytest

from blitzmesh.types import SamplingParams
from blitzmesh.v1 import common_pb2, global_manager_pb2, kv_pb2, worker_pb2
from services.gateway import attempts as at
from services.gateway.backend import Choice, worker_request
from services.gateway.errors import ErrorKind, GatewayError
from services.gateway.replies import Bad, HandedOff, Moved, Tokens, classify
from services.gateway.schema import SLO, InferenceRequest, Usage
from services.gateway.text import Piece, TextAssembler
from services.model_format.tokenizer import IncrementalDetokenizer

C = grpc.StatusCode
PREFILL, DECODE, BOTH = (
    common_pb2.INSTANCE_ROLE_PREFILL,
    common_pb2.INSTANCE_ROLE_DECODE,
    common_pb2.INSTANCE_ROLE_UNSPECIFIED,
)
LIMITS = at.AttemptLimits(retries_before_first_token=1, max_migrations=1)


def hop(
    name: str, role: int = BOTH, layers: tuple[int, int] = (0, 0), dataplane: bytes = b""
) -> global_manager_pb2.RouteHop:
    return global_manager_pb2.RouteHop(
        instance_id=name,
        address=f"{name}:1",
        role=role,
        layer_start=layers[0],
        layer_end=layers[1],
        dataplane_address=dataplane,
    )


KV = kv_pb2.KVTransferDescriptor(transfer_id="t-1", request_id="r")


# ---- plan_attempt ---------------------------------------------------------------------------------


def test_a_single_hop_runs_colocated() -> None:
    a = hop("a")
    assert at.plan_attempt([a], generated=0) == at.AttemptPlan(a)


def test_a_prefill_decode_route_runs_the_prompt_on_prefill_then_decodes_from_its_kv() -> None:
    p, d = hop("p", PREFILL), hop("d", DECODE)
    fresh = at.plan_attempt([p, d], generated=0)
    assert (fresh.prefill, fresh.hop, fresh.relay, fresh.kv_source) == (p, d, None, None)
    # Resumed after tokens: the decode instance recomputes prompt + tokens; no prefill step.
    resumed = at.plan_attempt([p, d], generated=3)
    assert (resumed.prefill, resumed.hop) == (None, d)


def test_roles_in_the_other_order_are_not_a_split_route() -> None:
    d, p = hop("d", DECODE), hop("p", PREFILL)
    assert at.plan_attempt([d, p], generated=0) == at.AttemptPlan(d)


def test_live_migrated_kv_goes_only_to_a_resumed_attempt() -> None:
    a = hop("a")
    assert at.plan_attempt([a], generated=4, handoff=KV).kv_source == KV
    assert at.plan_attempt([a], generated=0, handoff=KV).kv_source is None


def test_a_zigzag_route_relays_from_the_loading_instance_to_its_partner() -> None:
    new, partner = hop("new", layers=(0, 8), dataplane=b"dp"), hop("full", layers=(8, 24))
    plan = at.plan_attempt([new, partner], generated=0)
    assert plan.relay == (new, partner) and plan.hop == partner and plan.prefill is None
    # Resumed: no relay, the partner (the route's last hop) streams.
    resumed = at.plan_attempt([new, partner], generated=2)
    assert resumed.relay is None and resumed.hop == partner


def test_a_zigzag_route_in_a_split_deployment_prefills_on_the_partner() -> None:
    new = hop("new", PREFILL, layers=(0, 8), dataplane=b"dp")
    partner = hop("full", PREFILL, layers=(8, 24))
    decode = hop("dec", DECODE)
    plan = at.plan_attempt([new, partner, decode], generated=0)
    assert (plan.relay, plan.prefill, plan.hop) == ((new, partner), partner, decode)
    resumed = at.plan_attempt([new, partner, decode], generated=5)
    assert (resumed.relay, resumed.prefill, resumed.hop) == (None, None, decode)


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (hop("new", layers=(0, 8)), hop("full", layers=(8, 24))),  # no data plane to relay from
        (hop("new", layers=(0, 8), dataplane=b"dp"), hop("full", layers=(9, 24))),  # a gap
        (hop("new", layers=(2, 8), dataplane=b"dp"), hop("full", layers=(8, 24))),  # not from layer 0
    ],
)
def test_layer_ranges_that_do_not_meet_are_no_zigzag_route(
    first: global_manager_pb2.RouteHop, second: global_manager_pb2.RouteHop
) -> None:
    plan = at.plan_attempt([first, second], generated=0)
    assert plan.relay is None and plan.hop == first


# ---- classify -------------------------------------------------------------------------------------


def msg(*ids: int, finish: int | None = None, kv: bool = False, **counts: int) -> worker_pb2.WorkerGenerateResponse:
    m = worker_pb2.WorkerGenerateResponse(token_ids=list(ids), **counts)
    if finish is not None:
        m.finish_reason = finish  # type: ignore[assignment]
    if kv:
        m.kv_handoff.CopyFrom(KV)
    return m


def test_tokens_and_a_finish_are_tokens() -> None:
    assert classify(msg(5, 6), handoff=False, resumed=False) == Tokens((5, 6))
    done = classify(
        msg(7, finish=common_pb2.FINISH_REASON_LENGTH, prompt_tokens=3, completion_tokens=9),
        handoff=False,
        resumed=True,
    )
    assert done == Tokens((7,), True, "length", 3, 9)


def test_cached_tokens_are_read_only_when_the_worker_sent_them() -> None:
    """Unset (a worker that pulled the prompt's KV, or an older one) reads as None, not 0: the
    stream keeps the count of the instance that prefilled the prompt."""
    assert classify(msg(5), handoff=False, resumed=False).cached_tokens is None  # type: ignore[union-attr]
    assert classify(msg(5, cached_tokens=0), handoff=False, resumed=False) == Tokens((5,), cached_tokens=0)
    handed = classify(msg(11, kv=True, cached_tokens=32), handoff=True, resumed=False)
    assert isinstance(handed, HandedOff) and handed.cached_tokens == 32


def test_an_unspecified_finish_reason_still_ends_the_stream() -> None:
    reply = classify(msg(finish=common_pb2.FINISH_REASON_UNSPECIFIED), handoff=False, resumed=False)
    assert isinstance(reply, Tokens) and reply.finished and reply.finish_reason is None


def test_a_prefill_instance_hands_off_its_first_token_with_the_kv() -> None:
    reply = classify(msg(11, kv=True), handoff=True, resumed=False)
    assert isinstance(reply, HandedOff) and reply.ids == (11,) and reply.kv == KV


def test_kv_let_go_without_a_token_after_tokens_is_a_live_migration() -> None:
    reply = classify(msg(kv=True), handoff=False, resumed=True)
    assert isinstance(reply, Moved) and reply.kv == KV and reply.reason == "live_migration"


@pytest.mark.parametrize(
    ("message", "handoff", "resumed"),
    [
        (msg(kv=True), False, False),  # nothing generated yet: nothing to migrate
        (msg(1, kv=True), False, True),  # not asked to hand off
        (msg(kv=True), True, False),  # a hand-off with no token
        (msg(1, kv=True, finish=common_pb2.FINISH_REASON_STOP), True, False),  # and a finish
    ],
)
def test_a_handoff_not_asked_for_or_malformed_is_the_instances_failure(
    message: worker_pb2.WorkerGenerateResponse, handoff: bool, resumed: bool
) -> None:
    reply = classify(message, handoff=handoff, resumed=resumed)
    assert isinstance(reply, Bad) and reply.code is C.INTERNAL and "handed off" in reply.detail


def test_an_abort_and_an_unknown_finish_reason_end_the_attempt() -> None:
    aborted = classify(msg(4, finish=common_pb2.FINISH_REASON_ABORT), handoff=False, resumed=True)
    assert isinstance(aborted, Bad) and aborted.code is C.ABORTED
    unknown = classify(msg(4, finish=99), handoff=False, resumed=True)
    assert isinstance(unknown, Bad) and unknown.code is C.INTERNAL and "99" in unknown.detail


@pytest.mark.parametrize(
    ("reply", "matched", "expected"),
    [
        (Tokens((1,)), False, None),  # goes on
        (Tokens((1,)), True, ("stop", Usage(4, 6))),  # a stop string in the text
        (Tokens((1,), True, "stop", 0, 0), False, ("stop", Usage(4, 6))),  # EOS: the worker sent no counts
        (Tokens((1,), True, "length", 5, 8), False, ("length", Usage(5, 8))),  # the worker's counts
        (Tokens((1,), True, "length", 5, 2), False, ("length", Usage(5, 6))),  # never fewer than streamed
        (Tokens((1,), True, None, 0, 0), False, ("length", Usage(4, 6))),  # unspecified reads as length
        (HandedOff((1,), kv=KV), True, ("stop", Usage(4, 6))),  # a stop in the prefill's first token
    ],
)
def test_how_a_message_ends_the_choice(reply: Tokens, matched: bool, expected: tuple[str, Usage] | None) -> None:
    assert reply.finish(matched, generated=6, prompt_tokens=4) == expected


@pytest.mark.parametrize(
    ("reply", "cached", "expected"),
    [
        (Tokens((1,), True, "length", 5, 8), 3, 3),  # the stream's count
        (Tokens((1,), True, "length", 5, 8), 9, 5),  # never more than the prompt
        (Tokens((1,), True, "length", 0, 0), 9, 4),  # ... the gateway's count when the worker sent none
    ],
)
def test_the_usage_of_a_finish_carries_the_streams_cached_tokens(reply: Tokens, cached: int, expected: int) -> None:
    ending = reply.finish(False, generated=6, prompt_tokens=4, cached_tokens=cached)
    assert ending is not None and ending[1].cached_tokens == expected


# ---- TextAssembler --------------------------------------------------------------------------------

SNOWMAN = "\u2603"  # three UTF-8 bytes, split over tokens 5 and 6 below


class ByteTokens:
    """A byte-level vocabulary by hand: id -> bytes (the interface TextAssembler reads)."""

    byte_level = True
    vocab = {1: b"Hello", 2: b" wor", 3: b"ld", 4: b"!", 5: SNOWMAN.encode()[:2], 6: SNOWMAN.encode()[2:], 7: b" END"}

    def token_bytes(self, token_id: int, skip_special_tokens: bool = True) -> bytes:
        return self.vocab[token_id]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return b"".join(self.vocab[i] for i in ids).decode("utf-8", errors="replace")

    def incremental_detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special_tokens)  # type: ignore[arg-type]


def assembler(stop: tuple[str, ...] = (), **kw: object) -> TextAssembler:
    return TextAssembler(ByteTokens(), stop, **kw)  # type: ignore[arg-type]


def lp_msgs(*ids: int) -> list[common_pb2.TokenLogprob]:
    return [common_pb2.TokenLogprob(token_id=i, logprob=-0.5) for i in ids]


def test_text_goes_out_as_it_is_decoded_with_the_echo_first() -> None:
    text = assembler(echo="Q: ")
    first = text.feed((1,))
    assert first.text == "Q: Hello" and not first.matched
    assert text.feed((2, 3)).text == " world"  # the echo goes out once
    assert text.chars == len("Q: Hello world")


def test_a_split_character_waits_for_its_last_byte() -> None:
    text = assembler()
    assert text.feed((5,)).text == ""
    assert text.feed((6,)).text == SNOWMAN


def test_a_stop_string_is_held_back_across_pieces_and_cuts_the_text() -> None:
    text = assembler(stop=("world",))
    assert text.feed((1, 2)).text == "Hello "  # "wor" may start "world": held back
    cut = text.feed((3, 4))
    assert cut.text == "" and cut.matched  # "world" and all after it never go out
    assert text.feed((4,), final=True) == Piece("", True)  # nothing more, ever


def test_the_held_back_text_goes_out_when_the_worker_finishes() -> None:
    text = assembler(stop=("world",))
    assert text.feed((1, 2)).text == "Hello "
    last = text.feed((4,), final=True)
    assert last.text == "wor!" and not last.matched


def test_a_finishing_piece_releases_a_tail_that_only_might_have_been_a_stop() -> None:
    text = assembler(stop=("world",))
    assert text.feed((1,)).text == "Hello"
    assert text.feed((2,), final=True).text == " wor"


def test_a_split_character_at_the_end_becomes_a_replacement_character() -> None:
    text = assembler()
    assert text.feed((1, 5), final=True).text == "Hello\ufffd"


def test_token_log_probs_get_the_offset_of_their_text_in_the_choice() -> None:
    text = assembler(echo="Q: ", logprobs=True)
    lps, prompt = text.logprobs((1, 2), lp_msgs(1, 2), [])
    assert prompt == () and [e.token for e in lps] == ["Hello", " wor"]
    piece = text.feed((1, 2), lps)
    assert [e.text_offset for e in piece.logprobs] == [3, 8]  # after "Q: ", after "Q: Hello"
    lps, _ = text.logprobs((5, 6), lp_msgs(5, 6), [])
    piece = text.feed((5, 6), lps)
    # The snowman starts where the text stood; its second token adds it, at the same offset.
    assert [e.text_offset for e in piece.logprobs] == [12, 12] and piece.text == SNOWMAN


def test_log_probs_not_asked_for_are_not_read() -> None:
    text = assembler()
    assert text.logprobs((1,), [], []) == ((), ())


def test_malformed_log_probs_raise_and_change_nothing() -> None:
    text = assembler(echo="Q: ", logprobs=True, prompt_ids=(1, 2))
    with pytest.raises(ValueError, match="1 log-prob entries for 2 tokens"):
        text.logprobs((1, 2), lp_msgs(1), lp_msgs(1, 2))
    assert text.first and text.chars == 3  # the echo and the prompt log-probs are still to go


def test_prompt_log_probs_come_with_the_first_piece_only() -> None:
    text = assembler(prompt_ids=(1, 2, 3))
    _, prompt = text.logprobs((4,), [], lp_msgs(1, 2, 3))
    assert [e.text_offset for e in prompt] == [0, 5, 9]  # "Hello", " wor", "ld"
    assert text.feed((4,), (), prompt).prompt_logprobs == prompt
    assert text.logprobs((4,), [], lp_msgs(1, 2, 3)) == ((), ())


def test_a_piece_is_sent_when_it_has_text_or_what_the_client_asked_for() -> None:
    empty = assembler().feed((5,))  # half a character: no text yet
    assert not empty.worth_sending((5,), return_token_ids=False)
    assert empty.worth_sending((5,), return_token_ids=True)
    assert not empty.worth_sending((), return_token_ids=True)


# ---- verdicts and their effects -------------------------------------------------------------------


def failed(code: C = C.UNAVAILABLE, generated: int = 0, *, iid: str = "w0", **kw: object) -> at.WorkerFailed:
    return at.WorkerFailed(iid, code, generated, detail="boom", **kw)  # type: ignore[arg-type]


def test_a_failed_instance_is_excluded_with_its_incarnation_and_reported() -> None:
    verdict = at.decide(at.AttemptState(), failed(incarnation=3), LIMITS)
    assert isinstance(verdict, at.Wait) and verdict.exclude and verdict.report
    assert verdict.state.excluded == (("w0", 3),)
    assert verdict.state.failures == ("w0: UNAVAILABLE: boom",)
    again = at.decide(verdict.state, failed(C.INTERNAL, 2, iid="w1"), LIMITS)
    assert isinstance(again, at.Migrate) and again.report
    assert again.state.excluded == (("w0", 3), ("w1", 0))
    assert again.state.failures[-1] == "w1: INTERNAL: boom"


def test_an_slo_refusal_is_excluded_and_kept_but_not_reported() -> None:
    refusal = failed(C.RESOURCE_EXHAUSTED, slo_kind="ttft", retry_after_s=2.0)
    verdict = at.decide(at.AttemptState(), refusal, LIMITS)
    assert isinstance(verdict, at.Retry) and verdict.exclude and not verdict.report
    assert verdict.state.refusals == (refusal,) and verdict.state.excluded == (("w0", 0),)
    last = at.decide(verdict.state, failed(C.RESOURCE_EXHAUSTED, slo_kind="tpot", iid="w1"), LIMITS)
    assert isinstance(last, at.Fail) and last.why == "slo" and last.exclude and not last.report
    assert [r.instance_id for r in last.state.refusals] == ["w0", "w1"]


def test_a_released_request_stays_off_that_instance_for_the_next_route_only() -> None:
    verdict = at.decide(at.AttemptState(), failed(C.ABORTED, moved="rebalance"), LIMITS)
    assert isinstance(verdict, at.Move) and not verdict.exclude and not verdict.report
    assert verdict.state.released == ("w0",) and verdict.state.excluded == () and verdict.state.failures == ()
    assert verdict.state.routed().released == ()


@pytest.mark.parametrize(
    ("outcome", "why", "exclude", "report"),
    [
        (failed(C.DEADLINE_EXCEEDED), "timeout", False, False),
        (failed(C.INVALID_ARGUMENT), "invalid", False, False),
        (failed(C.PERMISSION_DENIED, 3), "not_retryable", False, False),
    ],
)
def test_a_final_failure_changes_no_list(outcome: at.WorkerFailed, why: str, exclude: bool, report: bool) -> None:
    verdict = at.decide(at.AttemptState(), outcome, LIMITS)
    assert isinstance(verdict, at.Fail) and verdict.why == why
    assert (verdict.exclude, verdict.report) == (exclude, report)
    assert verdict.state.excluded == () and verdict.state.failures == ()


def test_running_out_of_retries_or_migrations_excludes_and_reports_the_last_instance() -> None:
    state = at.decide(at.AttemptState(), failed(), LIMITS).state
    out = at.decide(state, failed(iid="w1"), LIMITS)
    assert isinstance(out, at.Fail) and out.why == "retries_exhausted" and out.report
    assert [iid for iid, _ in out.state.excluded] == ["w0", "w1"]


# ---- error_for ------------------------------------------------------------------------------------

REQ = InferenceRequest(model="m", request_id="r-7", prompt="hi", slo=SLO(ttft_s=0.25))


def error(outcome: at.Outcome, state: at.AttemptState | None = None) -> GatewayError:
    verdict = at.decide(state or at.AttemptState(), outcome, LIMITS)
    assert isinstance(verdict, at.Fail)
    return at.error_for(verdict, outcome, REQ, LIMITS, request_timeout_s=30.0)


def test_a_timeout_names_the_deadline_and_the_tokens() -> None:
    e = error(failed(C.DEADLINE_EXCEEDED, 1))
    assert e.kind is ErrorKind.TIMEOUT
    assert "request_timeout_s=30.0" in e.message and "w0" in e.message and "after 1 token" in e.message


def test_a_rejected_request_is_the_clients_error() -> None:
    e = error(failed(C.INVALID_ARGUMENT))
    assert e.kind is ErrorKind.INVALID and "boom" in e.message


def test_a_final_failure_is_internal_before_tokens_and_mid_stream_after() -> None:
    before, after = error(failed(C.PERMISSION_DENIED)), error(failed(C.PERMISSION_DENIED, 2))
    assert before.kind is ErrorKind.INTERNAL and before.code is None
    assert after.kind is ErrorKind.MID_STREAM and after.code == "instance_failed" and "after 2 tokens" in after.message


def test_too_many_migrations_is_mid_stream_naming_the_limit() -> None:
    once = at.decide(at.AttemptState(), failed(generated=2), LIMITS).state
    e = error(failed(C.INTERNAL, 5, iid="w1"), once)
    assert e.kind is ErrorKind.MID_STREAM and "max_migrations=1" in e.message and "migrated 1 times" in e.message


@pytest.mark.parametrize(
    ("last", "kind"), [(C.RESOURCE_EXHAUSTED, ErrorKind.OVERLOADED), (C.UNAVAILABLE, ErrorKind.UNAVAILABLE)]
)
def test_every_instance_failing_before_the_first_token(last: C, kind: ErrorKind) -> None:
    state = at.decide(at.AttemptState(), failed(C.UNAVAILABLE), LIMITS).state
    e = error(failed(last, iid="w1"), state)
    assert e.kind is kind and e.code == "instances_failed"
    assert "failed on 2 instances" in e.message and "w0: UNAVAILABLE" in e.message and "w1" in e.message


def test_instances_running_out_after_an_slo_refusal_answer_429() -> None:
    state = at.decide(at.AttemptState(), failed(C.RESOURCE_EXHAUSTED, slo_kind="ttft", retry_after_s=3.0), LIMITS).state
    e = error(failed(C.UNAVAILABLE, iid="w1"), state)
    assert e.kind is ErrorKind.SLO_UNATTAINABLE and e.retry_after_s == 3.0 and "ttft_slo_s=0.25" in e.message


def test_no_route_before_the_first_token_is_schedules_own_error() -> None:
    cause = GatewayError(ErrorKind.NOT_FOUND, "no such model")
    assert error(at.ScheduleFailed(0, timeout=False, error=cause)) is cause
    late = GatewayError(ErrorKind.TIMEOUT, "deadline")
    assert error(at.ScheduleFailed(4, timeout=True, error=late)) is late


def test_no_route_after_tokens_is_a_stream_that_could_not_migrate() -> None:
    state = at.decide(at.AttemptState(), failed(generated=3), LIMITS).state
    e = error(at.ScheduleFailed(3, timeout=False, error=GatewayError(ErrorKind.UNAVAILABLE, "none left")), state)
    assert e.kind is ErrorKind.MID_STREAM and e.code == "instance_failed"
    assert "after 3 tokens" in e.message and "w0: UNAVAILABLE: boom" in e.message and "none left" in e.message


def test_no_route_after_an_slo_refusal_is_the_refusal() -> None:
    state = at.decide(at.AttemptState(), failed(C.RESOURCE_EXHAUSTED, slo_kind="ttft"), LIMITS).state
    e = error(at.ScheduleFailed(0, timeout=False, error=GatewayError(ErrorKind.UNAVAILABLE, "none")), state)
    assert e.kind is ErrorKind.SLO_UNATTAINABLE and e.retry_after_s == 1.0


# ---- the request of one attempt, and a choice of n --------------------------------------------------


def test_a_resumed_attempt_sends_its_tokens_and_asks_no_prompt_log_probs() -> None:
    req = InferenceRequest(
        model="m", request_id="r", prompt="hi", sampling=SamplingParams(stop=("x",), prompt_logprobs=2)
    )
    fresh = worker_request(req, hop("a"), [1, 2], 16, [])
    assert fresh.sampling.max_tokens == 16 and not fresh.sampling.stop and fresh.sampling.HasField("prompt_logprobs")
    assert fresh.WhichOneof("mode") == "colocated"
    resumed = worker_request(req, hop("a"), [1, 2], 16, [7, 8])
    assert list(resumed.resume_token_ids) == [7, 8] and not resumed.sampling.HasField("prompt_logprobs")


def test_a_relayed_attempt_starts_at_the_partners_first_layer() -> None:
    req = InferenceRequest(model="m", request_id="r", prompt="hi")
    source = worker_pb2.ZigzagSource(instance_id="new", dataplane_address=b"dp")
    partner = hop("full", layers=(8, 24))
    assert worker_request(req, partner, [1], 4, [], zigzag_source=source).layer_start == 8
    assert worker_request(req, partner, [1], 4, []).layer_start == 0


def test_choice_i_of_n_is_a_child_request_with_its_own_id_and_seed() -> None:
    req = InferenceRequest(model="m", request_id="r", prompt="hi", n=3, sampling=SamplingParams(seed=10))
    job = Choice(req, None, [1], 4, 0.0, None)  # type: ignore[arg-type]
    child = job.child(2)
    assert (child.req.request_id, child.req.n, child.req.sampling.seed, child.index) == ("r-2", 1, 12, 2)
    assert job.req.request_id == "r" and job.index == 0  # the parent is unchanged
