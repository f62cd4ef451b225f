"""Host-memory parameter store: each registered model is held once, packed group by group.

A group (`embed`, `layers.i`, `head`) is one contiguous uint8 buffer with its tensors laid out
back to back, so it can be streamed, checksummed and received into final memory in one piece.
"""

from __future__ import annotations

import json
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import structlog
import torch

from services.worker.model.checkpoint import iter_groups
from services.worker.model.config import LlamaConfig

log = structlog.get_logger(__name__)

# Files besides the weights that clients (gateway tokenizers, workers) need.
TENSOR_ALIGN_BYTES = 64
SIDE_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json")


@dataclass(frozen=True)
class TensorSlot:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset_bytes: int
    size_bytes: int


@dataclass
class PackedGroup:
    name: str
    buffer: torch.Tensor  # uint8, contiguous
    tensors: list[TensorSlot]
    checksum: str

    @property
    def size_bytes(self) -> int:
        return int(self.buffer.numel())


def group_checksum(buffer: torch.Tensor | memoryview | bytes) -> str:
    """crc32 of the group's bytes, as 8 hex digits (zlib releases the GIL and runs at GB/s)."""
    view = buffer.numpy() if isinstance(buffer, torch.Tensor) else buffer
    return f"{zlib.crc32(view) & 0xFFFFFFFF:08x}"


def pack_group(name: str, tensors: dict[str, torch.Tensor]) -> PackedGroup:
    """Copy a group's tensors into one contiguous buffer (sorted by name for a stable layout)."""
    slots: list[TensorSlot] = []
    offset = 0
    for tname in sorted(tensors):
        t = tensors[tname]
        size = t.numel() * t.element_size()
        # Aligned offsets let a receiver view each tensor in place, whatever its dtype.
        offset = -(-offset // TENSOR_ALIGN_BYTES) * TENSOR_ALIGN_BYTES
        slots.append(TensorSlot(tname, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset, size))
        offset += size
    buffer = torch.zeros(offset, dtype=torch.uint8)  # zeroed padding keeps checksums stable
    for slot in slots:
        src = tensors[slot.name].contiguous().reshape(-1).view(torch.uint8)
        buffer[slot.offset_bytes : slot.offset_bytes + slot.size_bytes].copy_(src)
    return PackedGroup(name, buffer, slots, group_checksum(buffer))


def unpack_group(buffer: torch.Tensor, slots: list[TensorSlot]) -> dict[str, torch.Tensor]:
    """Tensors as views into `buffer` (no copy): the buffer is their final memory."""
    out: dict[str, torch.Tensor] = {}
    for slot in slots:
        dtype = getattr(torch, slot.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"tensor {slot.name!r} has unknown dtype {slot.dtype!r}")
        raw = buffer[slot.offset_bytes : slot.offset_bytes + slot.size_bytes]
        out[slot.name] = raw.view(dtype).view(slot.shape)
    return out


@dataclass
class HostModel:
    model_id: str
    path: Path
    config: LlamaConfig
    config_json: bytes
    groups: list[PackedGroup]
    files: dict[str, bytes]
    created_unix_s: int = field(default_factory=lambda: int(time.time()))

    @property
    def size_bytes(self) -> int:
        return sum(g.size_bytes for g in self.groups)

    @property
    def num_parameters(self) -> int:
        return sum(
            int(torch.Size(s.shape).numel()) for g in self.groups for s in g.tensors
        )

    def group(self, name: str) -> PackedGroup:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(f"model {self.model_id!r} has no parameter group {name!r}")


def load_host_model(model_id: str, path: Path) -> HostModel:
    """Read a Hugging Face layout checkpoint one group at a time into packed host buffers."""
    config_json = (path / "config.json").read_bytes()
    config = LlamaConfig.from_hf_dict(json.loads(config_json))
    started = time.perf_counter()
    groups = [pack_group(name, tensors) for name, tensors in iter_groups(path)]
    files = {f: (path / f).read_bytes() for f in SIDE_FILES if (path / f).exists()}
    if "tokenizer.json" not in files:
        raise FileNotFoundError(f"model {model_id!r} at {str(path)!r} has no tokenizer.json")
    model = HostModel(model_id, path, config, config_json, groups, files)
    log.info(
        "model_registered",
        model=model_id,
        groups=len(groups),
        size_bytes=model.size_bytes,
        load_s=round(time.perf_counter() - started, 3),
    )
    return model


def discover_models(model_dir: Path) -> dict[str, Path]:
    """Every sub-directory holding a config.json is a model; its name is the model id."""
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory {str(model_dir)!r} does not exist")
    found = {p.name: p for p in sorted(model_dir.iterdir()) if (p / "config.json").is_file()}
    return found
