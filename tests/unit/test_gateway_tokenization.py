"""The gateway's per-model tokenization: the files it gets from the parameter manager, and encoding off
the event loop."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from services.gateway.schema import ChatMessage
from services.gateway.tokenization import ModelCache
from services.model_format import synth
from services.model_format.chat_template import CHAT_TEMPLATE_FILE
from services.model_format.generation import EOS_FILES
from services.model_format.tokenizer import TOKENIZER_FILES, Tokenizer
from services.param_manager.store import SIDE_FILES, index_model

TEMPLATE = "{% for m in messages %}{{ bos_token }}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}{% endfor %}"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = synth.synthesize(tmp_path_factory.mktemp("gw") / "m", "tiny", seed=0)
    (path / CHAT_TEMPLATE_FILE).write_text(TEMPLATE)
    gen = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [2, 5]}))
    return path


def test_parameter_manager_serves_every_file_tokenization_reads() -> None:
    assert set(TOKENIZER_FILES) | set(EOS_FILES) <= set(SIDE_FILES)


async def test_gateway_uses_the_template_file_and_eos_ids_it_was_served(checkpoint: Path) -> None:
    served = index_model("m", checkpoint, slots=1, my_slot=0, chunk_bytes=1 << 20).files
    assert {CHAT_TEMPLATE_FILE, "generation_config.json"} <= set(served)

    async def fetch(model_id: str) -> dict[str, bytes]:
        return dict(served)

    cache = ModelCache(fetch, tokenize_threads=1)
    try:
        assets = await cache.get("m")
        ids = await assets.encode_chat([ChatMessage("user", "hi </s>")])
        prompt = await assets.encode_prompt("hi")
    finally:
        await cache.close()
    tok = Tokenizer(checkpoint)
    # The template's <s> and </s> are control ids; the user's "</s>" is text.
    assert ids == [1, *tok.encode("user: hi </s>", add_special_tokens=False), 2]
    assert prompt == tok.encode("hi") and prompt[0] == 1
    assert assets.eos_token_ids == {2, 5}


def checkpoint_files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in path.iterdir() if p.is_file()}


class GatedTokenizer(Tokenizer):
    """Encodes only once the event loop has run: proves the encode did not block the loop."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.gate = threading.Event()
        self.on_enter: Callable[[], None] = lambda: None
        self.threads: list[int] = []

    def _held(self) -> None:
        self.threads.append(threading.get_ident())
        self.on_enter()
        if not self.gate.wait(timeout=5):
            raise AssertionError("the event loop did not run while the prompt was being encoded")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self._held()
        return super().encode(text, add_special_tokens)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        self._held()
        return super().encode_chat(messages, add_generation_prompt)


@pytest.mark.parametrize("kind", ["prompt", "chat"])
async def test_prompts_are_encoded_off_the_event_loop(checkpoint: Path, kind: str) -> None:
    files = checkpoint_files(checkpoint)

    async def fetch(model_id: str) -> dict[str, bytes]:
        return files

    cache = ModelCache(fetch, tokenize_threads=2)
    try:
        assets = await cache.get("m")
        gated = GatedTokenizer(checkpoint)
        assets = dataclasses.replace(assets, tokenizer=gated)
        entered = asyncio.Event()
        loop = asyncio.get_running_loop()
        gated.on_enter = lambda: loop.call_soon_threadsafe(entered.set)
        text = "the people have the water " * 640  # 16,640 characters
        work = assets.encode_prompt(text) if kind == "prompt" else assets.encode_chat([ChatMessage("user", text)])
        task = asyncio.create_task(work)
        # While the encode is held in its thread, this coroutine runs: the loop is free. It then
        # lets the encode finish. Had the encode run on the loop, it would have timed out instead.
        await asyncio.wait_for(entered.wait(), timeout=5)
        assert not task.done()
        gated.gate.set()
        ids = await task
    finally:
        await cache.close()
    assert gated.threads and gated.threads[0] != threading.get_ident()
    assert len(ids) > 1000
