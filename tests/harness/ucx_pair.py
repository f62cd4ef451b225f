"""One side of a two-container UCX transfer (tests/e2e/test_ucx_containers.py), run inside a
blitzmesh container: `serve DIR` publishes a synthetic model and writes its data-plane address
to DIR/address; `pull DIR` reads it, fetches the manifest and every group over UCX and prints
one JSON line (bytes, seconds, whether every group is bit-identical to the source's).

The transport advertises $ADVERTISE_HOST, as a worker advertises its service name.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

from services.common.waiting import wait_until
from services.dataplane import Pull, fetch_manifest, make_transport, receive_groups, serve_groups
from tests.harness.dataplane_nodes import ModelSpec, buffer_digest, synthetic_model

SPEC = ModelSpec(model_id="pair", num_layers=4, layer_bytes=4 << 20)


async def serve(folder: Path) -> None:
    transport = make_transport("ucx", advertise_host=os.environ["ADVERTISE_HOST"])
    await transport.start()
    manifest, buffers = synthetic_model(SPEC)
    server = await serve_groups(transport, manifest, buffers)
    (folder / "address.tmp").write_bytes(transport.address())
    (folder / "address.tmp").rename(folder / "address")
    await wait_until(lambda: (folder / "done").exists(), timeout_s=60, what="the puller to finish")
    await server.close()
    await transport.close()


async def pull(folder: Path) -> None:
    transport = make_transport("ucx", advertise_host=os.environ["ADVERTISE_HOST"])
    await transport.start()
    await wait_until(lambda: (folder / "address").exists(), timeout_s=30, what="the server's address")
    address = (folder / "address").read_bytes()
    t0 = time.monotonic()
    manifest = await fetch_manifest(transport, address, SPEC.model_id, timeout_s=10)
    result = await receive_groups(transport, manifest, [Pull(address)], stall_timeout_s=10, connect_timeout_s=10)
    elapsed_s = time.monotonic() - t0
    _, want = synthetic_model(SPEC)
    got = [result.store.buffer(i) for i in range(len(manifest.groups))]
    same = [buffer_digest(g) for g in got] == [buffer_digest(w) for w in want]
    print(json.dumps({"bytes": result.bytes_received, "elapsed_s": round(elapsed_s, 3), "identical": same}))
    (folder / "done").touch()
    await transport.close()


if __name__ == "__main__":
    role, folder = sys.argv[1], Path(sys.argv[2])
    asyncio.run(serve(folder) if role == "serve" else pull(folder))
