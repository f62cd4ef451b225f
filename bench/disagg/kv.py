"""Part "kv_transfer": a request's KV cache between two worker-like processes against the bare transport.

Two KV nodes (tests.harness.kv_nodes: separate processes, each with its transport, group
server and paged KV cache) per transport kind. The producer holds one request of `num_tokens`
tokens in the layout of the real default model (SmolLM2-135M: 30 layers, 3 KV heads of 64, float32,
16-token blocks), filled with random values. Rounds alternate, A B A B:

- A, kv_transfer: the producer offers the request, the consumer pulls it with `receive_kv` into
  blocks of its own cache (connect, request, every message straight into its block slots, a
  checksum per message on both sides, the consumer's "done") and frees it again.
- B, transport: the same number of messages of the same sizes between the same two processes,
  through the transport alone (same request/response turns, same window, no KV addressing, no
  checksum), from one flat buffer into another.

Variants change how the request is cut into messages: one message per layer and K/V (the
request's blocks are contiguous in both caches, as in a fresh or lightly used pool), at most
256 KiB, and one block per message (what a fully fragmented pool gives). The headline
`kv_transfer_gbps` / `transport_gbps` is the default variant (one message per contiguous run).
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

from bench.serving.host import CpuMeter
from services.dataplane import ucx_available
from services.worker.kv_transfer import plan_messages
from tests.harness.kv_nodes import KVNode, KVNodeSpec, expect, start_kv_nodes

KIB = 1 << 10
MIB = 1 << 20


@dataclass(frozen=True)
class Variant:
    name: str
    max_message_bytes: int
    checksum: bool = True
    baseline: bool = True  # also run the bare transport with this variant's message sizes


VARIANTS = (
    Variant("per_layer", 0),
    Variant("per_layer_unchecked", 0, checksum=False, baseline=False),
    Variant("max_256k", 256 * KIB),
    Variant("per_block", 1),
)


def layout_spec(kind: str, num_tokens: int) -> KVNodeSpec:
    """SmolLM2-135M's KV layout, with room for one request of `num_tokens`."""
    blocks = -(-num_tokens // 16)
    return KVNodeSpec(
        transport=kind,
        model_id="smollm2-135m-layout",
        num_layers=30,
        num_blocks=blocks + 8,
        block_size=16,
        num_kv_heads=3,
        head_dim=64,
        dtype="float32",
        config={"stall_timeout_s": 30.0, "offer_timeout_s": 120.0, "window_messages": 4},
    )


def _message_sizes(spec: KVNodeSpec, num_tokens: int, max_message_bytes: int) -> list[int]:
    """The message sizes `receive_kv` uses for a request whose blocks are contiguous on both sides."""
    blocks = list(range(-(-num_tokens // spec.block_size)))
    block_bytes = spec.block_size * spec.num_kv_heads * spec.head_dim * 4
    max_blocks = 0 if max_message_bytes <= 0 else max(1, max_message_bytes // block_bytes)
    plan = plan_messages(blocks, blocks, (0, spec.num_layers), max_blocks)
    return [m.num_blocks * block_bytes for m in plan]


def _kv_round(producer: KVNode, consumer: KVNode, num_tokens: int, variant: Variant) -> float:
    descriptor = expect(producer.call("offer", "r", num_tokens, None), "offered")[1]
    sent = producer.send("wait_offer", descriptor["transfer_id"], 120.0)
    options = {"max_message_bytes": variant.max_message_bytes, "checksum": variant.checksum}
    got = expect(consumer.call("receive", descriptor, None, options, timeout_s=300), "received")
    expect(producer.reply(sent, timeout_s=60), "offer_done")
    expect(consumer.call("free", "r"), "freed")
    return float(got[3])


def _bare_round(producer: KVNode, consumer: KVNode, sizes: list[int]) -> float:
    return float(expect(consumer.call("pull_bare", producer.address, sizes, timeout_s=300), "pulled_bare")[1])


def _measured(fn: Any, nodes: list[KVNode]) -> tuple[float, float | None]:
    meter = CpuMeter({f"node{i}": n.pid for i, n in enumerate(nodes)})
    t0 = time.monotonic()
    elapsed = fn()
    wall = time.monotonic() - t0
    interference = meter.stop()
    share = interference.as_dict(wall)["foreign_cpu_share"] if interference is not None else None
    return elapsed, share  # type: ignore[return-value]


def bench_kind(kind: str, num_tokens: int, rounds: int) -> dict[str, Any]:
    spec = layout_spec(kind, num_tokens)
    producer, consumer = start_kv_nodes([spec, spec])
    try:
        expect(producer.call("fill", "r", num_tokens, 0, timeout_s=120), "filled")
        per_layer_sizes = _message_sizes(spec, num_tokens, 0)
        size_bytes = sum(per_layer_sizes)
        for node in (producer, consumer):
            expect(node.call("bare_buffer", size_bytes), "bare_buffer")
        out: dict[str, Any] = {"size_bytes": size_bytes, "variants": {}}
        for variant in VARIANTS:
            sizes = _message_sizes(spec, num_tokens, variant.max_message_bytes)
            assert sum(sizes) == size_bytes
            # One warm-up of each (first use of buffers and connections), then A B A B ...
            _kv_round(producer, consumer, num_tokens, variant)
            if variant.baseline:
                _bare_round(producer, consumer, sizes)
            kv_s: list[float] = []
            bare_s: list[float] = []
            foreign: list[float | None] = []
            for _ in range(rounds):
                t, share = _measured(
                    lambda v=variant: _kv_round(producer, consumer, num_tokens, v), [producer, consumer]
                )
                kv_s.append(t)
                foreign.append(share)
                if variant.baseline:
                    t, share = _measured(lambda s=sizes: _bare_round(producer, consumer, s), [producer, consumer])
                    bare_s.append(t)
                    foreign.append(share)
            kv_gbps = [size_bytes / t / 1e9 for t in kv_s]
            row: dict[str, Any] = {
                "max_message_bytes": variant.max_message_bytes,
                "checksum": variant.checksum,
                "messages": len(sizes),
                "message_bytes": max(sizes),
                "kv_transfer_gbps": round(max(kv_gbps), 3),
                "kv_transfer_runs_gbps": [round(g, 3) for g in kv_gbps],
                "foreign_cpu_share_runs": foreign,
            }
            if bare_s:
                bare_gbps = [size_bytes / t / 1e9 for t in bare_s]
                pairs = [b / a for a, b in zip(kv_s, bare_s, strict=True)]  # kv rate / bare rate per pair
                row.update(
                    transport_gbps=round(max(bare_gbps), 3),
                    transport_runs_gbps=[round(g, 3) for g in bare_gbps],
                    ratio=round(max(kv_gbps) / max(bare_gbps), 3),
                    ratio_median_of_pairs=round(statistics.median(pairs), 3),
                )
            out["variants"][variant.name] = row
            print(
                f"  {kind} {variant.name}: {len(sizes)} messages, kv {row['kv_transfer_gbps']} GB/s"
                + (f", transport {row['transport_gbps']} GB/s, ratio {row['ratio']}" if bare_s else ""),
                file=sys.stderr,
            )
        head = out["variants"]["per_layer"]
        out.update(
            kv_transfer_gbps=head["kv_transfer_gbps"],
            transport_gbps=head["transport_gbps"],
            ratio=head["ratio"],
            kv_transfer_unchecked_gbps=out["variants"]["per_layer_unchecked"]["kv_transfer_gbps"],
        )
        return out
    finally:
        for node in (producer, consumer):
            node.stop()


def run(args: Any) -> dict[str, Any]:
    """The part's entry: every transport kind of `args.transports`, side by side in one run."""
    num_tokens = args.kv_tokens or (2048 if args.quick else 4096)
    rounds = 3 if args.quick else 5
    kinds = [k for k in args.transports.split(",") if k]
    ucx_ok, reason = ucx_available()
    skipped = {}
    if not ucx_ok and "ucx" in kinds:
        skipped["ucx"] = reason
        kinds.remove("ucx")
    spec = layout_spec("tcp", num_tokens)
    result: dict[str, Any] = {
        "layout": {
            "model": "SmolLM2-135M (the default model's KV layout)",
            "num_layers": spec.num_layers,
            "num_kv_heads": spec.num_kv_heads,
            "head_dim": spec.head_dim,
            "block_size": spec.block_size,
            "dtype": spec.dtype,
        },
        "num_tokens": num_tokens,
        "rounds": rounds,
        "per_transport": {},
        "skipped": skipped,
    }
    for kind in kinds:
        print(f"kv_transfer: {kind}, {num_tokens} tokens", file=sys.stderr)
        result["per_transport"][kind] = bench_kind(kind, num_tokens, rounds)
    if kinds:
        first = result["per_transport"][kinds[0]]
        result.update(
            transport=kinds[0],
            size_bytes=first["size_bytes"],
            kv_transfer_gbps=first["kv_transfer_gbps"],
            transport_gbps=first["transport_gbps"],
            ratio=first["ratio"],
        )
    return result


def targets(part: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for kind, r in part.get("per_transport", {}).items():
        out[f"kv_transfer_over_transport_{kind}"] = {"value": r["ratio"], "target": ">= 0.80", "met": r["ratio"] >= 0.8}
    return out


NOTES = {
    "kv_transfer": (
        "kv_transfer_gbps: receive_kv between two processes, timed in the consumer from connect to its 'done' "
        "(request/response, every message into the consumer's block slots, a checksum of every message on both "
        "sides, the checksum trailer). transport_gbps: the same message sizes and count between the same "
        "processes through the bare transport (same turns and window, no checksum, one flat buffer). Rounds "
        "alternate A B A B after one warm-up of each; best of rounds is the headline, every run is kept, and "
        "ratio_median_of_pairs compares each A with the B after it. foreign_cpu_share_runs: share of the "
        "machine's CPU used by other processes during each round (shared 2-core machine)."
    ),
}
