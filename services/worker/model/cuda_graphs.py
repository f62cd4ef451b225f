"""Decode steps replayed from captured CUDA graphs.

A decode step of a small model on a GPU is bound by its launches, not its arithmetic: a
30-layer model issues some 400 kernels per step, each a few microseconds of work behind a few
microseconds of Python and driver. Captured once into a CUDA graph, the whole step is one
launch. `DecodeGraphs` keeps one graph per (batch bucket, context bucket):

- batch buckets 1, 2, 4, 8, then multiples of 8 up to the engine's `max_batch_size`; a step of n
  sequences runs in the smallest bucket >= n, its extra rows copies of row 0 (they compute the
  same K/V into the same slot, so the cache is left as the real row leaves it, and their logits
  are dropped);
- context buckets of 1, 2, 4, ... blocks up to the longest sequence the model allows: each row
  attends over the blocks of its table, masked at its own length, so a bucket at most doubles the
  attention read of the step's longest sequence.

Graphs are captured on first use of their bucket and share one memory pool. Inputs are copied
into static device buffers from pinned host staging, once per step; the model's step itself is
`LlamaForCausalLM.decode_static`. On a CPU (tests, `capture=False`) the same buffers and buckets
run eagerly, so the padding and bucketing are checked without a GPU.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import structlog
import torch

from services.worker.model.attention import PagedKV
from services.worker.model.llama import LlamaForCausalLM

log = structlog.get_logger(__name__)


def batch_buckets(max_batch_size: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every multiple of 8 up to `max_batch_size` (which is always one)."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size!r}")
    sizes = [s for s in (1, 2, 4) if s < max_batch_size]
    sizes.extend(range(8, max_batch_size, 8))
    sizes.append(max_batch_size)
    return tuple(sorted(set(sizes)))


def block_buckets(max_blocks: int) -> tuple[int, ...]:
    """Powers of two below `max_blocks`, then `max_blocks` itself."""
    if max_blocks < 1:
        raise ValueError(f"max_blocks must be >= 1, got {max_blocks!r}")
    sizes = []
    n = 1
    while n < max_blocks:
        sizes.append(n)
        n *= 2
    sizes.append(max_blocks)
    return tuple(sizes)


def _bucket(buckets: tuple[int, ...], n: int) -> int | None:
    for size in buckets:
        if size >= n:
            return size
    return None


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph | None  # None when run eagerly
    logits: torch.Tensor | None  # the captured step's output (static), None when eager


class DecodeGraphs:
    """Decode-only steps of one model and KV cache, through captured graphs on CUDA."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv: PagedKV,
        max_batch_size: int,
        *,
        capture: bool | None = None,
    ) -> None:
        if not model.static_decode_supported:
            raise ValueError("DecodeGraphs needs a complete model with a static RoPE")
        self.model = model
        self.kv = kv
        self.device = model.device
        self.capture = self.device.type == "cuda" if capture is None else capture
        if self.capture and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA model, this one is on {self.device}")
        self.block_size = kv.block_size
        max_blocks = -(-model.config.max_context_tokens // self.block_size)
        self.batch_buckets = batch_buckets(max_batch_size)
        self.block_buckets = block_buckets(max_blocks)
        bmax, nbmax = self.batch_buckets[-1], self.block_buckets[-1]
        pin = self.device.type == "cuda"
        # Host staging (pinned on CUDA, so the copies are asynchronous) and the static device
        # buffers every graph reads: ids, positions and slots as rows of one [3, B] tensor.
        self._host_rows = torch.zeros((3, bmax), dtype=torch.long, pin_memory=pin)
        self._host_tables = torch.zeros((bmax, nbmax), dtype=torch.long, pin_memory=pin)
        self._rows = torch.zeros((3, bmax), dtype=torch.long, device=self.device)
        self._tables = torch.zeros((bmax, nbmax), dtype=torch.long, device=self.device)
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.capture_s = 0.0  # time spent capturing, all graphs together

    def bucket(self, num_seqs: int, max_seq_len: int) -> tuple[int, int] | None:
        """The (batch, blocks) bucket a step of `num_seqs` sequences whose longest holds
        `max_seq_len` tokens (its new one included) runs in; None when it fits none."""
        b = _bucket(self.batch_buckets, num_seqs)
        nb = _bucket(self.block_buckets, -(-max_seq_len // self.block_size))
        return None if b is None or nb is None else (b, nb)

    @property
    def num_graphs(self) -> int:
        return sum(1 for g in self._graphs.values() if g.graph is not None)

    def run(
        self, input_ids: Sequence[int], context_lens: Sequence[int], block_tables: Sequence[Sequence[int]]
    ) -> torch.Tensor:
        """Float32 logits `[n, vocab]` of n decodes: sequence i's new token `input_ids[i]` after
        `context_lens[i]` cached tokens, its blocks `block_tables[i]`. The result is a view of a
        static buffer: read it before the next step."""
        n = len(input_ids)
        if n == 0 or len(context_lens) != n or len(block_tables) != n:
            raise ValueError(f"{n} input ids, {len(context_lens)} context lengths, {len(block_tables)} block tables")
        if min(context_lens) <= 0:
            raise ValueError(f"decode steps need cached context, got context lengths {list(context_lens)}")
        longest = max(context_lens) + 1
        key = self.bucket(n, longest)
        if key is None:
            raise ValueError(
                f"{n} sequences of up to {longest} tokens fit no bucket (batch <= {self.batch_buckets[-1]},"
                f" blocks <= {self.block_buckets[-1]})"
            )
        b, nb = key
        rows, tables, bs = self._host_rows, self._host_tables, self.block_size
        for i in range(b):
            j = i if i < n else 0  # padding rows repeat row 0
            pos = context_lens[j]
            table = block_tables[j]
            need = pos // bs + 1
            if len(table) < need:
                raise ValueError(f"sequence {j} needs {need} blocks for {pos + 1} tokens, its table has {len(table)}")
            rows[0, i] = input_ids[j]
            rows[1, i] = pos
            rows[2, i] = table[pos // bs] * bs + pos % bs
            tables[i, :need] = torch.as_tensor(table[:need], dtype=torch.long)
            tables[i, need:nb] = table[0]  # any valid block: masked out
        self._rows[:, :b].copy_(rows[:, :b], non_blocking=True)
        self._tables[:b, :nb].copy_(tables[:b, :nb], non_blocking=True)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = self._make(b, nb)
        if graph.graph is None:
            return self._step(b, nb)[:n]
        graph.graph.replay()
        assert graph.logits is not None
        return graph.logits[:n]

    def _step(self, b: int, nb: int) -> torch.Tensor:
        return self.model.decode_static(
            self._rows[0, :b], self._rows[1, :b], self._rows[2, :b], self._tables[:b, :nb], self.kv
        )

    def _make(self, b: int, nb: int) -> _Graph:
        if not self.capture:
            return _Graph(None, None)
        t0 = time.perf_counter()
        # Warm up on a side stream (lazy initialisations, the allocator), as capture requires.
        # The buffers hold this step's real inputs: the warm-up writes the same K/V the graph
        # replay will, so running it twice changes nothing.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._step(b, nb)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the loader and the server's threads may use the device meanwhile.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            logits = self._step(b, nb)
        dt = time.perf_counter() - t0
        self.capture_s += dt
        log.info("cuda_graph_captured", batch=b, blocks=nb, seconds=round(dt, 3), graphs=self.num_graphs + 1)
        return _Graph(graph, logits)
