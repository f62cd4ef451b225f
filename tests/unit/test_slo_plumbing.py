"""Per-request latency SLOs, the pure parts: the gateway's edge validation (400 quoting the value)
and defaults, the attainment it reports and counts, the SLO refusal's 429 shape, the wire
conversions (gateway, worker, SDK), the SDK's argument checks and error mapping, and the global
manager's routing preference for instances whose TPOT estimate meets the objective."""

from __future__ import annotations

import math
import pickle
from typing import Any

import grpc
import grpc.aio
import pydantic
import pytest
from prometheus_client import CollectorRegistry

import blitzmesh
from blitzmesh import AsyncClient, convert
from blitzmesh import errors as sdk_errors
from blitzmesh.types import LoadReport, SLOAttainment, Usage
from blitzmesh.v1 import common_pb2, inference_pb2
from services.common.grpc_util import RETRY_AFTER_METADATA_KEY, SLO_METADATA_KEY
from services.gateway.backend import _slo_error, _WorkerFailedError, resolve_slo, worker_slo
from services.gateway.config import GatewayConfig
from services.gateway.errors import ErrorKind, GatewayError, retry_after_header_s
from services.gateway.grpc_api import request_from_proto, usage_to_proto
from services.gateway.metrics import GatewayMetrics, slo_label
from services.gateway.openai_protocol import parse_chat, parse_completion, usage_json
from services.gateway.schema import SLO, InferenceRequest, combine_attainment, slo_attainment, total_usage
from services.gateway.schema import Usage as GatewayUsage
from services.global_manager.convert import sample_from_proto, sample_to_proto
from services.global_manager.core.routing import choose_instance, meets_tpot, plan_route
from services.global_manager.core.types import InstanceState, InstanceView, LoadSample, Role
from services.worker.convert import slo_from_proto, slo_to_proto
from services.worker.engine.slo import RequestSLO

pytestmark = [pytest.mark.timeout(10), pytest.mark.filterwarnings("error")]

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}


# ---- edge validation -----------------------------------------------------------------------------


@pytest.mark.parametrize("parse", [parse_chat, parse_completion], ids=["chat", "completions"])
def test_openai_slo_fields_are_parsed(parse: Any) -> None:
    body = CHAT if parse is parse_chat else COMPLETION
    req = parse({**body, "ttft_slo_s": 0.5, "tpot_slo_s": 2}, "id").inference
    assert req.slo == SLO(ttft_s=0.5, tpot_s=2.0)
    assert parse(dict(body), "id").inference.slo == SLO()
    assert parse({**body, "ttft_slo_s": None}, "id").inference.slo.is_empty


@pytest.mark.parametrize("parse", [parse_chat, parse_completion], ids=["chat", "completions"])
@pytest.mark.parametrize(
    ("field", "value", "quoted"),
    [
        ("ttft_slo_s", 0, "got 0"),
        ("ttft_slo_s", -1.5, "got -1.5"),
        ("ttft_slo_s", "fast", 'got "fast"'),
        ("ttft_slo_s", True, "got true"),
        ("tpot_slo_s", 0.0, "got 0.0"),
        ("tpot_slo_s", [0.1], "got [0.1]"),
        ("tpot_slo_s", {"p99": 0.1}, 'got {"p99": 0.1}'),
    ],
)
def test_bad_slo_values_are_a_400_quoting_them(parse: Any, field: str, value: Any, quoted: str) -> None:
    body = CHAT if parse is parse_chat else COMPLETION
    with pytest.raises(GatewayError) as err:
        parse({**body, field: value}, "id")
    assert err.value.kind is ErrorKind.INVALID and err.value.kind.http_status == 400
    assert err.value.param == field
    assert field in err.value.message and quoted in err.value.message


def test_grpc_request_slo_is_read_and_checked() -> None:
    msg = inference_pb2.GenerateRequest(model="m", prompt="hi", slo=common_pb2.RequestSLO(ttft_s=1.5))
    assert request_from_proto(msg).slo == SLO(ttft_s=1.5)
    assert request_from_proto(inference_pb2.GenerateRequest(model="m", prompt="hi")).slo.is_empty
    for bad, quoted in ((0.0, "got 0.0"), (-2.0, "got -2.0"), (math.inf, "got Infinity"), (math.nan, "got NaN")):
        msg = inference_pb2.GenerateRequest(model="m", prompt="hi", slo=common_pb2.RequestSLO(tpot_s=bad))
        with pytest.raises(GatewayError) as err:
            request_from_proto(msg)
        assert err.value.kind.grpc_code == grpc.StatusCode.INVALID_ARGUMENT
        assert "tpot_slo_s" in err.value.message and quoted in err.value.message


# ---- defaults --------------------------------------------------------------------------------------


def _config(**kw: Any) -> GatewayConfig:
    return GatewayConfig(global_manager="gm:1", param_manager="pm:1", **kw)


def test_defaults_fill_each_kind_the_request_leaves_unset() -> None:
    cfg = _config(
        default_ttft_slo_s=5.0,
        default_tpot_slo_s=0.2,
        model_slo_defaults={"big": {"ttft_s": 10.0}, "small": {"tpot_s": 0.05}},
    )

    def req(model: str, slo: SLO) -> InferenceRequest:
        return InferenceRequest(model=model, request_id="r", prompt="hi", slo=slo)

    assert resolve_slo(cfg, req("other", SLO())) == SLO(5.0, 0.2)
    assert resolve_slo(cfg, req("big", SLO())) == SLO(10.0, 0.2)  # the model's TTFT, the gateway's TPOT
    assert resolve_slo(cfg, req("small", SLO())) == SLO(5.0, 0.05)
    assert resolve_slo(cfg, req("big", SLO(ttft_s=1.0))) == SLO(1.0, 0.2)  # the request's own wins
    assert resolve_slo(_config(), req("big", SLO())) == SLO()  # no defaults: no objective


def test_bad_default_slos_are_refused() -> None:
    for kw in (
        {"default_ttft_slo_s": 0},
        {"default_tpot_slo_s": -1},
        {"default_ttft_slo_s": math.inf},
        {"model_slo_defaults": {"m": {"ttft_s": 0}}},
        {"model_slo_defaults": {"m": {"p99_s": 1}}},
        {"model_slo_defaults": {"m": {"tpot_s": math.inf}}},
    ):
        with pytest.raises(pydantic.ValidationError):
            _config(**kw)


def test_worker_gets_what_is_left_of_the_ttft_budget() -> None:
    req = InferenceRequest(model="m", request_id="r", prompt="hi", slo=SLO(2.0, 0.1), arrived_s=100.0)
    msg = worker_slo(req, resumed=False, now_s=100.5)
    assert msg is not None and msg.ttft_s == pytest.approx(1.5) and msg.tpot_s == pytest.approx(0.1)
    spent = worker_slo(req, resumed=False, now_s=103.0)
    assert spent is not None and 0 < spent.ttft_s <= 0.001  # spent: still an objective, a tiny one
    resumed = worker_slo(req, resumed=True, now_s=100.5)
    assert resumed is not None and not resumed.HasField("ttft_s") and resumed.tpot_s == pytest.approx(0.1)
    assert worker_slo(InferenceRequest(model="m", request_id="r", prompt="hi"), resumed=False) is None
    ttft_only = InferenceRequest(model="m", request_id="r", prompt="hi", slo=SLO(ttft_s=1.0), arrived_s=1.0)
    assert worker_slo(ttft_only, resumed=True, now_s=1.0) is None


# ---- attainment ------------------------------------------------------------------------------------


def test_attainment_per_choice_and_combined() -> None:
    assert slo_attainment(SLO(), 1.0, 0.1, 5) is None
    a = slo_attainment(SLO(ttft_s=0.5, tpot_s=0.05), 0.4, 0.06, 5)
    assert a == SLOAttainment(0.5, 0.05, True, False, 0.4, 0.06)
    one_token = slo_attainment(SLO(tpot_s=0.05), 0.4, 0.0, 1)
    assert one_token is not None and one_token.tpot_met is True and one_token.tpot_observed_s == 0.0
    assert one_token.ttft_met is None and one_token.ttft_s is None
    b = slo_attainment(SLO(ttft_s=0.5, tpot_s=0.05), 0.7, 0.01, 5)
    assert b is not None
    both = combine_attainment([a, b])  # type: ignore[list-item]
    assert both == SLOAttainment(0.5, 0.05, False, False, 0.7, 0.06)
    assert combine_attainment([]) is None
    usage = total_usage([GatewayUsage(10, 5, a), GatewayUsage(10, 5, b)])
    assert usage.slo == both and usage.completion_tokens == 10
    assert total_usage([GatewayUsage(10, 5)]).slo is None


def test_usage_json_carries_slo_only_with_an_slo() -> None:
    assert "slo" not in usage_json(GatewayUsage(3, 4))
    att = SLOAttainment(ttft_s=0.5, ttft_met=True, ttft_observed_s=0.1234567, tpot_observed_s=0.01)
    assert usage_json(GatewayUsage(3, 4, att))["slo"] == {
        "ttft_s": 0.5,
        "tpot_s": None,
        "ttft_met": True,
        "tpot_met": None,
        "ttft_observed_s": 0.123457,
        "tpot_observed_s": 0.01,
    }
    proto = usage_to_proto(GatewayUsage(3, 4, att))
    assert proto.slo.ttft_s == 0.5 and proto.slo.ttft_met and not proto.slo.HasField("tpot_met")
    assert not usage_to_proto(GatewayUsage(3, 4)).HasField("slo")


def test_attainment_metric_labels() -> None:
    metrics = GatewayMetrics(CollectorRegistry())
    metrics.observe_slo(SLOAttainment(ttft_s=0.5, tpot_s=0.05, ttft_met=True, tpot_met=False))
    metrics.observe_slo(SLOAttainment(ttft_s=2.0, ttft_met=False))
    metrics.observe_slo(SLOAttainment(ttft_s=0.50, ttft_met=True))

    def value(**labels: str) -> float | None:
        return metrics.registry.get_sample_value("blitzmesh_gateway_slo_requests_total", labels)

    assert value(kind="ttft", slo="0.5", met="true") == 2.0
    assert value(kind="tpot", slo="0.05", met="false") == 1.0
    assert value(kind="ttft", slo="2", met="false") == 1.0
    assert value(kind="tpot", slo="2", met="false") is None
    assert [slo_label(v) for v in (0.5, 2.0, 2, 0.001, 0.1 + 0.2, 1e-5)] == ["0.5", "2", "2", "0.001", "0.3", "1e-05"]


# ---- the refusal -------------------------------------------------------------------------------------


def test_slo_refusal_is_a_429_with_retry_after() -> None:
    req = InferenceRequest(model="m", request_id="r-1", prompt="hi", slo=SLO(ttft_s=0.001))
    refusals = [
        _WorkerFailedError("w-1", grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", 0, slo_kind="ttft", retry_after_s=2.2),
        _WorkerFailedError("w-2", grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", 0, slo_kind="ttft", retry_after_s=4.0),
    ]
    err = _slo_error(req, refusals, ["w-1: RESOURCE_EXHAUSTED: busy", "w-2: RESOURCE_EXHAUSTED: busy"])
    assert err.kind is ErrorKind.SLO_UNATTAINABLE
    assert err.kind.http_status == 429 and err.kind.grpc_code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.kind.metric_outcome == "slo_rejected"
    assert "TTFT" in err.message and "ttft_slo_s=0.001" in err.message and "w-2" in err.message
    assert err.http_headers() == {"Retry-After": "3"}  # the soonest, rounded up
    assert dict(err.grpc_trailing_metadata()) == {RETRY_AFTER_METADATA_KEY: "2.200", SLO_METADATA_KEY: "ttft"}
    body = err.openai_body()["error"]
    assert body["type"] == "slo_unattainable" and body["code"] == 429 and body["param"] == "ttft_slo_s"
    # No hint from the workers: still a Retry-After, of 1 s.
    bare = [_WorkerFailedError("w-1", grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", 0, slo_kind="tpot")]
    tpot = _slo_error(InferenceRequest(model="m", request_id="r", prompt="hi", slo=SLO(tpot_s=0.02)), bare, [])
    assert tpot.http_headers() == {"Retry-After": "1"} and "tpot_slo_s=0.02" in tpot.message
    assert [retry_after_header_s(v) for v in (0.0, 0.2, 1.0, 1.01, math.inf)] == [1, 1, 1, 2, 1]
    assert GatewayError(ErrorKind.OVERLOADED, "queue full").http_headers() == {}


# ---- the worker's conversion ------------------------------------------------------------------------


def test_worker_slo_conversion() -> None:
    assert slo_from_proto(common_pb2.RequestSLO()) is None
    assert slo_from_proto(common_pb2.RequestSLO(ttft_s=0.25)) == RequestSLO(ttft_s=0.25)
    both = RequestSLO(ttft_s=1.0, tpot_s=0.05)
    assert slo_from_proto(slo_to_proto(both)) == both
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="tpot_s must be a positive number"):
            slo_from_proto(common_pb2.RequestSLO(tpot_s=bad))


def test_load_report_carries_the_slo_figures_to_the_manager() -> None:
    load = LoadReport(
        est_tpot_s=0.04, slo_rejected_total=3, preempted_total=2, prefix_hit_tokens=7, prefix_query_tokens=9
    )
    msg = convert.load_report_to_proto(load)
    assert convert.load_report_from_proto(msg) == load
    sample = sample_from_proto("w", 1.0, msg)
    assert sample.est_tpot_s == pytest.approx(0.04) and sample.slo_rejected_total == 3 and sample.preempted_total == 2
    assert sample_from_proto("w", 1.0, common_pb2.LoadReport()).est_tpot_s is None  # 0 = no estimate
    back = sample_to_proto(sample)
    assert back.est_tpot_s == pytest.approx(0.04) and back.prefix_query_tokens == 9


# ---- the SDK ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "quoted"),
    [
        ({"ttft_slo_s": 0}, "ttft_slo_s must be a positive finite number of seconds, got 0"),
        ({"ttft_slo_s": -0.5}, "got -0.5"),
        ({"tpot_slo_s": math.nan}, "got nan"),
        ({"tpot_slo_s": math.inf}, "got inf"),
        ({"tpot_slo_s": "0.1"}, "got '0.1'"),
        ({"ttft_slo_s": True}, "got True"),
    ],
)
async def test_sdk_rejects_bad_slos_quoting_them(kwargs: dict[str, Any], quoted: str) -> None:
    client = AsyncClient("127.0.0.1:9")
    try:
        with pytest.raises(ValueError, match="slo_s must be a positive finite number") as err:
            client.generate("hi", model="m", **kwargs)
        assert quoted in str(err.value)
        with pytest.raises(ValueError) as err:
            await client.complete("hi", model="m", **kwargs)
        assert quoted in str(err.value)
    finally:
        await client.close()


def test_sdk_request_and_usage_conversion() -> None:
    msg = convert.generate_request_to_proto(model="m", prompt="hi", ttft_slo_s=0.5)
    assert msg.HasField("slo") and msg.slo.ttft_s == 0.5 and not msg.slo.HasField("tpot_s")
    assert not convert.generate_request_to_proto(model="m", prompt="hi").HasField("slo")
    usage = Usage(1, 2, 3, SLOAttainment(ttft_s=0.5, tpot_s=0.1, ttft_met=True, tpot_met=False, ttft_observed_s=0.2))
    assert convert.usage_from_proto(convert.usage_to_proto(usage)) == usage
    assert convert.usage_from_proto(convert.usage_to_proto(Usage(1, 2, 3))).slo is None


def test_sdk_maps_an_slo_refusal_to_its_error_with_retry_after() -> None:
    trailing = grpc.aio.Metadata((RETRY_AFTER_METADATA_KEY, "2.500"), (SLO_METADATA_KEY, "ttft"))
    e = grpc.aio.AioRpcError(
        grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(), trailing, details="TTFT objective ttft_slo_s=0.001"
    )
    err = sdk_errors.from_rpc_error(e, request_id="r-1")
    assert type(err) is blitzmesh.SLOUnattainableError and isinstance(err, blitzmesh.OverloadedError)
    assert err.retry_after_s == 2.5 and err.request_id == "r-1" and "ttft_slo_s=0.001" in str(err)
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is blitzmesh.SLOUnattainableError and again.retry_after_s == 2.5
    # Plain overload (the gateway's queue): OverloadedError, no hint.
    plain = grpc.aio.AioRpcError(
        grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(), grpc.aio.Metadata(), details="queue full"
    )
    err = sdk_errors.from_rpc_error(plain)
    assert type(err) is blitzmesh.OverloadedError and err.retry_after_s is None
    # The SDK and the services agree on the keys.
    assert (sdk_errors.RETRY_AFTER_METADATA_KEY, sdk_errors.SLO_METADATA_KEY) == (
        RETRY_AFTER_METADATA_KEY,
        SLO_METADATA_KEY,
    )


# ---- the global manager's routing -------------------------------------------------------------------


def _view(iid: str, running: int = 0, est_tpot_s: float | None = None, *, loaded: bool = True) -> InstanceView:
    load = LoadSample(iid, 0.0, running=running, kv_blocks_total=100, est_tpot_s=est_tpot_s) if loaded else None
    return InstanceView(iid, "m", Role.COLOCATED, InstanceState.SERVING, 8, 8, "h", 0.0, load)


def test_router_prefers_instances_whose_tpot_estimate_meets_the_objective() -> None:
    fast_busy = _view("a", running=5, est_tpot_s=0.02)
    slow_idle = _view("b", running=0, est_tpot_s=0.2)
    unknown = _view("c", running=3, est_tpot_s=None)  # no estimate yet: counted as meeting it
    assert choose_instance([fast_busy, slow_idle]) is slow_idle  # no objective: least loaded
    assert choose_instance([fast_busy, slow_idle], tpot_slo_s=0.05) is fast_busy
    assert choose_instance([fast_busy, slow_idle, unknown], tpot_slo_s=0.05) is unknown
    assert choose_instance([fast_busy, slow_idle], tpot_slo_s=0.5) is slow_idle  # both meet it: load decides
    # None meets it: the least loaded, as without an objective.
    assert choose_instance([_view("x", 2, 0.3), _view("y", 1, 0.4)], tpot_slo_s=0.05).instance_id == "y"
    assert choose_instance([fast_busy, slow_idle], 0, ("a",), tpot_slo_s=0.05) is slow_idle  # excluded: next best
    assert meets_tpot(_view("n", loaded=False), 0.01) and meets_tpot(slow_idle, None)
    hops = plan_route([fast_busy, slow_idle], model="m", tpot_slo_s=0.05)
    assert [v.instance_id for v in hops] == ["a"]
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="tpot_slo_s"):
            choose_instance([fast_busy], tpot_slo_s=bad)
