"""Argument validation of the SDK clients: bad calls fail with ValueError before any I/O."""

from __future__ import annotations

import threading

import pytest

import blitzmesh
from blitzmesh import AsyncClient, Client

pytestmark = [pytest.mark.timeout(10), pytest.mark.filterwarnings("error")]

# Nothing listens here; every test must fail before a connection is even attempted.
NOWHERE = "127.0.0.1:9"


@pytest.mark.parametrize(
    ("kwargs", "quoted"),
    [
        ({}, "got none"),
        (
            {"prompt": "hi", "messages": [{"role": "user", "content": "x"}]},
            "prompt='hi', messages=[{",
        ),
        ({"prompt": "hi", "prompt_token_ids": [1, 2]}, "prompt_token_ids=[1, 2]"),
        ({"prompt": ""}, "prompt must be a non-empty string, got ''"),
        ({"messages": []}, "got []"),
        ({"messages": "hello"}, "got 'hello'"),
        ({"messages": [{"role": "user"}]}, "{'role': 'user'}"),
        ({"messages": [{"role": "", "content": "x"}]}, "'role': ''"),
        ({"prompt_token_ids": []}, "got []"),
        ({"prompt_token_ids": [1, -5]}, "got -5 in [1, -5]"),
        ({"prompt": "hi", "model": ""}, "model must be a non-empty string, got ''"),
        ({"prompt": "hi", "max_tokens": 0}, "got 0"),
        ({"prompt": "hi", "temperature": -1.0}, "got -1.0"),
        ({"prompt": "hi", "stop": [""]}, "('',)"),
        ({"prompt": "hi", "timeout_s": 0}, "got 0"),
        ({"prompt": "hi", "request_id": ""}, "request_id must be a non-empty string"),
        ({"prompt": "hi", "n": 0}, "got 0"),
        ({"prompt": "hi", "n": 129}, "got 129"),
        ({"prompt": "hi", "n": True}, "got True"),
        ({"prompt": "hi", "echo": 1}, "got 1"),
        ({"messages": [{"role": "user", "content": "x"}], "echo": True}, "echo=True needs a prompt"),
        ({"prompt": "hi", "logprobs": 21}, "got 21"),
        ({"prompt": "hi", "prompt_logprobs": -1}, "got -1"),
        ({"prompt": "hi", "presence_penalty": 2.5}, "got 2.5"),
        ({"prompt": "hi", "frequency_penalty": float("nan")}, "got nan"),
        ({"prompt": "hi", "repetition_penalty": 0.0}, "got 0.0"),
        ({"prompt": "hi", "logit_bias": {5: 101}}, "got 101"),
        ({"prompt": "hi", "logit_bias": {-5: 1}}, "got -5"),
    ],
)
async def test_generate_and_complete_reject_bad_arguments_quoting_them(kwargs, quoted):
    kwargs = {"model": "m", **kwargs}
    client = AsyncClient(NOWHERE)
    with pytest.raises(ValueError) as info:
        client.generate(**kwargs)  # raises at the call, not at the first iteration
    assert quoted in str(info.value)
    with pytest.raises(ValueError) as info:
        await client.complete(**kwargs)
    assert quoted in str(info.value)
    await client.close()


def test_long_values_are_abbreviated_in_errors():
    with pytest.raises(ValueError) as info:
        AsyncClient(NOWHERE).generate("x" * 100_000, prompt_token_ids=[1], model="m")
    assert len(str(info.value)) < 300


@pytest.mark.parametrize(
    ("kwargs", "quoted"),
    [
        ({"target": ""}, "got ''"),
        ({"timeout_s": -1}, "got -1"),
        ({"max_retries": -1}, "got -1"),
        ({"max_retries": 1.5}, "got 1.5"),
        ({"retry_backoff_s": -0.1}, "got -0.1"),
    ],
)
def test_constructors_reject_bad_arguments(kwargs, quoted):
    for cls in (AsyncClient, Client):
        with pytest.raises(ValueError) as info:
            cls(**kwargs)
        assert quoted in str(info.value)


def test_bad_api_key_error_does_not_leak_the_key():
    with pytest.raises(ValueError) as info:
        AsyncClient(NOWHERE, api_key=" sk-secret-123 ")
    assert "sk-secret" not in str(info.value)
    assert "length 15" in str(info.value)


async def test_admin_calls_reject_bad_arguments():
    async with AsyncClient(NOWHERE) as client:
        with pytest.raises(ValueError, match="got 0"):
            await client.scale("m", 0)
        with pytest.raises(ValueError, match="'big'"):
            await client.scale("m", 1, role="big")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="got ''"):
            await client.set_policy("")
        with pytest.raises(ValueError, match=r"\{1\}"):
            await client.set_policy("latency", {"slo": {1}})  # type: ignore[dict-item]
        with pytest.raises(ValueError, match="got 'yes'"):
            await client.set_policy("latency", advisory="yes")  # type: ignore[arg-type]


def test_sync_client_rejects_bad_constructor_args_without_starting_a_thread():
    before = threading.active_count()
    with pytest.raises(ValueError):
        Client(NOWHERE, timeout_s=0)
    assert threading.active_count() == before


def test_sync_client_validates_in_the_callers_thread_and_stops_on_close():
    before = threading.active_count()
    client = Client(NOWHERE)
    with pytest.raises(ValueError, match="got none"):
        client.generate(model="m")
    with pytest.raises(ValueError, match="got none"):
        client.complete(model="m")
    client.close()
    client.close()  # idempotent
    assert threading.active_count() == before
    with pytest.raises(RuntimeError, match="closed"):
        client.list_models()


async def test_closed_async_client_refuses_calls():
    client = AsyncClient(NOWHERE)
    await client.close()
    with pytest.raises(RuntimeError, match="closed"):
        await client.cluster()


def test_public_names_are_exported_and_free_of_protobuf():
    for name in blitzmesh.__all__:
        obj = getattr(blitzmesh, name)
        assert "_pb2" not in getattr(obj, "__module__", ""), name
