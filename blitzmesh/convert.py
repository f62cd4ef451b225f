"""Converters between the SDK's dataclasses (`blitzmesh.types`) and the protobuf messages.

This is the one module where `_pb2` types meet the public API. Each message has a `*_to_proto`
and a `*_from_proto`; the unit tests pin that they round-trip. `*_from_proto` raises ValueError
when a reply breaks the protocol (the client reports that as an InternalError).

The services use the same converters for the wire enums (finish reason, instance state and role)
and for LoadReport and InstanceInfo, so each of those mappings is written here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from blitzmesh.types import (
    ChatMessage,
    Choice,
    ClusterEvent,
    ClusterState,
    Completion,
    EngineInfo,
    EspGroup,
    FinishReason,
    InstanceInfo,
    InstanceRole,
    InstanceState,
    KernelChoice,
    LoadReport,
    ModelInfo,
    PolicyState,
    SamplingParams,
    ScaleResult,
    SLOAttainment,
    TokenChunk,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from blitzmesh.v1 import admin_pb2, common_pb2, inference_pb2

_FINISH_TO_PROTO: dict[FinishReason, common_pb2.FinishReason.ValueType] = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
}
_FINISH_FROM_PROTO = {v: k for k, v in _FINISH_TO_PROTO.items()}

_STATE_TO_PROTO: dict[InstanceState, common_pb2.InstanceState.ValueType] = {
    "unspecified": common_pb2.INSTANCE_STATE_UNSPECIFIED,
    "idle": common_pb2.INSTANCE_STATE_IDLE,
    "loading": common_pb2.INSTANCE_STATE_LOADING,
    "serving": common_pb2.INSTANCE_STATE_SERVING,
    "draining": common_pb2.INSTANCE_STATE_DRAINING,
    "lost": common_pb2.INSTANCE_STATE_LOST,
}
_STATE_FROM_PROTO = {v: k for k, v in _STATE_TO_PROTO.items()}

_ROLE_TO_PROTO: dict[InstanceRole, common_pb2.InstanceRole.ValueType] = {
    "unspecified": common_pb2.INSTANCE_ROLE_UNSPECIFIED,
    "colocated": common_pb2.INSTANCE_ROLE_COLOCATED,
    "prefill": common_pb2.INSTANCE_ROLE_PREFILL,
    "decode": common_pb2.INSTANCE_ROLE_DECODE,
}
_ROLE_FROM_PROTO = {v: k for k, v in _ROLE_TO_PROTO.items()}


# --- enums ------------------------------------------------------------------------------------


def finish_reason_to_proto(reason: FinishReason | None) -> common_pb2.FinishReason.ValueType:
    """``None`` becomes FINISH_REASON_UNSPECIFIED."""
    if reason is None:
        return common_pb2.FINISH_REASON_UNSPECIFIED
    try:
        return _FINISH_TO_PROTO[reason]
    except KeyError:
        raise ValueError(f"finish_reason must be one of {sorted(_FINISH_TO_PROTO)}, got {reason!r}") from None


def finish_reason_from_proto(value: int) -> FinishReason | None:
    """FINISH_REASON_UNSPECIFIED becomes ``None``.

    Raises:
        ValueError: for a value this SDK does not know. Unlike states and roles, which are only
            displayed, a finish reason drives the caller's logic, so guessing would be wrong.
    """
    if value == common_pb2.FINISH_REASON_UNSPECIFIED:
        return None
    try:
        return _FINISH_FROM_PROTO[value]
    except KeyError:
        raise ValueError(f"unknown finish_reason value {value!r}") from None


def instance_state_to_proto(state: InstanceState) -> common_pb2.InstanceState.ValueType:
    try:
        return _STATE_TO_PROTO[state]
    except KeyError:
        raise ValueError(f"state must be one of {sorted(_STATE_TO_PROTO)}, got {state!r}") from None


def instance_state_from_proto(value: int) -> InstanceState:
    # A newer server may add states; show them as unspecified rather than fail a status call.
    return _STATE_FROM_PROTO.get(value, "unspecified")


def instance_role_to_proto(role: InstanceRole) -> common_pb2.InstanceRole.ValueType:
    try:
        return _ROLE_TO_PROTO[role]
    except KeyError:
        raise ValueError(f"role must be one of {sorted(_ROLE_TO_PROTO)}, got {role!r}") from None


def instance_role_from_proto(value: int) -> InstanceRole:
    return _ROLE_FROM_PROTO.get(value, "unspecified")


# --- inference --------------------------------------------------------------------------------


# The optional fields of SamplingParams whose ``None`` means "unset on the wire".
_OPTIONAL_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "max_tokens",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logprobs",
    "prompt_logprobs",
)


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    """Unset (``None``) fields stay unset so the gateway applies its defaults. The gateway uses
    this converter too (the SDK type is its internal sampling type): one per wire type."""
    msg = common_pb2.SamplingParams(
        stop=params.stop,
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
        logit_bias=dict(params.logit_bias),
    )
    for name in _OPTIONAL_SAMPLING_FIELDS:
        value = getattr(params, name)
        if value is not None:
            setattr(msg, name, value)
    return msg


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Note that temperature, top_p, the penalties and the biases travel as float32: 0.7 comes
    back as 0.699999988.

    Raises:
        ValueError: for an out-of-range field, quoting it.
    """
    optional = {name: getattr(msg, name) if msg.HasField(name) else None for name in _OPTIONAL_SAMPLING_FIELDS}
    return SamplingParams(
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logit_bias=dict(msg.logit_bias),
        **optional,
    )


def token_logprob_to_proto(entry: TokenLogprob) -> common_pb2.TokenLogprob:
    msg = common_pb2.TokenLogprob(
        token_id=entry.token_id,
        top_logprobs=[common_pb2.TopLogprob(token_id=t.token_id, logprob=t.logprob) for t in entry.top_logprobs],
    )
    if entry.logprob is not None:
        msg.logprob = entry.logprob
    return msg


def token_logprob_from_proto(msg: common_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(
        token_id=msg.token_id,
        logprob=msg.logprob if msg.HasField("logprob") else None,
        top_logprobs=tuple(TopLogprob(t.token_id, t.logprob) for t in msg.top_logprobs),
    )


def _logprobs_to_proto(entries: Sequence[TokenLogprob]) -> list[common_pb2.TokenLogprob]:
    return [token_logprob_to_proto(e) for e in entries]


def _logprobs_from_proto(msgs: Sequence[common_pb2.TokenLogprob]) -> tuple[TokenLogprob, ...]:
    return tuple(token_logprob_from_proto(m) for m in msgs)


def chat_message_to_proto(message: ChatMessage) -> inference_pb2.ChatMessage:
    return inference_pb2.ChatMessage(role=message.role, content=message.content)


def chat_message_from_proto(msg: inference_pb2.ChatMessage) -> ChatMessage:
    return ChatMessage(role=msg.role, content=msg.content)


def generate_request_to_proto(
    *,
    model: str,
    prompt: str | None = None,
    messages: Sequence[ChatMessage] | None = None,
    prompt_token_ids: Sequence[int] | None = None,
    sampling: SamplingParams | None = None,
    request_id: str = "",
    return_token_ids: bool = False,
    n: int = 1,
    echo: bool = False,
    ttft_slo_s: float | None = None,
    tpot_slo_s: float | None = None,
) -> inference_pb2.GenerateRequest:
    """Build a GenerateRequest (also the request of Complete). The caller validates the
    exactly-one-of rule for prompt, messages and prompt_token_ids. The SLO objectives travel
    only when given (unset: the deployment's defaults apply)."""
    msg = inference_pb2.GenerateRequest(
        model=model,
        prompt=prompt or "",
        messages=[chat_message_to_proto(m) for m in messages or ()],
        prompt_token_ids=prompt_token_ids or (),
        sampling=sampling_to_proto(sampling or SamplingParams()),
        request_id=request_id,
        return_token_ids=return_token_ids,
        n=n,
        echo=echo,
    )
    msg.slo.CopyFrom(request_slo_to_proto(ttft_slo_s, tpot_slo_s))
    if not msg.slo.ListFields():
        msg.ClearField("slo")
    return msg


def request_slo_to_proto(ttft_s: float | None, tpot_s: float | None) -> common_pb2.RequestSLO:
    """None stays unset: "no objective of that kind" (or the deployment's default)."""
    msg = common_pb2.RequestSLO()
    if ttft_s is not None:
        msg.ttft_s = ttft_s
    if tpot_s is not None:
        msg.tpot_s = tpot_s
    return msg


def request_slo_from_proto(msg: common_pb2.RequestSLO) -> tuple[float | None, float | None]:
    """(ttft_s, tpot_s), None where unset; values are not range-checked here."""
    return (
        msg.ttft_s if msg.HasField("ttft_s") else None,
        msg.tpot_s if msg.HasField("tpot_s") else None,
    )


def slo_attainment_to_proto(slo: SLOAttainment) -> common_pb2.SLOAttainment:
    msg = common_pb2.SLOAttainment(ttft_observed_s=slo.ttft_observed_s, tpot_observed_s=slo.tpot_observed_s)
    for name in ("ttft_s", "tpot_s", "ttft_met", "tpot_met"):
        value = getattr(slo, name)
        if value is not None:
            setattr(msg, name, value)
    return msg


def slo_attainment_from_proto(msg: common_pb2.SLOAttainment) -> SLOAttainment:
    return SLOAttainment(
        ttft_s=msg.ttft_s if msg.HasField("ttft_s") else None,
        tpot_s=msg.tpot_s if msg.HasField("tpot_s") else None,
        ttft_met=msg.ttft_met if msg.HasField("ttft_met") else None,
        tpot_met=msg.tpot_met if msg.HasField("tpot_met") else None,
        ttft_observed_s=msg.ttft_observed_s,
        tpot_observed_s=msg.tpot_observed_s,
    )


def usage_to_proto(usage: Usage) -> common_pb2.Usage:
    msg = common_pb2.Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
        cached_tokens=usage.cached_tokens,
    )
    if usage.slo is not None:
        msg.slo.CopyFrom(slo_attainment_to_proto(usage.slo))
    return msg


def usage_from_proto(msg: common_pb2.Usage) -> Usage:
    return Usage(
        prompt_tokens=msg.prompt_tokens,
        completion_tokens=msg.completion_tokens,
        total_tokens=msg.total_tokens,
        slo=slo_attainment_from_proto(msg.slo) if msg.HasField("slo") else None,
        cached_tokens=msg.cached_tokens,
    )


def token_chunk_to_proto(chunk: TokenChunk) -> inference_pb2.GenerateResponse:
    msg = inference_pb2.GenerateResponse(
        request_id=chunk.request_id,
        text=chunk.text,
        token_ids=chunk.token_ids,
        instance_id=chunk.instance_id,
        index=chunk.index,
        logprobs=_logprobs_to_proto(chunk.logprobs),
        prompt_logprobs=_logprobs_to_proto(chunk.prompt_logprobs),
    )
    if chunk.finish_reason is not None:
        msg.finish_reason = finish_reason_to_proto(chunk.finish_reason)
    if chunk.usage is not None:
        msg.usage.CopyFrom(usage_to_proto(chunk.usage))
    return msg


def token_chunk_from_proto(msg: inference_pb2.GenerateResponse) -> TokenChunk:
    return TokenChunk(
        text=msg.text,
        token_ids=tuple(msg.token_ids),
        finish_reason=(finish_reason_from_proto(msg.finish_reason) if msg.HasField("finish_reason") else None),
        usage=usage_from_proto(msg.usage) if msg.HasField("usage") else None,
        request_id=msg.request_id,
        instance_id=msg.instance_id,
        index=msg.index,
        logprobs=_logprobs_from_proto(msg.logprobs),
        prompt_logprobs=_logprobs_from_proto(msg.prompt_logprobs),
    )


def choice_to_proto(choice: Choice) -> inference_pb2.Choice:
    return inference_pb2.Choice(
        index=choice.index,
        text=choice.text,
        token_ids=choice.token_ids,
        finish_reason=finish_reason_to_proto(choice.finish_reason),
        logprobs=_logprobs_to_proto(choice.logprobs),
        instance_id=choice.instance_id,
    )


def choice_from_proto(msg: inference_pb2.Choice) -> Choice:
    return Choice(
        index=msg.index,
        text=msg.text,
        token_ids=tuple(msg.token_ids),
        finish_reason=finish_reason_from_proto(msg.finish_reason),
        logprobs=_logprobs_from_proto(msg.logprobs),
        instance_id=msg.instance_id,
    )


def completion_to_proto(completion: Completion) -> inference_pb2.CompleteResponse:
    return inference_pb2.CompleteResponse(
        request_id=completion.request_id,
        text=completion.text,
        token_ids=completion.token_ids,
        finish_reason=finish_reason_to_proto(completion.finish_reason),
        usage=usage_to_proto(completion.usage),
        instance_id=completion.instance_id,
        choices=[choice_to_proto(c) for c in completion.choices],
        prompt_logprobs=_logprobs_to_proto(completion.prompt_logprobs),
    )


def completion_from_proto(msg: inference_pb2.CompleteResponse) -> Completion:
    """Raises ValueError when the reply has no finish_reason: a finished completion has one.
    A reply without ``choices`` (a gateway from before ``n``) gets its one choice from the
    top-level fields."""
    reason = finish_reason_from_proto(msg.finish_reason)
    if reason is None:
        raise ValueError(f"Complete reply for request {msg.request_id!r} has no finish_reason")
    choices = tuple(choice_from_proto(c) for c in msg.choices)
    for i, choice in enumerate(choices):
        if choice.index != i or choice.finish_reason is None:
            raise ValueError(
                f"Complete reply for request {msg.request_id!r}: choice {i} has index {choice.index}"
                f" and finish_reason {choice.finish_reason!r}"
            )
    return Completion(
        text=msg.text,
        token_ids=tuple(msg.token_ids),
        finish_reason=reason,
        usage=usage_from_proto(msg.usage),
        request_id=msg.request_id,
        instance_id=msg.instance_id,
        choices=choices,
        prompt_logprobs=_logprobs_from_proto(msg.prompt_logprobs),
    )


# --- admin ------------------------------------------------------------------------------------


def model_info_to_proto(model: ModelInfo) -> common_pb2.ModelInfo:
    return common_pb2.ModelInfo(
        model_id=model.model_id,
        num_layers=model.num_layers,
        size_bytes=model.size_bytes,
        max_context=model.max_context,
        vocab_size=model.vocab_size,
        dtype=model.dtype,
        created_unix_s=model.created_unix_s,
        num_parameters=model.num_parameters,
    )


def model_info_from_proto(msg: common_pb2.ModelInfo) -> ModelInfo:
    return ModelInfo(
        model_id=msg.model_id,
        num_layers=msg.num_layers,
        size_bytes=msg.size_bytes,
        max_context=msg.max_context,
        vocab_size=msg.vocab_size,
        dtype=msg.dtype,
        created_unix_s=msg.created_unix_s,
        num_parameters=msg.num_parameters,
    )


def load_report_to_proto(load: LoadReport) -> common_pb2.LoadReport:
    return common_pb2.LoadReport(
        decode_tps=load.decode_tps,
        prefill_tps=load.prefill_tps,
        ttft_p50_s=load.ttft_p50_s,
        ttft_p99_s=load.ttft_p99_s,
        tbt_p50_s=load.tbt_p50_s,
        tbt_p99_s=load.tbt_p99_s,
        running=load.running,
        waiting=load.waiting,
        waiting_prefill_tokens=load.waiting_prefill_tokens,
        kv_blocks_used=load.kv_blocks_used,
        kv_blocks_total=load.kv_blocks_total,
        tokens_generated_total=load.tokens_generated_total,
        zigzag_running=load.zigzag_running,
        zigzag_relayed_total=load.zigzag_relayed_total,
        zigzag_continued_total=load.zigzag_continued_total,
        est_tpot_s=load.est_tpot_s,
        slo_rejected_total=load.slo_rejected_total,
        preempted_total=load.preempted_total,
        prefix_hit_tokens=load.prefix_hit_tokens,
        prefix_query_tokens=load.prefix_query_tokens,
        prefill_capacity_tps=load.prefill_capacity_tps,
        esp_groups=list(load.esp_groups),
        esp_group_kv_tokens=list(load.esp_group_kv_tokens),
    )


def load_report_from_proto(msg: common_pb2.LoadReport) -> LoadReport:
    return LoadReport(
        decode_tps=msg.decode_tps,
        prefill_tps=msg.prefill_tps,
        ttft_p50_s=msg.ttft_p50_s,
        ttft_p99_s=msg.ttft_p99_s,
        tbt_p50_s=msg.tbt_p50_s,
        tbt_p99_s=msg.tbt_p99_s,
        running=msg.running,
        waiting=msg.waiting,
        waiting_prefill_tokens=msg.waiting_prefill_tokens,
        kv_blocks_used=msg.kv_blocks_used,
        kv_blocks_total=msg.kv_blocks_total,
        tokens_generated_total=msg.tokens_generated_total,
        zigzag_running=msg.zigzag_running,
        zigzag_relayed_total=msg.zigzag_relayed_total,
        zigzag_continued_total=msg.zigzag_continued_total,
        est_tpot_s=msg.est_tpot_s,
        slo_rejected_total=msg.slo_rejected_total,
        preempted_total=msg.preempted_total,
        prefix_hit_tokens=msg.prefix_hit_tokens,
        prefix_query_tokens=msg.prefix_query_tokens,
        prefill_capacity_tps=msg.prefill_capacity_tps,
        esp_groups=tuple(msg.esp_groups),
        esp_group_kv_tokens=tuple(msg.esp_group_kv_tokens),
    )


def instance_info_to_proto(info: InstanceInfo) -> common_pb2.InstanceInfo:
    return common_pb2.InstanceInfo(
        instance_id=info.instance_id,
        address=info.address,
        host=info.host,
        model_id=info.model_id,
        state=instance_state_to_proto(info.state),
        role=instance_role_to_proto(info.role),
        layers_loaded=info.layers_loaded,
        num_layers=info.num_layers,
        load=load_report_to_proto(info.load),
        dataplane_address=info.dataplane_address,
        dataplane_kind=info.dataplane_kind,
        last_heartbeat_age_s=info.last_heartbeat_age_s,
        memory_budget_bytes=info.memory_budget_bytes,
        engine=engine_info_to_proto(info.engine) if info.engine is not None else None,
    )


def instance_info_from_proto(msg: common_pb2.InstanceInfo) -> InstanceInfo:
    return InstanceInfo(
        instance_id=msg.instance_id,
        address=msg.address,
        host=msg.host,
        model_id=msg.model_id,
        state=instance_state_from_proto(msg.state),
        role=instance_role_from_proto(msg.role),
        layers_loaded=msg.layers_loaded,
        num_layers=msg.num_layers,
        load=load_report_from_proto(msg.load),
        dataplane_address=msg.dataplane_address,
        dataplane_kind=msg.dataplane_kind,
        last_heartbeat_age_s=msg.last_heartbeat_age_s,
        memory_budget_bytes=msg.memory_budget_bytes,
        engine=engine_info_from_proto(msg.engine) if msg.HasField("engine") else None,
    )


def engine_info_to_proto(e: EngineInfo) -> common_pb2.EngineInfo:
    return common_pb2.EngineInfo(
        requested_dtype=e.requested_dtype,
        dtype=e.dtype,
        dtype_reason=e.dtype_reason,
        kernel_mode=e.kernel_mode,
        isa=e.isa,
        machine_isa=e.machine_isa,
        kernels=[
            common_pb2.KernelChoice(
                op=k.op,
                impl=k.impl,
                isa=k.isa,
                reason=k.reason,
                native_ms=k.native_ms,
                torch_ms=k.torch_ms,
                speedup=k.speedup,
            )
            for k in e.kernels
        ],
        plan_cached=e.plan_cached,
        plan_measured_s=e.plan_measured_s,
    )


def engine_info_from_proto(msg: common_pb2.EngineInfo) -> EngineInfo:
    return EngineInfo(
        requested_dtype=msg.requested_dtype,
        dtype=msg.dtype,
        dtype_reason=msg.dtype_reason,
        kernel_mode=msg.kernel_mode,
        isa=msg.isa,
        machine_isa=msg.machine_isa,
        kernels=tuple(
            KernelChoice(
                op=k.op,
                impl=k.impl,
                isa=k.isa,
                reason=k.reason,
                native_ms=k.native_ms if k.HasField("native_ms") else None,
                torch_ms=k.torch_ms if k.HasField("torch_ms") else None,
                speedup=k.speedup if k.HasField("speedup") else None,
            )
            for k in msg.kernels
        ),
        plan_cached=msg.plan_cached,
        plan_measured_s=msg.plan_measured_s,
    )


def esp_group_to_proto(g: EspGroup) -> admin_pb2.EspGroupInfo:
    return admin_pb2.EspGroupInfo(
        group_id=g.group_id,
        request_id=g.request_id,
        model_id=g.model_id,
        member_ids=list(g.member_ids),
        bounds=list(g.bounds),
        spare_ids=list(g.spare_ids),
        age_s=g.age_s,
        degree=g.degree,
        holder_ids=list(g.holder_ids),
        live=g.live,
        holder_kv_tokens=list(g.holder_kv_tokens),
    )


def esp_group_from_proto(msg: admin_pb2.EspGroupInfo) -> EspGroup:
    return EspGroup(
        group_id=msg.group_id,
        request_id=msg.request_id,
        model_id=msg.model_id,
        member_ids=tuple(msg.member_ids),
        bounds=tuple(msg.bounds),
        spare_ids=tuple(msg.spare_ids),
        age_s=msg.age_s,
        holder_ids=tuple(msg.holder_ids),
        live=msg.live,
        holder_kv_tokens=tuple(msg.holder_kv_tokens),
    )


def cluster_state_to_proto(state: ClusterState) -> admin_pb2.ClusterState:
    return admin_pb2.ClusterState(
        instances=[instance_info_to_proto(i) for i in state.instances],
        models=[model_info_to_proto(m) for m in state.models],
        policy=state.policy,
        advisory=state.advisory,
        policy_params=dict(state.policy_params),
        esp_groups=[esp_group_to_proto(g) for g in state.esp_groups],
    )


def cluster_state_from_proto(msg: admin_pb2.ClusterState) -> ClusterState:
    return ClusterState(
        instances=tuple(instance_info_from_proto(i) for i in msg.instances),
        models=tuple(model_info_from_proto(m) for m in msg.models),
        policy=msg.policy,
        advisory=msg.advisory,
        policy_params=dict(msg.policy_params),
        esp_groups=tuple(esp_group_from_proto(g) for g in msg.esp_groups),
    )


def cluster_event_to_proto(event: ClusterEvent) -> admin_pb2.ClusterEvent:
    return admin_pb2.ClusterEvent(
        time_s=event.time_s,
        action=event.action,
        target=event.target,
        status=event.status,
        reason=event.reason,
        instance_id=event.instance_id,
    )


def cluster_event_from_proto(msg: admin_pb2.ClusterEvent) -> ClusterEvent:
    return ClusterEvent(
        time_s=msg.time_s,
        action=msg.action,
        target=msg.target,
        status=msg.status,
        reason=msg.reason,
        instance_id=msg.instance_id,
    )


def scale_result_to_proto(result: ScaleResult) -> admin_pb2.ScaleResponse:
    return admin_pb2.ScaleResponse(instance_ids=result.instance_ids, reason=result.reason)


def scale_result_from_proto(msg: admin_pb2.ScaleResponse) -> ScaleResult:
    return ScaleResult(instance_ids=tuple(msg.instance_ids), reason=msg.reason)


def policy_params_to_proto(params: Mapping[str, str | int | float | bool]) -> dict[str, str]:
    """Policy parameters travel as strings; numbers are formatted with ``str`` and booleans as
    ``"true"``/``"false"`` (``str(True)`` would give ``"True"``, which parsers on the manager side
    need not accept)."""
    out: dict[str, str] = {}
    for key, value in params.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"policy parameter names must be non-empty strings, got {key!r}")
        if isinstance(value, bool):
            out[key] = "true" if value else "false"
        elif isinstance(value, (str, int, float)):
            out[key] = str(value)
        else:
            raise ValueError(f"policy parameter {key!r} must be a str, int, float or bool, got {value!r}")
    return out


def policy_state_to_proto(state: PolicyState) -> admin_pb2.SetPolicyResponse:
    return admin_pb2.SetPolicyResponse(policy=state.policy, params=dict(state.params), advisory=state.advisory)


def policy_state_from_proto(msg: admin_pb2.SetPolicyResponse) -> PolicyState:
    return PolicyState(policy=msg.policy, params=dict(msg.params), advisory=msg.advisory)
