"""Per-model tokenizers for the gateway, built from the files the parameter manager serves.

Each model's tokenizer and context length are fetched once and cached; concurrent first
requests for the same model share one fetch. Prompts are encoded and chat templates rendered on
a small thread pool, never on the event loop: a long prompt must not stall other streams.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import structlog

from services.gateway.errors import ErrorKind, GatewayError, quote
from services.gateway.schema import ChatMessage
from services.model_format.generation import eos_token_ids
from services.model_format.tokenizer import Tokenizer

log = structlog.get_logger(__name__)

_T = TypeVar("_T")

# Tokenizing is CPU work that releases the GIL (and template rendering is short): a few threads.
DEFAULT_TOKENIZE_THREADS = min(4, os.cpu_count() or 1)


@dataclass(frozen=True)
class ModelAssets:
    """What the gateway needs to know of a model: how to tokenize it and how long it reads.

    `encode_prompt` / `encode_chat` run on `executor` (the loop's default one when None).
    """

    model_id: str
    tokenizer: Tokenizer
    max_context: int | None
    vocab_size: int | None
    eos_token_ids: frozenset[int] = frozenset()
    executor: Executor | None = None

    async def encode_prompt(self, text: str) -> list[int]:
        """Prompt ids of a completion: the text with the special tokens the checkpoint adds (e.g. BOS)."""
        return await self._off_loop(self.tokenizer.encode, text)

    async def encode_chat(self, messages: Sequence[ChatMessage]) -> list[int]:
        """Prompt ids of a chat: the model's own template, rendered and tokenized as transformers does."""
        chat = [{"role": m.role, "content": m.content} for m in messages]
        return await self._off_loop(self.tokenizer.encode_chat, chat)

    async def _off_loop(self, fn: Callable[..., _T], *args: Any) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, functools.partial(fn, *args))


def build_assets(model_id: str, files: dict[str, bytes], executor: Executor | None = None) -> ModelAssets:
    """Parse a model's side files (blocking: tokenizer.json can take a while to load)."""
    if "tokenizer.json" not in files:
        raise GatewayError(
            ErrorKind.UNAVAILABLE, f"model {quote(model_id)} has no tokenizer.json in the parameter manager"
        )
    config = _json_object(model_id, "config.json", files.get("config.json"))
    try:
        tokenizer = Tokenizer.from_files(files)
        eos_ids = eos_token_ids(files, tokenizer)
    except Exception as e:
        raise GatewayError(ErrorKind.UNAVAILABLE, f"cannot load the tokenizer of model {quote(model_id)}: {e}") from e
    max_context = _positive_int(config.get("max_position_embeddings"))
    vocab_size = max(_positive_int(config.get("vocab_size")) or 0, tokenizer.vocab_size) or None
    return ModelAssets(model_id, tokenizer, max_context, vocab_size, eos_ids, executor)


def _json_object(model_id: str, name: str, data: bytes | None) -> dict[str, Any]:
    if data is None:
        return {}
    try:
        value = json.loads(data)
    except ValueError as e:
        raise GatewayError(ErrorKind.UNAVAILABLE, f"model {quote(model_id)} has an unreadable {name}: {e}") from e
    return value if isinstance(value, dict) else {}


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


class ModelCache:
    """model id -> ModelAssets, loaded on first use; failures are not cached (retry next time)."""

    def __init__(
        self,
        fetch_files: Callable[[str], Awaitable[dict[str, bytes]]],
        tokenize_threads: int = DEFAULT_TOKENIZE_THREADS,
    ) -> None:
        if tokenize_threads < 1:
            raise ValueError(f"tokenize_threads must be >= 1, got {tokenize_threads}")
        self._fetch_files = fetch_files
        # Owned here and shared by every model's assets; shut down in close().
        self._executor = ThreadPoolExecutor(max_workers=tokenize_threads, thread_name_prefix="blitzmesh-tokenize")
        self._ready: dict[str, ModelAssets] = {}
        self._loading: dict[str, asyncio.Future[ModelAssets]] = {}

    async def get(self, model_id: str) -> ModelAssets:
        assets = self._ready.get(model_id)
        if assets is not None:
            return assets
        pending = self._loading.get(model_id)
        if pending is None:
            pending = asyncio.ensure_future(self._load(model_id))
            self._loading[model_id] = pending
            pending.add_done_callback(functools.partial(self._loaded, model_id))
        # shield: one impatient client going away must not cancel the load others wait for.
        return await asyncio.shield(pending)

    def _loaded(self, model_id: str, fut: asyncio.Future[ModelAssets]) -> None:
        self._loading.pop(model_id, None)
        if not fut.cancelled():
            fut.exception()  # retrieved here: every waiter may have gone before it failed

    async def _load(self, model_id: str) -> ModelAssets:
        files = await self._fetch_files(model_id)
        loop = asyncio.get_running_loop()
        assets = await loop.run_in_executor(self._executor, build_assets, model_id, files, self._executor)
        self._ready[model_id] = assets
        log.info(
            "model_tokenizer_loaded",
            model=model_id,
            max_context=assets.max_context,
            vocab_size=assets.vocab_size,
            eos_token_ids=sorted(assets.eos_token_ids),
            own_chat_template=assets.tokenizer.has_chat_template,
        )
        return assets

    async def close(self) -> None:
        pending = list(self._loading.values())
        for fut in pending:
            fut.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        self._executor.shutdown(wait=False, cancel_futures=True)

    def forget(self, model_id: str) -> None:
        """Drop a cached model (e.g. after it was re-registered with new files)."""
        self._ready.pop(model_id, None)
