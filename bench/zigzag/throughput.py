"""ZigZag throughput while loading: a full instance alone against the pair it forms with a new
instance that holds only its first k of L layers (docs/algorithms.md 3).

Usage:
    python -m bench.zigzag.throughput [--quick] [--out bench/results/zigzag_throughput.json]

Two engines in this process, each with its own TCP data-plane transport, as two workers have:
the old one complete, the new one holding embed + layers [0, k). A burst of N prefill requests
(one token each, P-token prompts) is served (a) by the old engine alone, (b) split: every
request runs its first layers on the new engine and is relayed over the data plane (the KV of
those layers and the hidden states) to the old one, which runs the rest and samples. The old
engine takes a relayed request when it has nothing else waiting, so the new engine works ahead
on the next ones (BlitzScale's pipelining). Both engines run with EMULATED accelerator pacing
(a step lasts a + b * tokens x (layers run / L)), one prompt per step, so the figures follow
what an accelerator would do, not this CPU. Reported per k: requests/s alone and split, their
ratio, and the ratio the layer-level model predicts, (a + bP) / max(a + bP(L-k')/L, a + bPk'/L)
with k' = min(k, L/2): with a = 0 that is 1 at k = 0, L/(L-1) at k = 1 and 2 from k = L/2 on
(the paper's 1/7 -> 1/6 -> 2/7 for L = 7). Alone and split runs alternate, best of the rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from services.dataplane import make_transport
from services.dataplane.chain import GroupServer
from services.dataplane.transport import Transport
from services.model_format import synth
from services.model_format.checkpoint import Checkpoint
from services.worker.engine.engine import Engine, EngineConfig, KVBlocks, PacingProfile, Relayed
from services.worker.engine.sampling import SamplingParams
from services.worker.kv_transfer import KVServer, KVTransferConfig
from services.worker.model.llama import LlamaForCausalLM
from services.worker.zigzag import RelayServer, take_over

NUM_LAYERS = 8
PROMPT_TOKENS = 192
STEP_A_S = 0.004
STEP_B_S = 0.0004
MODEL = "tiny8"
PARAMS = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def model_of(path: Path, layers: int | None) -> LlamaForCausalLM:
    ckpt = Checkpoint(path)
    model = LlamaForCausalLM(ckpt.config)
    groups = None if layers is None else ["embed", *(f"layers.{i}" for i in range(layers))]
    model.load_groups(ckpt.iter_groups(groups))
    return model


def engine_of(model: LlamaForCausalLM) -> Engine:
    cfg = EngineConfig(
        max_batch_size=8,
        max_num_tokens=PROMPT_TOKENS,
        num_kv_blocks=512,
        num_threads=1,
        pacing=PacingProfile(base_s=STEP_A_S, per_token_s=STEP_B_S),
    )
    return Engine.create(model, [2], cfg)


def predicted(k: int) -> float:
    """The layer-level model: the pair splits at k' = min(k, L/2) (past L/2 the old instance takes
    requests over before the new one has run all it holds), so the slower side costs
    max(L - k', k') layers of a step."""
    split = min(k, NUM_LAYERS / 2)
    whole = STEP_A_S + STEP_B_S * PROMPT_TOKENS
    old = STEP_A_S + STEP_B_S * PROMPT_TOKENS * (NUM_LAYERS - split) / NUM_LAYERS
    new = STEP_A_S + STEP_B_S * PROMPT_TOKENS * split / NUM_LAYERS
    return whole / max(old, new)


def prompts(n: int, round_: int) -> list[list[int]]:
    return [[1, *((7 * i + 13 * j + round_) % 2000 + 3 for j in range(PROMPT_TOKENS - 1))] for i in range(n)]


async def alone(old: Engine, batch: list[list[int]], tag: str) -> float:
    t0 = time.perf_counter()
    await asyncio.gather(*(_drain(old.generate(f"{tag}-{i}", p, PARAMS)) for i, p in enumerate(batch)))
    return len(batch) / (time.perf_counter() - t0)


async def split(
    new: Engine, old: Engine, new_t: Transport, old_t: Transport, batch: list[list[int]], tag: str
) -> tuple[float, int]:
    config = KVTransferConfig()

    def relay(rid: str):
        async def fill(blocks: KVBlocks) -> Relayed:
            return await take_over(old_t, new_t.address(), rid, old.kv_cache, blocks, model_id=MODEL, config=config)

        return fill

    t0 = time.perf_counter()
    firsts = [_drain(new.generate(f"{tag}-{i}", p, PARAMS, zigzag=True)) for i, p in enumerate(batch)]
    rests = [_drain(old.generate(f"{tag}-{i}", p, PARAMS, relay_fill=relay(f"{tag}-{i}"))) for i, p in enumerate(batch)]
    layers = await asyncio.gather(*rests, *firsts)
    rps = len(batch) / (time.perf_counter() - t0)
    return rps, sum(1 for n in layers[len(batch) :] if n)


async def _drain(stream: Any) -> int:
    """Consume a stream; the ZigZag layers its last event reports (0 for an ordinary one)."""
    last = None
    async for ev in stream:
        last = ev
    return (last.zigzag_layers or 0) if last is not None else 0


async def measure(path: Path, ks: list[int], n: int, rounds: int) -> dict[str, Any]:
    old = engine_of(model_of(path, None))
    await old.start()
    old_t = make_transport("tcp", host="127.0.0.1")
    await old_t.start()
    out: dict[str, Any] = {}
    try:
        for k in ks:
            new = engine_of(model_of(path, k))
            await new.start(partial=True)
            new_t = make_transport("tcp", host="127.0.0.1")
            await new_t.start()
            server = GroupServer(new_t)
            await server.start()
            kv_server = KVServer(server, new.kv_cache, model_id=MODEL)
            releases: set[asyncio.Task[None]] = set()

            def offer_parked(
                parked: str, num_tokens: int, layers: tuple[int, int], new: Engine = new, kv=kv_server, held=releases
            ):
                offer = kv.offer(parked, num_tokens=num_tokens, layers=layers)

                async def release() -> None:
                    with contextlib.suppress(Exception):
                        await offer.wait()
                    new.release_parked(parked)

                task = asyncio.get_running_loop().create_task(release())
                held.add(task)
                task.add_done_callback(held.discard)
                return offer

            RelayServer(server, new, model_id=MODEL, offer_parked=offer_parked)
            a, b, relayed = [], [], []
            try:
                for r in range(rounds):
                    batch = prompts(n, r)
                    order = ("alone", "split") if r % 2 == 0 else ("split", "alone")
                    for what in order:
                        if what == "alone":
                            a.append(await alone(old, batch, f"a{k}-{r}"))
                        else:
                            rps, ran = await split(new, old, new_t, old_t, batch, f"s{k}-{r}")
                            b.append(rps)
                            relayed.append(ran)
            finally:
                await asyncio.gather(*releases, return_exceptions=True)
                await server.close()
                await new_t.close()
                await new.stop()
            best_a, best_b = max(a), max(b)
            out[f"k={k}"] = {
                "alone_rps": round(best_a, 2),
                "split_rps": round(best_b, 2),
                "split_over_alone": round(best_b / best_a, 3),
                "predicted": round(predicted(k), 3),
                "measured_over_predicted": round(best_b / best_a / predicted(k), 3),
                "requests_with_layers_run_on_new": relayed,
                "rounds_alone_rps": [round(x, 2) for x in a],
                "rounds_split_rps": [round(x, 2) for x in b],
            }
            print(f"k={k}/{NUM_LAYERS}: {json.dumps(out[f'k={k}'])}", flush=True)
    finally:
        await old.stop()
        await old_t.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.zigzag.throughput", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests and rounds")
    parser.add_argument("--out", type=Path, default=Path("bench/results/zigzag_throughput.json"))
    args = parser.parse_args(argv)
    n, rounds = (12, 2) if args.quick else (24, 4)
    ks = [1, 2, 4, 6]
    with tempfile.TemporaryDirectory() as tmp:
        path = synth.synthesize(Path(tmp) / MODEL, "tiny", seed=0, overrides={"num_hidden_layers": NUM_LAYERS})
        results = asyncio.run(measure(path, ks, n, rounds))
    result = {
        "by_k": results,
        "setup": {
            "num_layers": NUM_LAYERS,
            "prompt_tokens": PROMPT_TOKENS,
            "requests": n,
            "rounds": rounds,
            "pacing": {"emulated": True, "step_a_s": STEP_A_S, "step_b_s_per_token": STEP_B_S},
            "transport": "tcp (two transports in one process)",
            "model": f"tiny with {NUM_LAYERS} layers (synthetic)",
        },
        "machine": {"cpus": 2, "python": sys.version.split()[0], "platform": platform.platform()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
