"""Plain data types of the Blitzmesh SDK: what callers pass in and get back.

No protobuf type appears here; `blitzmesh.convert` is the only place that translates between
these dataclasses and the wire messages.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "ChatMessage",
    "Choice",
    "ClusterEvent",
    "ClusterState",
    "Completion",
    "EspGroup",
    "FinishReason",
    "InstanceInfo",
    "InstanceRole",
    "InstanceState",
    "LoadReport",
    "ModelInfo",
    "PolicyState",
    "SLOAttainment",
    "SamplingParams",
    "ScaleResult",
    "TokenChunk",
    "TokenLogprob",
    "TopLogprob",
    "Usage",
]

FinishReason = Literal["stop", "length", "abort"]
"""Why generation ended: eos or a stop sequence, the token limit, or a client abort."""

InstanceState = Literal["unspecified", "idle", "loading", "serving", "draining", "lost"]
"""Lifecycle of a worker instance: idle -> loading -> serving -> draining -> idle (or lost)."""

InstanceRole = Literal["unspecified", "colocated", "prefill", "decode"]
"""What part of inference an instance runs."""

_INT32_MAX = 2**31 - 1
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
MAX_LOGPROBS = 20
"""Most alternatives per position that `logprobs` / `prompt_logprobs` may ask for."""


def _is_int(value: object) -> bool:
    # bool is an int subclass; `top_k=True` is a caller mistake, not a 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _logit_bias(value: Mapping[int, float] | Iterable[tuple[int, float]]) -> tuple[tuple[int, float], ...]:
    if isinstance(value, (str, bytes)):
        raise ValueError(f"logit_bias must map token ids to biases, got {value!r}")
    pairs = list(value.items()) if isinstance(value, Mapping) else list(value)
    out: dict[int, float] = {}
    for pair in pairs:
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise ValueError(f"logit_bias must map token ids to biases, got the entry {pair!r}")
        token, bias = pair
        if not _is_int(token) or not 0 <= token <= _INT32_MAX:
            raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {token!r}")
        if not _is_number(bias) or not -100 <= bias <= 100:
            raise ValueError(f"logit_bias for token {token} must be a number in [-100, 100], got {bias!r}")
        if token in out:
            raise ValueError(f"logit_bias names token {token} twice")
        out[token] = float(bias)
    return tuple(sorted(out.items()))


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How tokens are sampled; ``None`` leaves the choice to the gateway's defaults.

    Raises:
        ValueError: on an out-of-range value, quoting it.
    """

    temperature: float | None = None
    """0 means greedy; the gateway's default is 1.0."""
    top_p: float | None = None
    """Nucleus mass in (0, 1]."""
    top_k: int | None = None
    """Keep the k most likely tokens; 0 or -1 turns it off."""
    max_tokens: int | None = None
    """Most tokens to generate (at least 1)."""
    stop: tuple[str, ...] = ()
    """Stop sequences; they never appear in the output."""
    seed: int | None = None
    """Same seed, same output."""
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float | None = None
    """In [-2, 2]: subtracted from the logit of every token generated so far (OpenAI's)."""
    frequency_penalty: float | None = None
    """In [-2, 2]: subtracted once per earlier occurrence in the generated tokens (OpenAI's)."""
    repetition_penalty: float | None = None
    """> 0, 1 = off: for tokens of the prompt or the output, positive logits are divided by it and
    negative ones multiplied (HF/vLLM's)."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """Token id -> bias in [-100, 100] added to its logit; a mapping is accepted and stored as
    ``(id, bias)`` pairs sorted by id (``dict(params.logit_bias)`` gives it back)."""
    logprobs: int | None = None
    """``None``: no log-probs; k in [0, 20]: each token's log-prob and the k most likely tokens at
    its position. Log-probs are of the model's raw distribution (before temperature, penalties
    and logit_bias)."""
    prompt_logprobs: int | None = None
    """The same for every prompt token (the first has none)."""

    def __post_init__(self) -> None:
        # Callers naturally pass lists; store tuples so the object stays immutable and hashable.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        t = self.temperature
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        p = self.top_p
        if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        k = self.top_k
        if k is not None and (not _is_int(k) or not -1 <= k <= _INT32_MAX):
            raise ValueError(f"top_k must be an int >= -1 (0 or -1 turns it off), got {k!r}")
        n = self.max_tokens
        if n is not None and (not _is_int(n) or not 1 <= n <= _INT32_MAX):
            raise ValueError(f"max_tokens must be an int >= 1, got {n!r}")
        s = self.seed
        if s is not None and (not _is_int(s) or not _INT64_MIN <= s <= _INT64_MAX):
            raise ValueError(f"seed must be a 64-bit int, got {s!r}")
        for seq in self.stop:
            if not isinstance(seq, str) or not seq:
                raise ValueError(f"stop sequences must be non-empty strings, got {self.stop!r}")
        for tid in self.stop_token_ids:
            if not _is_int(tid) or not 0 <= tid <= _INT32_MAX:
                raise ValueError(f"stop_token_ids must be ints >= 0, got {self.stop_token_ids!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value is not None and (not _is_number(value) or not -2 <= value <= 2):
                raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
        r = self.repetition_penalty
        if r is not None and (not _is_number(r) or r <= 0):
            raise ValueError(f"repetition_penalty must be a number > 0 (1 = off), got {r!r}")
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an int in [0, {MAX_LOGPROBS}], got {value!r}")


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One turn of a chat prompt."""

    role: str
    """``"system"``, ``"user"`` or ``"assistant"``."""
    content: str


def check_slo_s(name: str, value: object) -> None:
    """A latency objective must be a positive finite number of seconds (or None: none given).

    Raises:
        ValueError: quoting the value.
    """
    if value is None:
        return
    if not _is_number(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number of seconds, got {value!r}")


@dataclass(frozen=True, slots=True)
class SLOAttainment:
    """Whether a finished request met its latency objectives, as the gateway measured them.

    TTFT runs from the gateway accepting the request to its first token; TPOT is the mean time
    per output token after the first. With n > 1 choices the worst choice counts (a request met
    an objective only if every choice did). An objective the request did not have is ``None``,
    and so is its ``*_met``.
    """

    ttft_s: float | None = None
    """The TTFT objective, seconds (the request's, or the deployment's default)."""
    tpot_s: float | None = None
    """The TPOT objective, seconds."""
    ttft_met: bool | None = None
    tpot_met: bool | None = None
    """Met when the observed TPOT is within the objective; a choice with fewer than two tokens
    has no gap to miss and counts as met."""
    ttft_observed_s: float = 0.0
    tpot_observed_s: float = 0.0
    """0 with fewer than two tokens."""


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of one request, and its SLO attainment when it had an objective.
    `cached_tokens`: of `prompt_tokens`, those whose KV came from a prefix cache instead of being
    computed (OpenAI's `usage.prompt_tokens_details.cached_tokens`)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    slo: SLOAttainment | None = None
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class TopLogprob:
    """One of the most likely tokens at a position."""

    token_id: int
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A token's log-probability under the model, and the most likely tokens at its position
    (most likely first). Always <= 0; ``None`` only for the first prompt token."""

    token_id: int
    logprob: float | None
    top_logprobs: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class TokenChunk:
    """One message of a generation stream: the text one choice produced since its previous chunk.

    Each choice's last chunk has ``finish_reason`` and ``usage`` (that choice's); ``token_ids``
    is filled only when the request asked for ``return_token_ids``, ``logprobs`` (one per token
    of the chunk) when it asked for ``logprobs``, and a choice's first chunk carries
    ``prompt_logprobs`` when asked for. With ``n > 1`` the choices' chunks interleave.
    """

    text: str
    token_ids: tuple[int, ...] = ()
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    request_id: str = ""
    instance_id: str = ""
    """Which instance served the request."""
    index: int = 0
    """Which choice (0 .. n-1) this chunk belongs to."""
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class Choice:
    """One of the n choices of a completion."""

    index: int
    text: str
    token_ids: tuple[int, ...] = ()
    finish_reason: FinishReason | None = None
    logprobs: tuple[TokenLogprob, ...] = ()
    instance_id: str = ""


@dataclass(frozen=True, slots=True)
class Completion:
    """A whole completion. ``text``, ``token_ids``, ``finish_reason`` and ``instance_id`` are
    choice 0's; ``choices`` holds all n (built from those when not given); ``usage`` counts the
    prompt once and every choice's completion tokens."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    usage: Usage
    request_id: str
    instance_id: str
    choices: tuple[Choice, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] = ()

    def __post_init__(self) -> None:
        if not self.choices:
            first = Choice(0, self.text, self.token_ids, self.finish_reason, instance_id=self.instance_id)
            object.__setattr__(self, "choices", (first,))

    @property
    def logprobs(self) -> tuple[TokenLogprob, ...]:
        """Choice 0's log-probs (empty unless the request asked for ``logprobs``)."""
        return self.choices[0].logprobs


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """A model the cluster can serve."""

    model_id: str
    num_layers: int = 0
    size_bytes: int = 0
    max_context: int = 0
    vocab_size: int = 0
    dtype: str = ""
    created_unix_s: int = 0
    num_parameters: int = 0


@dataclass(frozen=True, slots=True)
class LoadReport:
    """Load figures an instance reports in its heartbeats (windowed on the worker)."""

    decode_tps: float = 0.0
    prefill_tps: float = 0.0
    ttft_p50_s: float = 0.0
    ttft_p99_s: float = 0.0
    tbt_p50_s: float = 0.0
    tbt_p99_s: float = 0.0
    running: int = 0
    waiting: int = 0
    waiting_prefill_tokens: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    tokens_generated_total: int = 0
    zigzag_running: int = 0
    """ZigZag requests running their first layers here (a loading instance)."""
    zigzag_relayed_total: int = 0
    """ZigZag requests a full partner took over from this (loading) instance so far."""
    zigzag_continued_total: int = 0
    """ZigZag requests this (full) instance took over from a loading one so far."""
    est_tpot_s: float = 0.0
    """SLO-aware engine: its estimated time per output token for the running set (0 = none yet)."""
    slo_rejected_total: int = 0
    """Requests refused so far because their SLO could not be met here."""
    preempted_total: int = 0
    """Requests paused so far so that others could go on."""
    prefix_hit_tokens: int = 0
    """Prompt tokens served from cached KV blocks since start."""
    prefix_query_tokens: int = 0
    """Prompt tokens looked up in the prefix cache since start."""
    prefill_capacity_tps: float = 0.0
    """Prompt tokens per second the engine computes while prefilling, from its recent prefill
    steps (0 = no prefill step yet); queued prompt tokens / this = the wait a new arrival sees."""
    esp_groups: tuple[str, ...] = ()
    """ESP groups this instance is in now (computing a slice, holding one's KV, or master)."""
    esp_group_kv_tokens: tuple[int, ...] = ()
    """The KV tokens this instance holds for each of `esp_groups`, in the same order."""


@dataclass(frozen=True, slots=True)
class KernelChoice:
    """What one op of the model runs on an instance: ``native`` (at level ``isa``) or ``torch``,
    and the median times that decided it (None where it was not timed)."""

    op: str
    impl: str
    isa: str = "-"
    reason: str = ""
    native_ms: float | None = None
    torch_ms: float | None = None
    speedup: float | None = None
    """Geometric mean over the timed cases of torch's time over native's (native runs above 1)."""


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """How an instance computes: the dtype (and the one asked for) and each op's kernel, chosen
    by measurement when the model loaded on the CPU it runs on."""

    requested_dtype: str = ""
    dtype: str = ""
    dtype_reason: str = ""
    kernel_mode: str = ""
    """``auto`` (measured), ``torch`` or ``native`` (``BLITZMESH_KERNELS``)."""
    isa: str = ""
    """The native kernels' level: the machine's best, capped by ``BLITZMESH_CPU_ISA``."""
    machine_isa: str = ""
    kernels: tuple[KernelChoice, ...] = ()
    plan_cached: bool = False
    plan_measured_s: float = 0.0


@dataclass(frozen=True, slots=True)
class InstanceInfo:
    """One worker instance (one accelerator) as the global manager sees it."""

    instance_id: str
    address: str = ""
    """gRPC ``host:port`` of the worker."""
    host: str = ""
    model_id: str = ""
    """Empty while idle."""
    state: InstanceState = "unspecified"
    role: InstanceRole = "unspecified"
    layers_loaded: int = 0
    """k of ``num_layers`` decoder layers usable; below ``num_layers`` while loading."""
    num_layers: int = 0
    load: LoadReport = field(default_factory=LoadReport)
    dataplane_address: bytes = b""
    """Opaque transport address of the data plane."""
    dataplane_kind: str = ""
    """``"ucx"`` or ``"tcp"``."""
    last_heartbeat_age_s: float = 0.0
    memory_budget_bytes: int = 0
    engine: EngineInfo | None = None
    """The dtype and kernels it computes with; None until a model was loaded."""


@dataclass(frozen=True, slots=True)
class EspGroup:
    """An elastic-sequence-parallel group the manager formed for one long request: its members
    in slice order (the last is the master), the prompt positions each computed, and the spares
    its master may scale up to."""

    group_id: str
    request_id: str
    model_id: str
    member_ids: tuple[str, ...]
    bounds: tuple[int, ...]
    spare_ids: tuple[str, ...] = ()
    age_s: float = 0.0
    holder_ids: tuple[str, ...] = ()  # instances in it now, by their heartbeats
    live: bool = False  # False once it ended (no instance reports it any more)
    holder_kv_tokens: tuple[int, ...] = ()  # the KV tokens each of `holder_ids` holds for it

    @property
    def kv_placement(self) -> dict[str, int | None]:
        """Where the request's KV lies now: holder id -> the KV tokens it holds (from its
        heartbeats; None where the manager did not say)."""
        tokens = self.holder_kv_tokens if len(self.holder_kv_tokens) == len(self.holder_ids) else ()
        return {h: (tokens[k] if tokens else None) for k, h in enumerate(self.holder_ids)}

    @property
    def degree(self) -> int:
        return len(self.member_ids)


@dataclass(frozen=True, slots=True)
class ClusterState:
    """Snapshot of the cluster: instances, models and the scaling policy in force."""

    instances: tuple[InstanceInfo, ...] = ()
    models: tuple[ModelInfo, ...] = ()
    policy: str = ""
    advisory: bool = False
    """True when the policy only decides and does not act."""
    policy_params: Mapping[str, str] = field(default_factory=dict)
    """The policy's parameters in force, as strings (as `set_policy` sends them)."""
    esp_groups: tuple[EspGroup, ...] = ()
    """The ESP groups formed most recently, newest first."""


@dataclass(frozen=True, slots=True)
class ClusterEvent:
    """One scaling or lifecycle event, e.g. an autoscaling decision with its reason."""

    time_s: float
    action: str
    """``autoscaling_decision``, ``instance_state``, ``load_result``, ..."""
    target: str = ""
    status: str = ""
    reason: str = ""
    instance_id: str = ""


@dataclass(frozen=True, slots=True)
class ScaleResult:
    """Outcome of a scale request."""

    instance_ids: tuple[str, ...]
    """Instances that were assigned (scale out) or drained (scale in)."""
    reason: str = ""


@dataclass(frozen=True, slots=True)
class PolicyState:
    """The scaling policy in force after a ``set_policy`` call."""

    policy: str
    params: Mapping[str, str] = field(default_factory=dict)
    advisory: bool = False
