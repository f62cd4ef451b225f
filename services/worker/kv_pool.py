"""A worker's KV pool sized from the memory its model leaves (docs/algorithms.md 5), and the
EngineConfig its options build.

`kv_pool_blocks` is the pure rule; `free_memory_bytes` reads the machine (CUDA's free memory, a
configured budget, or the host's MemAvailable).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from services.worker.config import WorkerConfig
from services.worker.engine.cpu_share import available_cores
from services.worker.engine.engine import EngineConfig, PacingProfile
from services.worker.engine.scheduler import CapacityPolicy

MEMINFO = Path("/proc/meminfo")


@dataclass(frozen=True)
class PoolSize:
    """How many KV blocks a pool gets, and which limit decided it."""

    num_blocks: int
    limited_by: str  # "memory", "cap" or "floor"


def kv_pool_blocks(
    *,
    free_bytes: int,
    fraction: float,
    bytes_per_token: int,
    block_size: int,
    max_tokens: int,
    min_tokens: int = 0,
) -> PoolSize:
    """The blocks of `block_size` tokens that `fraction` of `free_bytes` holds at
    `bytes_per_token`, at most `max_tokens` worth, and at least `min_tokens` worth (bounded by the
    cap too: a pool that could not hold one full-length request would refuse everything long, so
    the caller floors it at one and logs that memory is short)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
    if bytes_per_token < 1 or block_size < 1 or max_tokens < block_size or min_tokens < 0:
        raise ValueError(
            f"kv_pool_blocks needs bytes_per_token >= 1, block_size >= 1, max_tokens >= block_size and"
            f" min_tokens >= 0, got {bytes_per_token}, {block_size}, {max_tokens}, {min_tokens}"
        )
    by_memory = int(max(0, free_bytes) * fraction) // (bytes_per_token * block_size)
    cap = max_tokens // block_size
    floor = min(cap, -(-min_tokens // block_size))
    if by_memory >= cap:
        return PoolSize(cap, "cap")
    if by_memory < max(floor, 1):
        return PoolSize(max(floor, 1), "floor")
    return PoolSize(by_memory, "memory")


def mem_available_bytes(meminfo: Path = MEMINFO) -> int:
    """The host's MemAvailable (what can be allocated without swapping), from /proc/meminfo."""
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            parts = line.split()
            unit = parts[2].lower() if len(parts) > 2 else "b"
            return int(parts[1]) * (1024 if unit == "kb" else 1)
    raise ValueError(f"{meminfo} has no MemAvailable line")


def free_memory_bytes(
    device: torch.device,
    *,
    weight_bytes: int,
    weight_bytes_to_come: int = 0,
    memory_budget_bytes: int = 0,
    meminfo: Path = MEMINFO,
) -> int:
    """Memory free for the KV pool once the model is loaded.

    CUDA: the device's free memory now (`torch.cuda.mem_get_info`). CPU: `memory_budget_bytes`
    minus the weights' bytes (`weight_bytes`, the packed copy counted) when a budget is set, else
    the host's MemAvailable now. `weight_bytes_to_come`: the weights of a model still loading
    (an engine started for ZigZag with its first layers), which will take memory measured as
    free now."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"device {device} is CUDA but torch sees no CUDA device")
        free, _total = torch.cuda.mem_get_info(device)
        return int(free) - weight_bytes_to_come
    if memory_budget_bytes:
        return memory_budget_bytes - weight_bytes
    return mem_available_bytes(meminfo) - weight_bytes_to_come


def engine_config(cfg: WorkerConfig, num_kv_blocks: int) -> EngineConfig:
    """The EngineConfig a worker with these options runs, over a pool of `num_kv_blocks`."""
    pacing = (
        None
        if cfg.step_time_a_s is None or cfg.step_time_b_s is None
        else PacingProfile(base_s=cfg.step_time_a_s, per_token_s=cfg.step_time_b_s)
    )
    return EngineConfig(
        max_batch_size=cfg.max_batch_size,
        max_num_tokens=cfg.max_num_tokens,
        block_size=cfg.block_size,
        num_kv_blocks=num_kv_blocks,
        capacity_policy=CapacityPolicy(cfg.capacity_policy),
        enable_chunked_prefill=cfg.enable_chunked_prefill,
        preemption_mode=cfg.preemption_mode,
        pacing=pacing,
        zigzag_partner_order=cfg.zigzag_partner_order,
        scheduling_policy=cfg.scheduling_policy,
        enable_prefix_caching=cfg.enable_prefix_caching,
        cuda_graphs=cfg.cuda_graphs,
        # 0: the CpuShare's count when the worker shares the machine, else every core (the
        # worker's own threads run torch single-threaded, so nothing is inherited from them).
        num_threads=cfg.num_threads or (None if cfg.cpu_share_dir else available_cores()),
    )
