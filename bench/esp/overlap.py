"""How much of an ESP group's K/V exchange the prefill hides behind its compute (MEASURED).

Two group members, each in its own process with one compute thread (an "accelerator" each),
prefill one prompt cut in two over the TCP data plane, in rounds that alternate:
- `plain`: the members linked over loopback, where the exchange is all but free: the group's
  compute time C (the later member's, which attends to both slices, is the critical path);
- `shaped`: the same over an emulated link (services/dataplane/shaped.py) whose rate makes the
  first member's K/V, every layer of it, take as long to cross as C: the transfer time T = C.

Run one after the other the prefill would take C + T; hidden entirely, max(C, T) = C. The figure
is `hidden = (C + T - G) / T` for the shaped group's time G: 0 when nothing overlaps, 1 when all
of the exchange is hidden. Every round's logits are checked against one instance's.
The simulator's ESP cost model (bench/simulate/esp.py `core_models`) charges the exchange as
overlapped with the attention on the strength of this figure.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

PRESET = "small"


def _member(path: str, j: int, prompt: list[int], bounds: list[int], conn: Any) -> None:
    """One member: builds transports and runs prefills on the parent's commands."""
    import torch

    from services.dataplane import make_transport
    from services.dataplane.shaped import ShapedTransport
    from services.worker.engine.kv_cache import KVCache
    from services.worker.esp_exchange import connect_group, prefill_member
    from services.worker.model.llama import load_model

    torch.set_num_threads(1)
    model = load_model(path)
    cache = KVCache.for_model(model.config, num_blocks=len(prompt) // 16 + 2, block_size=16, dtype=model.dtype)

    async def run() -> None:
        transports: dict[str, Any] = {}
        try:
            while True:
                cmd = await asyncio.to_thread(conn.recv)
                if cmd[0] == "stop":
                    conn.send("stopped")
                    return
                if cmd[0] == "listen":  # ("listen", name, link_gbps or 0)
                    _, name, gbps = cmd
                    t = make_transport("tcp")
                    transports[name] = ShapedTransport(t, gbps, per_peer=True) if gbps else t
                    await transports[name].start()
                    conn.send(transports[name].address())
                elif cmd[0] == "run":  # ("run", name, addresses, group id)
                    _, name, addresses, group = cmd
                    links = await connect_group(transports[name], j, addresses, group, timeout_s=120)
                    t0 = time.monotonic()
                    logits = await prefill_member(model, cache, links, "r", prompt, bounds, timeout_s=120)
                    elapsed = time.monotonic() - t0
                    await links.close()
                    cache.free("r")
                    conn.send((elapsed, None if logits is None else logits.tolist()))
        finally:
            for t in transports.values():
                await t.close()

    asyncio.run(run())


def measure(quick: bool, members: int = 2) -> dict[str, Any]:
    import torch

    from services.model_format.synth import synthesize
    from services.worker.model.llama import load_model

    tokens = 1024 if quick else 1536
    rounds = 3 if quick else 5
    with tempfile.TemporaryDirectory(prefix="bench-esp-overlap-") as tmp:
        path = str(synthesize(Path(tmp) / PRESET, PRESET, seed=0))
        model = load_model(path)
        cfg = model.config
        prompt = torch.randint(3, cfg.vocab_size, (tokens,), generator=torch.Generator().manual_seed(0)).tolist()
        bounds = [tokens * j // members for j in range(members + 1)]
        with torch.inference_mode():
            whole = model.forward(torch.tensor(prompt))[-1]
        kv_bytes = (
            2 * cfg.num_hidden_layers * (bounds[1] - bounds[0]) * cfg.num_key_value_heads * cfg.head_dim
        ) * torch.empty((), dtype=model.dtype).element_size()
        del model
        ctx = multiprocessing.get_context("spawn")
        pipes = [ctx.Pipe() for _ in range(members)]
        procs = [
            ctx.Process(target=_member, args=(path, j, prompt, bounds, pipes[j][1]), daemon=True)
            for j in range(members)
        ]
        for p in procs:
            p.start()
        conns = [parent for parent, _ in pipes]
        group = iter(range(1_000_000))

        def call(cmd_for: Any, timeout_s: float = 300) -> list[Any]:
            for j, c in enumerate(conns):
                c.send(cmd_for(j))
            out = []
            for c in conns:
                if not c.poll(timeout_s):
                    raise TimeoutError(f"a group member did not answer {cmd_for(0)[0]!r} within {timeout_s} s")
                out.append(c.recv())
            return out

        def prefill(name: str, addresses: list[str]) -> tuple[float, bool]:
            g = f"overlap-{next(group)}"
            done = call(lambda j: ("run", name, addresses, g))
            logits = done[-1][1]
            exact = bool(torch.allclose(torch.tensor(logits), whole, atol=1e-4, rtol=1e-4))
            return max(t for t, _ in done), exact

        try:
            plain = call(lambda j: ("listen", "plain", 0))
            prefill("plain", plain)  # warm-up: first-touch allocations, thread start
            compute = statistics.median(prefill("plain", plain)[0] for _ in range(2))
            gbps = kv_bytes * 8 / compute / 1e9
            transfer = compute  # the link's rate was chosen so: T = C
            shaped = call(lambda j: ("listen", "shaped", gbps))
            rows: list[dict[str, Any]] = []
            for _ in range(rounds):
                c, c_exact = prefill("plain", plain)
                g, g_exact = prefill("shaped", shaped)
                rows.append(
                    {
                        "compute_s": round(c, 4),
                        "transfer_s": round(transfer, 4),
                        "shaped_s": round(g, 4),
                        "hidden": round((c + transfer - g) / transfer, 3),
                        "exact": c_exact and g_exact,
                    }
                )
            call(lambda j: ("stop",), timeout_s=30)
        finally:
            for p in procs:
                p.join(10)
                if p.is_alive():
                    p.kill()
    return {
        "how": (
            "MEASURED: 2 member processes (one compute thread each) on the shared 2-core box, TCP data "
            "plane; the shaped link is emulated (services/dataplane/shaped.py) at the rate where the "
            "first member's K/V takes as long to cross as the group's compute"
        ),
        "model": PRESET,
        "prompt_tokens": tokens,
        "bounds": bounds,
        "kv_bytes_per_link": kv_bytes,
        "link_gbps": round(gbps, 4),
        "rounds": rows,
        "hidden_median": statistics.median(r["hidden"] for r in rows),
        "shaped_over_compute_median": round(statistics.median(r["shaped_s"] / r["compute_s"] for r in rows), 3),
        "exact": all(r["exact"] for r in rows),
    }
