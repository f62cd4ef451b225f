"""Round-trip tests of the SDK's protobuf converters (blitzmesh.convert)."""

from __future__ import annotations

import math

import pytest

from blitzmesh import convert
from blitzmesh.types import (
    ChatMessage,
    Choice,
    ClusterEvent,
    ClusterState,
    Completion,
    EngineInfo,
    EspGroup,
    InstanceInfo,
    KernelChoice,
    LoadReport,
    ModelInfo,
    PolicyState,
    SamplingParams,
    ScaleResult,
    TokenChunk,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from blitzmesh.v1 import admin_pb2, common_pb2, inference_pb2

pytestmark = [pytest.mark.timeout(10), pytest.mark.filterwarnings("error")]

# Every field set to a non-default value, so a field the converters drop fails a round trip.
# Floats are binary fractions because temperature and top_p travel as float32.
SAMPLING = SamplingParams(
    temperature=0.5,
    top_p=0.875,
    top_k=40,
    max_tokens=128,
    stop=("\n\n", "###"),
    seed=-(2**40),
    stop_token_ids=(2, 7),
    ignore_eos=True,
    presence_penalty=-0.5,
    frequency_penalty=1.25,
    repetition_penalty=1.125,
    logit_bias={50256: -100.0, 7: 2.5},
    logprobs=5,
    prompt_logprobs=0,
)
LOGPROBS = (
    TokenLogprob(17, -0.25, (TopLogprob(17, -0.25), TopLogprob(3, -2.5))),
    TokenLogprob(4, -1.5, ()),
)
PROMPT_LOGPROBS = (TokenLogprob(1, None), TokenLogprob(99, -7.75, (TopLogprob(5, -0.125),)))
USAGE = Usage(prompt_tokens=11, completion_tokens=5, total_tokens=16, cached_tokens=7)
LOAD = LoadReport(
    decode_tps=2500.5,
    prefill_tps=9000.25,
    ttft_p50_s=0.12,
    ttft_p99_s=0.9,
    tbt_p50_s=0.02,
    tbt_p99_s=0.07,
    running=12,
    waiting=3,
    waiting_prefill_tokens=4096,
    kv_blocks_used=700,
    kv_blocks_total=1024,
    tokens_generated_total=2**40,
    prefill_capacity_tps=12000.5,
    esp_groups=("esp-1-r", "esp-2-s"),
)
INSTANCE = InstanceInfo(
    instance_id="w-3",
    address="10.0.0.3:7001",
    host="node-a",
    model_id="llama-8b",
    state="loading",
    role="decode",
    layers_loaded=17,
    num_layers=32,
    load=LOAD,
    dataplane_address=b"\x00\x01ucx",
    dataplane_kind="ucx",
    last_heartbeat_age_s=0.4,
    memory_budget_bytes=80 * 2**30,
    engine=EngineInfo(
        requested_dtype="bfloat16",
        dtype="float32",
        dtype_reason="bfloat16 GEMM measured 40x slower",
        kernel_mode="auto",
        isa="avx2",
        machine_isa="avx512",
        kernels=(
            KernelChoice("varlen_prefill", "torch", "-", "native measured 0.5x torch", 2.5, 1.25, 0.5),
            KernelChoice("paged_decode", "native", "avx2", "measured 6x torch", 0.5, 3.0),
            KernelChoice("small_gemm", "torch", "-", "no native kernel at avx2"),
        ),
        plan_cached=True,
        plan_measured_s=1.5,
    ),
)
MODEL = ModelInfo(
    model_id="llama-8b",
    num_layers=32,
    size_bytes=16 * 2**30,
    max_context=8192,
    vocab_size=128256,
    dtype="bfloat16",
    created_unix_s=1_700_000_000,
    num_parameters=8_030_000_000,
)

ROUND_TRIPS = [
    pytest.param(SAMPLING, convert.sampling_to_proto, convert.sampling_from_proto, id="sampling"),
    pytest.param(
        ChatMessage(role="user", content="hi"),
        convert.chat_message_to_proto,
        convert.chat_message_from_proto,
        id="chat_message",
    ),
    pytest.param(USAGE, convert.usage_to_proto, convert.usage_from_proto, id="usage"),
    pytest.param(
        TokenChunk(text="lo", token_ids=(5, 6), request_id="r1", instance_id="w-3"),
        convert.token_chunk_to_proto,
        convert.token_chunk_from_proto,
        id="token_chunk_middle",
    ),
    pytest.param(
        TokenChunk(text="", finish_reason="length", usage=USAGE, request_id="r1", instance_id="w"),
        convert.token_chunk_to_proto,
        convert.token_chunk_from_proto,
        id="token_chunk_last",
    ),
    pytest.param(
        Completion("Hello", (1, 2), "abort", USAGE, "r2", "w-1"),
        convert.completion_to_proto,
        convert.completion_from_proto,
        id="completion",
    ),
    pytest.param(
        TokenChunk(text="x", token_ids=(17, 4), index=2, logprobs=LOGPROBS, prompt_logprobs=PROMPT_LOGPROBS),
        convert.token_chunk_to_proto,
        convert.token_chunk_from_proto,
        id="token_chunk_logprobs",
    ),
    pytest.param(
        Completion(
            "Hello",
            (17, 4),
            "stop",
            USAGE,
            "r4",
            "w-1",
            choices=(
                Choice(0, "Hello", (17, 4), "stop", LOGPROBS, "w-1"),
                Choice(1, "Bye", (8,), "length", (), "w-2"),
            ),
            prompt_logprobs=PROMPT_LOGPROBS,
        ),
        convert.completion_to_proto,
        convert.completion_from_proto,
        id="completion_n2_logprobs",
    ),
    pytest.param(LOGPROBS[0], convert.token_logprob_to_proto, convert.token_logprob_from_proto, id="logprob"),
    pytest.param(MODEL, convert.model_info_to_proto, convert.model_info_from_proto, id="model"),
    pytest.param(LOAD, convert.load_report_to_proto, convert.load_report_from_proto, id="load"),
    pytest.param(INSTANCE, convert.instance_info_to_proto, convert.instance_info_from_proto, id="instance"),
    pytest.param(
        ClusterState(
            instances=(INSTANCE, InstanceInfo("w-4", state="lost", role="prefill")),
            models=(MODEL,),
            policy="heteroscale",
            advisory=True,
        ),
        convert.cluster_state_to_proto,
        convert.cluster_state_from_proto,
        id="cluster_state",
    ),
    pytest.param(
        ClusterState(
            instances=(INSTANCE,),
            esp_groups=(
                EspGroup(
                    "esp-2-s", "s", "m", ("w-1", "w-2"), (0, 64, 120), ("w-3",), 0.5, ("w-2", "w-3"), True, (60, 12)
                ),
                EspGroup("esp-1-r", "r", "m", ("w-1", "w-2"), (0, 64, 120), ("w-3",), 1.5),
            ),
        ),
        convert.cluster_state_to_proto,
        convert.cluster_state_from_proto,
        id="cluster_state_esp",
    ),
    pytest.param(
        ClusterEvent(
            time_s=12.5,
            action="autoscaling_decision",
            target="llama-8b",
            status="applied",
            reason="decode_tps=2500 > 2000",
            instance_id="w-3",
        ),
        convert.cluster_event_to_proto,
        convert.cluster_event_from_proto,
        id="cluster_event",
    ),
    pytest.param(
        ScaleResult(instance_ids=("w-5", "w-6"), reason="scale_out"),
        convert.scale_result_to_proto,
        convert.scale_result_from_proto,
        id="scale_result",
    ),
    pytest.param(
        PolicyState(policy="latency", params={"ttft_slo_s": "0.5"}, advisory=True),
        convert.policy_state_to_proto,
        convert.policy_state_from_proto,
        id="policy_state",
    ),
]


@pytest.mark.parametrize(("value", "to_proto", "from_proto"), ROUND_TRIPS)
def test_dataclass_survives_wire_round_trip(value, to_proto, from_proto):
    msg = to_proto(value)
    # Through bytes, as on the wire, not just through the in-memory message.
    decoded = type(msg).FromString(msg.SerializeToString())
    assert from_proto(decoded) == value


@pytest.mark.parametrize(("value", "to_proto", "from_proto"), ROUND_TRIPS)
def test_proto_survives_sdk_round_trip(value, to_proto, from_proto):
    msg = to_proto(value)
    assert to_proto(from_proto(msg)) == msg


def test_unset_sampling_fields_stay_unset_so_gateway_defaults_apply():
    msg = convert.sampling_to_proto(SamplingParams(max_tokens=4))
    assert msg.HasField("max_tokens")
    for name in (
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "logprobs",
        "prompt_logprobs",
    ):
        assert not msg.HasField(name), name
    assert not msg.logit_bias
    assert convert.sampling_from_proto(msg) == SamplingParams(max_tokens=4)


def test_zero_temperature_is_sent_not_dropped():
    # 0 means greedy; proto3 would drop it without `optional` presence.
    msg = convert.sampling_to_proto(SamplingParams(temperature=0.0, top_k=0))
    assert msg.HasField("temperature") and msg.temperature == 0.0
    assert msg.HasField("top_k") and msg.top_k == 0


def test_float32_sampling_values_come_back_within_float32_precision():
    back = convert.sampling_from_proto(convert.sampling_to_proto(SamplingParams(temperature=0.7)))
    assert back.temperature is not None
    assert math.isclose(back.temperature, 0.7, rel_tol=1e-7)


def test_generate_request_carries_every_input():
    msg = convert.generate_request_to_proto(
        model="m",
        messages=[ChatMessage("system", "be brief"), ChatMessage("user", "hi")],
        sampling=SAMPLING,
        request_id="r9",
        return_token_ids=True,
    )
    assert msg.model == "m" and msg.request_id == "r9" and msg.return_token_ids
    assert [(m.role, m.content) for m in msg.messages] == [("system", "be brief"), ("user", "hi")]
    assert msg.prompt == "" and list(msg.prompt_token_ids) == []
    assert convert.sampling_from_proto(msg.sampling) == SAMPLING


def test_chunk_without_finish_reason_or_usage_has_none():
    chunk = convert.token_chunk_from_proto(inference_pb2.GenerateResponse(text="a"))
    assert chunk.finish_reason is None and chunk.usage is None


def test_every_finish_reason_maps_both_ways():
    for name in ("stop", "length", "abort"):
        value = convert.finish_reason_to_proto(name)  # type: ignore[arg-type]
        assert common_pb2.FinishReason.Name(value) == f"FINISH_REASON_{name.upper()}"
        assert convert.finish_reason_from_proto(value) == name


def test_unknown_finish_reason_is_rejected():
    with pytest.raises(ValueError, match="99"):
        convert.finish_reason_from_proto(99)
    with pytest.raises(ValueError, match="'eos'"):
        convert.finish_reason_to_proto("eos")  # type: ignore[arg-type]


def test_completion_without_finish_reason_is_malformed():
    with pytest.raises(ValueError, match="'r3'"):
        convert.completion_from_proto(inference_pb2.CompleteResponse(request_id="r3", text="x"))


def test_instance_states_are_lowercase_names_of_the_enum():
    for value in common_pb2.InstanceState.values():
        expected = common_pb2.InstanceState.Name(value).removeprefix("INSTANCE_STATE_").lower()
        assert convert.instance_state_from_proto(value) == expected


def test_instance_roles_are_lowercase_names_of_the_enum():
    for value in common_pb2.InstanceRole.values():
        expected = common_pb2.InstanceRole.Name(value).removeprefix("INSTANCE_ROLE_").lower()
        assert convert.instance_role_from_proto(value) == expected


def test_state_from_a_newer_server_reads_as_unspecified():
    msg = common_pb2.InstanceInfo(instance_id="w", state=42)  # type: ignore[arg-type]
    assert convert.instance_info_from_proto(msg).state == "unspecified"


def test_policy_params_are_formatted_as_strings():
    out = convert.policy_params_to_proto({"a": "x", "b": 3, "c": 0.25, "d": True, "e": False})
    assert out == {"a": "x", "b": "3", "c": "0.25", "d": "true", "e": "false"}
    with pytest.raises(ValueError, match=r"\[1\]"):
        convert.policy_params_to_proto({"a": [1]})  # type: ignore[dict-item]


def test_set_policy_response_params_are_a_plain_dict():
    msg = admin_pb2.SetPolicyResponse(policy="p", params={"k": "v"})
    params = convert.policy_state_from_proto(msg).params
    assert type(params) is dict and params == {"k": "v"}


@pytest.mark.parametrize(
    ("kwargs", "quoted"),
    [
        ({"temperature": -0.1}, "-0.1"),
        ({"temperature": math.nan}, "nan"),
        ({"top_p": 0.0}, "0.0"),
        ({"top_p": 1.5}, "1.5"),
        ({"top_k": -2}, "-2"),
        ({"max_tokens": 0}, "0"),
        ({"max_tokens": 2.5}, "2.5"),
        ({"max_tokens": True}, "True"),
        ({"seed": 2**64}, str(2**64)),
        ({"stop": ("",)}, "('',)"),
        ({"stop_token_ids": (-1,)}, "(-1,)"),
        ({"presence_penalty": 2.5}, "2.5"),
        ({"frequency_penalty": -2.01}, "-2.01"),
        ({"repetition_penalty": 0}, "got 0"),
        ({"logit_bias": {3: 100.5}}, "100.5"),
        ({"logit_bias": {"3": 1}}, "'3'"),
        ({"logprobs": 21}, "21"),
        ({"prompt_logprobs": -1}, "-1"),
    ],
)
def test_sampling_params_reject_bad_values_quoting_them(kwargs, quoted):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert quoted in str(info.value)


def test_sampling_params_store_sequences_as_tuples():
    params = SamplingParams(stop=["a"], stop_token_ids=[1], logit_bias={9: 1, 2: -3.5})  # type: ignore[arg-type]
    assert params.stop == ("a",) and params.stop_token_ids == (1,)
    assert params.logit_bias == ((2, -3.5), (9, 1.0)) and dict(params.logit_bias) == {2: -3.5, 9: 1.0}
    hash(params)  # frozen and hashable: usable as a cache key


def test_completion_choices_default_to_choice_zero_and_old_replies_read():
    done = Completion("Hi", (5,), "stop", USAGE, "r", "w")
    assert done.choices == (Choice(0, "Hi", (5,), "stop", (), "w"),) and done.logprobs == ()
    # A gateway from before `n` sends no choices: the top-level fields are the one choice.
    old = inference_pb2.CompleteResponse(
        request_id="r", text="Hi", token_ids=[5], finish_reason=common_pb2.FINISH_REASON_STOP, instance_id="w"
    )
    assert convert.completion_from_proto(old).choices == done.choices


def test_completion_with_a_misnumbered_choice_is_malformed():
    msg = convert.completion_to_proto(Completion("Hi", (), "stop", USAGE, "r5", "w"))
    msg.choices[0].index = 3
    with pytest.raises(ValueError, match="'r5'.*index 3"):
        convert.completion_from_proto(msg)


def test_generate_request_carries_n_and_echo():
    msg = convert.generate_request_to_proto(model="m", prompt="p", n=3, echo=True)
    assert (msg.n, msg.echo) == (3, True)
