"""Per-model tokenizers for the gateway, built from the files the parameter manager serves.

Each model's tokenizer and context length are fetched once and cached; concurrent first
requests for the same model share one fetch.
"""

from __future__ import annotations

import asyncio
import functools
import json
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from services.gateway.errors import ErrorKind, GatewayError, quote
from services.gateway.schema import ChatMessage
from services.model_format.tokenizer import IncrementalDetokenizer, Tokenizer

log = structlog.get_logger(__name__)

# The files a tokenizer needs; anything else the parameter manager sends is ignored.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class ModelAssets:
    """What the gateway needs to know of a model: how to tokenize it and how long it reads."""

    model_id: str
    tokenizer: Tokenizer
    max_context: int | None
    vocab_size: int | None

    def encode_prompt(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_bos=True)

    def encode_chat(self, messages: Sequence[ChatMessage]) -> list[int]:
        text = self.tokenizer.apply_chat_template([{"role": m.role, "content": m.content} for m in messages])
        return self.tokenizer.encode(text, add_bos=True)

    def new_detokenizer(self) -> IncrementalDetokenizer:
        return self.tokenizer.incremental_detokenizer()


def build_assets(model_id: str, files: dict[str, bytes]) -> ModelAssets:
    """Parse a model's side files (blocking: tokenizer.json can take a while to load)."""
    if "tokenizer.json" not in files:
        raise GatewayError(
            ErrorKind.UNAVAILABLE, f"model {quote(model_id)} has no tokenizer.json in the parameter manager"
        )
    config = _json_object(model_id, "config.json", files.get("config.json"))
    # The worker's Tokenizer reads a directory; the files live there only while it loads.
    with tempfile.TemporaryDirectory(prefix="blitzmesh-gateway-tok-") as tmp:
        for name in _TOKENIZER_FILES:
            if name in files:
                (Path(tmp) / name).write_bytes(files[name])
        try:
            tokenizer = Tokenizer(tmp)
        except Exception as e:
            raise GatewayError(
                ErrorKind.UNAVAILABLE, f"cannot load the tokenizer of model {quote(model_id)}: {e}"
            ) from e
    max_context = _positive_int(config.get("max_position_embeddings"))
    vocab_size = max(_positive_int(config.get("vocab_size")) or 0, tokenizer.vocab_size) or None
    return ModelAssets(model_id, tokenizer, max_context, vocab_size)


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

    def __init__(self, fetch_files: Callable[[str], Awaitable[dict[str, bytes]]]) -> None:
        self._fetch_files = fetch_files
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
        assets = await asyncio.to_thread(build_assets, model_id, files)
        self._ready[model_id] = assets
        log.info("model_tokenizer_loaded", model=model_id, max_context=assets.max_context, vocab_size=assets.vocab_size)
        return assets

    async def close(self) -> None:
        pending = list(self._loading.values())
        for fut in pending:
            fut.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)

    def forget(self, model_id: str) -> None:
        """Drop a cached model (e.g. after it was re-registered with new files)."""
        self._ready.pop(model_id, None)
