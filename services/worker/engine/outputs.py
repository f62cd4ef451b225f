"""The engine's outputs and the hooks it hands out, in a leaf module: the events a request
streams (`TokenEvent`), the ZigZag relay's results (`Relayed`, `RelayOutcome`), the KV fill hooks
(`KVFill`, `RelayFill`) and the block allocator they receive (`KVBlocks`). `request.py` and
`engine.py` both use them; this module imports neither. `engine.py` re-exports every name, so
callers may keep importing them from there."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal

import torch

from services.worker.engine.kv_cache import KVCache
from services.worker.engine.sampling import PromptLogprob, TopLogprobs

FinishReason = Literal["stop", "length", "abort"]


class KVBlocks:
    """The consumer-side allocator a `KVFill` receives: the blocks of one admitted request,
    already counted against the engine's reservations (a pull cannot take blocks promised to
    running requests). Matches `services.worker.kv_transfer.KVBlockAllocator`."""

    def __init__(self, cache: KVCache, request_id: str) -> None:
        self._cache = cache
        self._request_id = request_id

    @property
    def request_id(self) -> str:
        return self._request_id

    def allocate(self, seq_id: str, num_tokens: int) -> list[int]:
        if seq_id != self._request_id:
            raise ValueError(f"blocks of {self._request_id!r} were asked for {seq_id!r}")
        table = self._cache.block_table(seq_id)
        if len(table) < self._cache.blocks_needed(num_tokens):
            raise ValueError(
                f"request {seq_id!r} holds {len(table)} blocks for its KV; {num_tokens} tokens were offered"
            )
        # The fill writes every block it is given: none may be a cached block others read.
        self._cache.check_writable(seq_id, 0)
        return table

    def free(self, seq_id: str) -> int:
        # The engine frees the request's blocks itself once the fill has unwound.
        return 0


# Pulls a request's KV for its first tokens from another instance into the blocks `KVBlocks`
# hands out (the decode side of prefill/decode disaggregation); raises on any failure.
KVFill = Callable[[KVBlocks], Awaitable[object]]


@dataclass(frozen=True)
class Relayed:
    """What a ZigZag relay brings (docs/algorithms.md 3): the hidden states `[prompt, H]` of a
    request's prompt after decoder layer `layers` ran on the loading instance, whose KV for
    layers [0, layers) was pulled into the request's blocks here. `layers == 0`: nothing ran
    there, the prompt is computed here whole."""

    layers: int
    hidden: torch.Tensor | None = None


# The full partner's side of ZigZag: takes a request over from the loading instance that ran its
# first layers (pulling that KV into the blocks `KVBlocks` hands out); raises on any failure.
RelayFill = Callable[[KVBlocks], Awaitable[Relayed]]


@dataclass(frozen=True)
class RelayOutcome:
    """A ZigZag request stopped on the loading instance: layers [0, `layers`) ran here; their KV
    is parked under `parked_kv` (None when no layer ran) for the partner to pull, with the
    hidden states after the last of them."""

    layers: int
    num_tokens: int
    parked_kv: str | None = None
    hidden: torch.Tensor | None = None


@dataclass(frozen=True)
class TokenEvent:
    """One streamed step of a request. The last event has `finish_reason` set.

    `token_id` is None only on an "abort" event. A stop token (EOS or a stop_token_id) is delivered
    as the token of the final "stop" event; the caller decides whether to show it. `logprob` is
    the token's log-prob under the model's raw distribution; `top_logprobs` holds the
    `params.logprobs` most likely tokens at its position, and the first event carries
    `prompt_logprobs` (one per prompt token) when `params.prompt_logprobs` is set.
    `cached_tokens`: of the prompt's tokens, those the prefix cache held when the prompt was last
    prefilled here (`EngineRequest.cached_tokens`); None while its KV came from elsewhere.
    """

    token_id: int | None
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    logprob: float | None = None
    top_logprobs: TopLogprobs = ()
    prompt_logprobs: tuple[PromptLogprob, ...] = ()
    # A hand-off request's last event (no finish_reason): its KV now lives under this cache id
    # and covers its first `kv_tokens` tokens, until `Engine.release_parked(parked_kv)`.
    parked_kv: str | None = None
    kv_tokens: int = 0
    # A ZigZag request's last event on the loading instance: the layers that ran here before
    # its partner took it over (see `Engine.relay`); no token.
    zigzag_layers: int | None = None
    cached_tokens: int | None = None
