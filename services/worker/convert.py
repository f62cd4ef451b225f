"""Converters between the worker's wire messages and the engine's types.

The one place where `common_pb2.SamplingParams` meets the engine's `SamplingParams`, where the
engine's log-probs become `TokenLogprob` messages, and where a KV transfer's `KVDescriptor` becomes
a `KVTransferDescriptor`. Unset optional fields take the engine's
defaults; the round-trip tests in tests/unit/test_worker_convert.py pin both directions.
"""

from __future__ import annotations

from collections.abc import Sequence

from blitzmesh.v1 import common_pb2, kv_pb2
from services.worker.engine.sampling import PromptLogprob, SamplingParams, TopLogprobs
from services.worker.engine.slo import RequestSLO
from services.worker.kv_transfer import KVDescriptor


def sampling_from_proto(msg: common_pb2.SamplingParams, default_max_tokens: int) -> SamplingParams:
    """Raises ValueError (quoting the value) for an out-of-range field: the worker re-validates
    what the gateway already checked. Stop strings are the gateway's business and are ignored."""
    defaults = SamplingParams()
    return SamplingParams(
        temperature=msg.temperature if msg.HasField("temperature") else defaults.temperature,
        top_p=msg.top_p if msg.HasField("top_p") else defaults.top_p,
        top_k=msg.top_k if msg.HasField("top_k") else defaults.top_k,
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else default_max_tokens,
        stop_token_ids=tuple(msg.stop_token_ids),
        seed=msg.seed if msg.HasField("seed") else None,
        ignore_eos=msg.ignore_eos,
        presence_penalty=msg.presence_penalty if msg.HasField("presence_penalty") else defaults.presence_penalty,
        frequency_penalty=msg.frequency_penalty if msg.HasField("frequency_penalty") else defaults.frequency_penalty,
        repetition_penalty=(
            msg.repetition_penalty if msg.HasField("repetition_penalty") else defaults.repetition_penalty
        ),
        logit_bias=dict(msg.logit_bias),
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
    )


def slo_from_proto(msg: common_pb2.RequestSLO) -> RequestSLO | None:
    """The request's latency objectives for the engine; None when it has none. Raises
    ValueError (quoting the value) for one that is not a positive finite number of seconds."""
    slo = RequestSLO(
        ttft_s=msg.ttft_s if msg.HasField("ttft_s") else None,
        tpot_s=msg.tpot_s if msg.HasField("tpot_s") else None,
    )
    return None if slo.is_empty else slo


def slo_to_proto(slo: RequestSLO | None) -> common_pb2.RequestSLO:
    msg = common_pb2.RequestSLO()
    if slo is not None and slo.ttft_s is not None:
        msg.ttft_s = slo.ttft_s
    if slo is not None and slo.tpot_s is not None:
        msg.tpot_s = slo.tpot_s
    return msg


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    """Every field is written (the engine type has no "unset"), so the worker reads back exactly
    these values; temperature, top_p and the penalties travel as float32."""
    msg = common_pb2.SamplingParams(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        max_tokens=params.max_tokens,
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        logit_bias=dict(params.logit_bias),
    )
    if params.seed is not None:
        msg.seed = params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    if params.prompt_logprobs is not None:
        msg.prompt_logprobs = params.prompt_logprobs
    return msg


def token_logprob_to_proto(token_id: int, logprob: float | None, top: TopLogprobs) -> common_pb2.TokenLogprob:
    msg = common_pb2.TokenLogprob(
        token_id=token_id, top_logprobs=[common_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in top]
    )
    if logprob is not None:
        msg.logprob = logprob
    return msg


def prompt_logprobs_to_proto(entries: Sequence[PromptLogprob]) -> list[common_pb2.TokenLogprob]:
    return [token_logprob_to_proto(e.token_id, e.logprob, e.top) for e in entries]


def prompt_logprobs_from_proto(msgs: Sequence[common_pb2.TokenLogprob]) -> list[PromptLogprob]:
    """The inverse of `prompt_logprobs_to_proto` (used by tests and tools reading worker streams)."""
    return [
        PromptLogprob(
            m.token_id,
            m.logprob if m.HasField("logprob") else None,
            tuple((t.token_id, t.logprob) for t in m.top_logprobs),
        )
        for m in msgs
    ]


def kv_descriptor_to_proto(d: KVDescriptor) -> kv_pb2.KVTransferDescriptor:
    return kv_pb2.KVTransferDescriptor(
        transfer_id=d.transfer_id,
        request_id=d.request_id,
        model_id=d.model_id,
        layer_start=d.layer_start,
        layer_end=d.layer_end,
        num_tokens=d.num_tokens,
        block_size=d.block_size,
        num_kv_heads=d.num_kv_heads,
        head_dim=d.head_dim,
        dtype=d.dtype,
        producer_address=d.producer_address,
        size_bytes=d.size_bytes,
    )


def kv_descriptor_from_proto(msg: kv_pb2.KVTransferDescriptor) -> KVDescriptor:
    """Raises ValueError (quoting the field) for a descriptor no transfer could follow."""
    for name in ("transfer_id", "model_id", "dtype", "producer_address"):
        if not getattr(msg, name):
            raise ValueError(f"KVTransferDescriptor.{name} is empty")
    for name in ("num_tokens", "block_size", "num_kv_heads", "head_dim", "size_bytes"):
        if getattr(msg, name) < 1:
            raise ValueError(f"KVTransferDescriptor.{name} must be >= 1, got {getattr(msg, name)}")
    if msg.layer_end <= msg.layer_start:
        raise ValueError(f"KVTransferDescriptor layer range [{msg.layer_start}, {msg.layer_end}) is empty")
    return KVDescriptor(
        transfer_id=msg.transfer_id,
        request_id=msg.request_id,
        model_id=msg.model_id,
        layer_start=msg.layer_start,
        layer_end=msg.layer_end,
        num_tokens=msg.num_tokens,
        block_size=msg.block_size,
        num_kv_heads=msg.num_kv_heads,
        head_dim=msg.head_dim,
        dtype=msg.dtype,
        producer_address=bytes(msg.producer_address),
        size_bytes=msg.size_bytes,
    )
