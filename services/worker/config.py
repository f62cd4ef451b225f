"""Worker configuration."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field, model_validator

from services.common.backlog import BACKLOG_CHECK_S, BACKLOG_FLOOR_S
from services.common.config import ServiceConfig
from services.worker.engine import defaults


class WorkerConfig(ServiceConfig):
    instance_id: str = Field("", description="unique instance id; empty = worker-<pid>")
    topology_host: str = Field("host-0", description="host (topology node) this worker runs on")
    advertise_host: str = Field(
        "", description="host name peers use to reach this worker (e.g. its container name); empty = --host"
    )
    role: str = Field("colocated", pattern="^(colocated|prefill|decode)$", description="serving role")
    global_manager: str = Field("", description="global manager address; empty runs standalone")
    param_manager: str = Field("", description="parameter manager address (weights come only from it)")
    preload_model: str = Field("", description="load this model at start (standalone use and tests)")
    heartbeat_interval_s: float = Field(1.0, gt=0, description="heartbeat period")
    heartbeat_backlog_check_s: float = Field(
        BACKLOG_CHECK_S,
        ge=0,
        description="between heartbeats, how often the worker checks whether a backlog formed: when its queued "
        "prompts' wait (at its measured prefill capacity) is at least heartbeat_backlog_wait_s and twice what "
        "the last heartbeat said, a heartbeat goes at once, so the manager's queue trigger sees a burst within "
        "this rather than a whole period later (0 = off)",
    )
    heartbeat_backlog_wait_s: float = Field(
        BACKLOG_FLOOR_S, gt=0, description="the queued prompts' wait, in seconds, below which no early heartbeat goes"
    )
    drain_timeout_s: float = Field(
        30.0,
        ge=0,
        description="on SIGTERM, how long in-flight requests may run to their end; those still running then "
        "are aborted, and the gateway resumes each on another instance (0 = abort at once)",
    )
    max_batch_size: int = Field(defaults.MAX_BATCH_SIZE, gt=0, description="most requests in one engine iteration")
    max_num_tokens: int = Field(
        defaults.MAX_NUM_TOKENS,
        gt=0,
        description="most tokens (prefill + decode) in one iteration; prompts up to this long prefill in one"
        " step (a later chunk attends over cached context, which costs more per token)",
    )
    block_size: int = Field(defaults.BLOCK_SIZE, gt=0, description="tokens per KV block")
    kv_cache_tokens: int = Field(
        32768,
        gt=0,
        description="most tokens the KV pool holds; it holds fewer when kv_cache_free_mem_fraction of the memory "
        "free after the model is loaded is less. The default keeps 3-4 workers of the default model on a 24 GiB "
        "host (1.4 GiB of float32 KV each); raise it on an accelerator",
    )
    kv_cache_free_mem_fraction: float = Field(
        0.9,
        gt=0,
        le=1,
        description="share of the memory free after the model is loaded (packed weight copies counted) that the KV "
        "pool may take: CUDA's free memory, else memory_budget_bytes minus the weights when set, else the host's "
        "MemAvailable",
    )
    enable_chunked_prefill: bool = Field(
        True,
        description="split long prompts over iterations of max_num_tokens; off, a prompt longer than max_num_tokens "
        "is refused",
    )
    capacity_policy: Literal["GUARANTEED_NO_EVICT", "MAX_UTILIZATION"] = Field(
        "GUARANTEED_NO_EVICT",
        description="KV admission: GUARANTEED_NO_EVICT reserves prompt + max_tokens and never pauses; "
        "MAX_UTILIZATION reserves the next step and pauses the most recently started request when blocks run out",
    )
    preemption_mode: Literal["recompute", "swap"] = Field(
        "recompute",
        description="MAX_UTILIZATION: a paused request's KV is dropped and recomputed, or swapped to host memory",
    )
    num_threads: int = Field(
        0,
        ge=0,
        description="torch intra-op threads of the engine's compute thread; 0: its share of the cores among the"
        " engines in --cpu-share-dir, or every core without one",
    )
    cpu_share_dir: str = Field(
        "",
        description="directory the workers of one machine share to split its cores among the engines running"
        " (empty: no sharing); used when num_threads is 0",
    )
    step_time_a_s: float | None = Field(None, ge=0, description="emulated accelerator: fixed step time")
    step_time_b_s: float | None = Field(None, ge=0, description="emulated accelerator: step time per batch token")
    load_timeout_s: float = Field(300.0, gt=0, description="give up a parameter load after this long")
    dataplane: str = Field(
        "auto", pattern="^(auto|ucx|tcp)$", description="data-plane transport (auto: UCX if ucxx imports)"
    )
    dataplane_link_gbps: float = Field(
        0.0, ge=0, description="emulate an egress link of this many Gbit/s on one machine (0 = off; benchmarks, tests)"
    )
    dataplane_param_link_gbps: float = Field(
        0.0,
        ge=0,
        description="emulation (benchmarks): the parameter streams this worker serves to others go at most this "
        "many Gbit/s, all sharing it, on top of dataplane_link_gbps (a model with more bytes than it has: its loads "
        "take longer, its KV and hidden states do not); 0 = off",
    )
    dataplane_corrupt_sends: int = Field(
        0,
        ge=0,
        description="chaos testing: flip a byte in each of the first N large data-plane messages this process sends; "
        "receivers must catch it by checksum and fetch again (0 = off)",
    )
    memory_budget_bytes: int = Field(0, ge=0, description="most bytes of parameters this worker accepts; 0 = no limit")
    stall_timeout_s: float = Field(
        10.0, gt=0, description="an upstream silent this long is dead: re-source from a fallback"
    )
    kv_handoff_timeout_s: float = Field(
        30.0,
        gt=0,
        description="prefill side of disaggregation: the prompt KV a request hands off is kept this long for "
        "its decode instance to start pulling, then freed (the decode side then recomputes the prompt)",
    )
    zigzag_partner_order: str = Field(
        "arrival",
        pattern="^(arrival|relay_first)$",
        description="ZigZag partner: take requests relayed from a loading instance in arrival order with its own "
        "waiting ones, or before them (relay_first: more requests split while loading, a worse tail)",
    )
    scheduling_policy: str = Field(
        "fcfs",
        pattern="^(fcfs|scorpio)$",
        description="engine scheduling: fcfs (arrival order, every decode every iteration) or scorpio (SLO-aware,"
        " docs/algorithms.md 4: deadline order, TPOT-gated admission, decodes by credits, SLOUnattainable refusals)",
    )
    device: str = Field(
        "cpu",
        pattern=r"^(cpu|cuda(:[0-9]+)?)$",
        description="where the model and its KV cache live: cpu, or cuda[:N] (parameter groups then land in "
        "pinned host buffers and are copied to the device one group at a time, so ZigZag can run a layer as "
        "soon as it arrives)",
    )
    cuda_graphs: bool = Field(
        True,
        description="on a CUDA device, replay decode-only steps from CUDA graphs captured on first use of their batch"
        " and context bucket (no effect on CPU)",
    )
    dtype: str = Field(
        "auto",
        pattern="^(auto|float32|bfloat16|float16)$",
        description=(
            "dtype of the weights, the KV cache and the compute, whatever the checkpoint stores; auto = the "
            "checkpoint's (float16 computed as float32 on CPU); bfloat16 halves the model's and the KV cache's memory, "
            "but on a CPU without AVX512-BF16 the worker measures its GEMMs and computes in float32 when bfloat16 is "
            "more than 1.5x slower (logged as dtype_overridden)"
        ),
    )
    enable_prefix_caching: bool = Field(
        True,
        description="automatic prefix caching: full KV blocks stay cached after their request ends (until the pool "
        "needs them) and a request whose first tokens are cached skips computing them",
    )

    @model_validator(mode="after")
    def _check(self) -> WorkerConfig:
        # At parse time, before any model loads (the engine checks the same rule again).
        defaults.check_token_budget(self.max_num_tokens, self.max_batch_size)
        if self.kv_cache_tokens < self.block_size:
            raise ValueError(
                f"kv_cache_tokens={self.kv_cache_tokens} is smaller than one block (block_size={self.block_size})"
            )
        if (self.step_time_a_s is None) != (self.step_time_b_s is None):
            raise ValueError(
                f"set both step_time_a_s and step_time_b_s or neither, got {self.step_time_a_s!r}, {self.step_time_b_s!r}"
            )
        if self.device.startswith("cuda"):
            import torch

            index = int(self.device.partition(":")[2] or 0)
            if not torch.cuda.is_available():
                raise ValueError(f"device={self.device!r}: no CUDA device is visible to torch in this process")
            if index >= torch.cuda.device_count():
                raise ValueError(f"device={self.device!r}: torch sees only {torch.cuda.device_count()} CUDA device(s)")
        # BLITZMESH_KERNELS and BLITZMESH_CPU_ISA are read where the kernels are chosen; a bad
        # value fails here, at start, naming the allowed ones.
        from services.worker.model import native

        native.kernel_mode()
        native.isa_cap()
        if self.preload_model and not self.param_manager:
            raise ValueError(f"preload_model={self.preload_model!r} needs param_manager (weights come only from it)")
        return self

    @property
    def resolved_instance_id(self) -> str:
        return self.instance_id or f"worker-{os.getpid()}"
