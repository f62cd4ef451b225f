"""Borrowed prefill through a whole in-process mesh: a slow (emulated) prefill worker and a fast
decode worker. Requests sent one at a time take the ordinary P/D path (prompt on the prefill
worker, KV handed to the decode worker); a burst backlogs the prefill worker, and the manager
then lends the decode worker, which runs requests whole. Every burst request, borrowed or paired,
gives exactly the greedy and seeded tokens of the P/D path, and none is lost."""

from __future__ import annotations

import asyncio
import functools
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

import blitzmesh
from services.common.waiting import wait_until
from tests.integration.mini_mesh import MODEL, mini_mesh

pytestmark = pytest.mark.timeout(180)

# Prompts of 40 to 75 tokens: at the emulated 0.25 s + 4 ms per token a step of one takes about
# 0.5 s, so the prefill worker measures about 120 prompt tokens per second, and two of them
# queued are a backlog above the 0.3 s threshold below.
PROMPTS = [[(7 * i + j) % 150 + 3 for j in range(40 + 5 * i)] for i in range(8)]
SAMPLING: list[dict[str, Any]] = [{"temperature": 0.0}, {"temperature": 0.9, "seed": 11}]


def schedules(outcome: str) -> float:
    return REGISTRY.get_sample_value("blitzmesh_gm_schedule_total", {"outcome": outcome}) or 0.0


async def test_borrowed_requests_give_the_pd_paths_greedy_and_seeded_tokens(
    tiny_models: Path, serve_in_process: Any
) -> None:
    slow = {"step_time_a_s": 0.25, "step_time_b_s": 0.004}
    async with (
        mini_mesh(
            tiny_models,
            serve_in_process,
            workers={"p-0": {"role": "prefill", **slow}, "d-0": {"role": "decode"}},
            manager={"heartbeat_interval_s": 0.2, "borrow_prefill_wait_s": 0.3},
        ) as mesh,
        blitzmesh.AsyncClient(mesh.grpc_address, timeout_s=90) as client,
    ):

        async def ask(prompt: list[int], sampling: dict[str, Any]) -> tuple[int, ...]:
            done = await client.complete(
                prompt_token_ids=prompt, model=MODEL, max_tokens=12, ignore_eos=True, return_token_ids=True, **sampling
            )
            assert done.choices[0].finish_reason == "length"
            return tuple(done.choices[0].token_ids)

        async def reported_idle(since: float) -> bool:
            """The manager holds a heartbeat of the prefill worker from after `since`, with no
            request on it: the next route sees no queue there."""
            (p0,) = [i for i in (await client.cluster()).instances if i.instance_id == "p-0"]
            fresh = p0.last_heartbeat_age_s < time.monotonic() - since
            return fresh and p0.load.running + p0.load.waiting == 0 and p0.load.waiting_prefill_tokens == 0

        cases = [(p, s) for p in PROMPTS for s in SAMPLING]
        before = {o: schedules(o) for o in ("pd_pair", "borrowed")}
        # One at a time, each once the manager has seen the prefill worker idle: no backlog, every
        # request on the P/D path (the reference).
        alone = []
        for p, s in cases:
            alone.append(await ask(p, s))
            done_at = time.monotonic()
            await wait_until(functools.partial(reported_idle, done_at), 20, interval_s=0.05, what="p-0 reported idle")
        middle = {o: schedules(o) for o in ("pd_pair", "borrowed")}
        # All at once: the prefill worker's queue grows past the threshold and the decode worker lends.
        burst = await asyncio.gather(*(ask(p, s) for p, s in cases))
        after = {o: schedules(o) for o in ("pd_pair", "borrowed")}

    assert middle["pd_pair"] - before["pd_pair"] == len(cases)
    assert middle["borrowed"] == before["borrowed"]
    borrowed = after["borrowed"] - middle["borrowed"]
    paired = after["pd_pair"] - middle["pd_pair"]
    assert borrowed >= 1 and paired >= 1 and borrowed + paired == len(cases), (borrowed, paired)
    assert all(len(tokens) == 12 for tokens in alone)
    assert list(burst) == alone
    # The seeded samples differ from the greedy ones (so the seed is what made them equal).
    assert any(alone[i] != alone[i + 1] for i in range(0, len(cases), 2))
