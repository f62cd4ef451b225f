"""The worker's converters: SamplingParams and log-probs between the wire and the engine."""

from __future__ import annotations

import pytest

from blitzmesh import convert as public
from blitzmesh import types
from blitzmesh.v1 import common_pb2
from services.worker.convert import (
    prompt_logprobs_from_proto,
    prompt_logprobs_to_proto,
    sampling_from_proto,
    sampling_to_proto,
    token_logprob_to_proto,
)
from services.worker.engine.sampling import PromptLogprob, SamplingParams

# Values float32 holds exactly, so the round trip is exact.
FULL = SamplingParams(
    temperature=0.5,
    top_p=0.75,
    top_k=40,
    max_tokens=33,
    stop_token_ids=(2, 9),
    seed=-(2**62),
    ignore_eos=True,
    presence_penalty=-1.5,
    frequency_penalty=0.25,
    repetition_penalty=1.125,
    logit_bias={5: -100.0, 17: 2.5},
    logprobs=20,
    prompt_logprobs=0,
)


@pytest.mark.parametrize(
    "params",
    [FULL, SamplingParams(), SamplingParams(temperature=0, max_tokens=1, logprobs=0)],
    ids=["every-field", "defaults", "greedy"],
)
def test_engine_sampling_round_trips(params: SamplingParams) -> None:
    msg = sampling_to_proto(params)
    assert sampling_from_proto(msg, default_max_tokens=999) == params
    # And through bytes, as it travels.
    again = common_pb2.SamplingParams.FromString(msg.SerializeToString())
    assert sampling_from_proto(again, default_max_tokens=999) == params


def test_unset_fields_take_the_engine_defaults() -> None:
    params = sampling_from_proto(common_pb2.SamplingParams(), default_max_tokens=12)
    assert params == SamplingParams(max_tokens=12)
    assert params.logprobs is None and params.prompt_logprobs is None and not params.processes_logits
    # 0 is a value, not "unset": greedy, and the chosen token's log-prob without alternatives.
    zero = sampling_from_proto(common_pb2.SamplingParams(temperature=0.0, logprobs=0), default_max_tokens=1)
    assert zero.greedy and zero.logprobs == 0


@pytest.mark.parametrize(
    ("msg", "quoted"),
    [
        (common_pb2.SamplingParams(presence_penalty=3.0), "3.0"),
        (common_pb2.SamplingParams(repetition_penalty=-1.0), "-1.0"),
        (common_pb2.SamplingParams(logit_bias={4: 250.0}), "250.0"),
        (common_pb2.SamplingParams(logit_bias={-4: 1.0}), "-4"),
        (common_pb2.SamplingParams(logprobs=21), "21"),
        (common_pb2.SamplingParams(top_p=0.0), "0.0"),
    ],
)
def test_the_worker_re_validates(msg: common_pb2.SamplingParams, quoted: str) -> None:
    with pytest.raises(ValueError, match=quoted):
        sampling_from_proto(msg, default_max_tokens=4)


def test_logprobs_round_trip() -> None:
    entries = [PromptLogprob(1, None), PromptLogprob(7, -0.5, ((7, -0.5), (3, -1.25))), PromptLogprob(9, -3.0, ())]
    msgs = prompt_logprobs_to_proto(entries)
    assert not msgs[0].HasField("logprob") and msgs[1].HasField("logprob")
    assert prompt_logprobs_from_proto(msgs) == entries
    one = token_logprob_to_proto(4, -0.25, ((4, -0.25),))
    assert (one.token_id, one.logprob, [(t.token_id, t.logprob) for t in one.top_logprobs]) == (4, -0.25, [(4, -0.25)])


def test_a_public_request_reaches_the_engine_unchanged() -> None:
    """The gateway writes the SDK type with the SDK's converter; the worker reads it with its own."""
    sent = types.SamplingParams(
        temperature=0.5,
        top_p=0.75,
        top_k=40,
        max_tokens=33,
        seed=-5,
        stop_token_ids=(2, 9),
        ignore_eos=True,
        presence_penalty=-1.5,
        frequency_penalty=0.25,
        repetition_penalty=1.125,
        logit_bias={5: -100.0, 6: 0.5},
        logprobs=3,
        prompt_logprobs=1,
    )
    got = sampling_from_proto(public.sampling_to_proto(sent), default_max_tokens=1)
    for name in (
        "temperature",
        "top_p",
        "top_k",
        "max_tokens",
        "seed",
        "stop_token_ids",
        "ignore_eos",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "logit_bias",
        "logprobs",
        "prompt_logprobs",
    ):
        assert getattr(got, name) == getattr(sent, name), name
