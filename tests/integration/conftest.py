"""Integration fixtures: real grpc.aio servers of the services, in this process, on port 0."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from services.common.server import ServeContext, serve
from services.model_format.synth import synthesize


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    synthesize(root / "tiny", "tiny", seed=0)
    return root


def plaintext(config: Any) -> Any:
    """`config` with the plaintext opt-in (--insecure) unless it names its certificates.

    In-process servers run plaintext: several services share this process, and a process has
    one identity (its channels present one certificate). The mTLS meshes are tests/e2e's and
    tests/security's, real processes with real certificates.
    """
    return config if config.tls_dir is not None else config.model_copy(update={"insecure": True})


@contextlib.asynccontextmanager
async def running(service: Any, config: Any) -> AsyncIterator[ServeContext]:
    """Run `service` through the real serve() skeleton; yield once it is bound and started."""
    config = plaintext(config)
    stop = asyncio.Event()
    bound: asyncio.Future[ServeContext] = asyncio.get_running_loop().create_future()

    async def on_bound(ctx: ServeContext) -> None:
        bound.set_result(ctx)

    task = asyncio.create_task(serve(service, config, stop_event=stop, on_bound=on_bound))
    done, _ = await asyncio.wait({task, bound}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        task.result()  # raises the start-up error
    try:
        yield bound.result()
    finally:
        stop.set()
        await task


ServeFactory = Callable[[Any, Any], contextlib.AbstractAsyncContextManager[ServeContext]]


@pytest.fixture
def serve_in_process() -> ServeFactory:
    return running
