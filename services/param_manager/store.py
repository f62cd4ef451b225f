"""Host-memory parameter store: the shard of each model that this host-cache process holds.

The pool keeps exactly one copy of every model across all host-cache processes (O(1) host
caching): the manifest's groups are split into `cache_slots` contiguous shards of about equal
bytes, and each process packs only its own shard's groups. Buffers use the data plane's layout
(`services.dataplane.manifest`), so they are served as they are, never copied again.
"""

from __future__ import annotations

import ctypes
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import structlog

from services.dataplane.chain import GroupStore
from services.dataplane.checksum import checksum_algo_of, group_checksum
from services.dataplane.errors import ChecksumMismatch
from services.dataplane.manifest import Manifest, group_layout, pack_group, pack_groups
from services.model_format.checkpoint import Checkpoint, iter_groups
from services.model_format.config import LlamaConfig
from services.model_format.groups import param_groups

log = structlog.get_logger(__name__)

# Files besides the weights that clients (gateway tokenizers, workers) need.
SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def partition(manifest: Manifest, slots: int) -> list[list[str]]:
    """Contiguous shards of about equal bytes, one per slot, in layer order."""
    return partition_sizes([(g.name, g.size_bytes) for g in manifest.groups], slots)


def partition_sizes(sizes: list[tuple[str, int]], slots: int) -> list[list[str]]:
    """`partition` from (group name, size in bytes) in layer order.

    Contiguous keeps each shard's groups in layer order for streaming; the cut points are where
    the running byte count crosses k/slots of the total.
    """
    if slots < 1:
        raise ValueError(f"cache slots must be >= 1, got {slots}")
    shards: list[list[str]] = [[] for _ in range(slots)]
    total = max(sum(size for _, size in sizes), 1)
    running = 0
    for name, size in sizes:
        # Place a group by the byte position of its middle, so big groups land evenly.
        slot = min(slots - 1, int((running + size / 2) * slots / total))
        shards[slot].append(name)
        running += size
    return shards


@dataclass
class HostModel:
    """One model's manifest, and the buffers of the groups this process holds (None elsewhere)."""

    model_id: str
    path: Path
    config: LlamaConfig
    config_json: bytes
    manifest: Manifest
    buffers: list[np.ndarray | None]
    files: dict[str, bytes]
    created_unix_s: int = field(default_factory=lambda: int(time.time()))

    @property
    def held_groups(self) -> list[str]:
        return [g.name for g, b in zip(self.manifest.groups, self.buffers, strict=True) if b is not None]

    @property
    def held_bytes(self) -> int:
        return sum(int(b.nbytes) for b in self.buffers if b is not None)

    @property
    def num_parameters(self) -> int:
        return self.config.num_parameters()

    def store(self) -> GroupStore:
        """A data-plane store offering the held groups (zero-copy) to receivers."""
        store = GroupStore(self.manifest)
        held = [i for i, b in enumerate(self.buffers) if b is not None]
        store.expect(held)
        for i in held:
            buf = self.buffers[i]
            assert buf is not None
            store.set_buffer(i, buf)
            store.mark_landed(i, int(buf.nbytes))
            store.mark_ready(i)
        return store


def _side_files(model_id: str, path: Path) -> tuple[LlamaConfig, bytes, dict[str, bytes]]:
    config_json = (path / "config.json").read_bytes()
    config = LlamaConfig.from_hf_dict(json.loads(config_json))
    files = {f: (path / f).read_bytes() for f in SIDE_FILES if (path / f).exists()}
    if "tokenizer.json" not in files:
        raise FileNotFoundError(f"model {model_id!r} at {str(path)!r} has no tokenizer.json")
    return config, config_json, files


_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


def big_buffers_from_mmap() -> None:
    """Have glibc serve every allocation of 1 MiB or more with its own mmap (a no-op elsewhere).

    By default, once a big mmap'd buffer is freed glibc raises its mmap threshold to that
    size (up to 32 MiB) and serves later buffers below it from the heap, where freed groups of
    other shards stayed in the RSS: the index process kept ~25 MB more than its shard on the
    `bench` model. A fixed threshold also turns that adjustment off. Process-wide: called once
    when a parameter-manager process starts, before it packs anything.
    """
    try:
        ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, 1 << 20)
    except (OSError, AttributeError):
        pass


def index_model(model_id: str, path: Path, slots: int, my_slot: int, chunk_bytes: int) -> HostModel:
    """Read a checkpoint once, group by group: build the manifest of all groups (checksums
    included) and keep only the groups of `my_slot`'s shard.

    The shards are cut from the groups' sizes, laid out from the file headers before any data
    is read, so a group of another shard is dropped as soon as its checksum is taken: the
    process never holds more than its shard plus one group.
    """
    started = time.perf_counter()
    config, config_json, files = _side_files(model_id, path)
    checkpoint = Checkpoint(path)
    names = param_groups(config)
    sizes = [(name, group_layout(name, checkpoint.group_meta(name))[1]) for name in names]
    mine = set(partition_sizes(sizes, slots)[my_slot])
    entries = []
    buffers: list[np.ndarray | None] = []
    for name, tensors in checkpoint.iter_groups(names):
        one, (buf,) = pack_groups(model_id, [(name, tensors)], chunk_bytes)
        entries.append(one.groups[0])
        buffers.append(buf if name in mine else None)
        del tensors, buf
    manifest = Manifest(
        model_id=model_id,
        groups=tuple(entries),
        total_bytes=sum(e.size_bytes for e in entries),
        chunk_bytes=chunk_bytes,
    )
    model = HostModel(model_id, path, config, config_json, manifest, buffers, files)
    log.info(
        "model_indexed",
        model=model_id,
        groups=len(entries),
        total_bytes=manifest.total_bytes,
        held_bytes=model.held_bytes,
        slot=my_slot,
        slots=slots,
        load_s=round(time.perf_counter() - started, 3),
    )
    return model


def load_shard(model_id: str, path: Path, manifest: Manifest, groups: list[str]) -> HostModel:
    """Pack `groups` of a checkpoint per an existing manifest, verifying each checksum."""
    started = time.perf_counter()
    config, config_json, files = _side_files(model_id, path)
    buffers: list[np.ndarray | None] = [None] * len(manifest.groups)
    for name, tensors in iter_groups(path, groups):
        gi = manifest.group_index(name)
        entry = manifest.groups[gi]
        buf = pack_group(entry, tensors)
        actual = group_checksum(buf, checksum_algo_of(entry.checksum))
        if actual != entry.checksum:
            raise ChecksumMismatch(
                f"group {name!r} of {model_id!r} at {str(path)!r}: checksum {actual} != "
                f"index {entry.checksum} (the checkpoint changed?)",
                group=name,
                expected=entry.checksum,
                actual=actual,
            )
        buffers[gi] = buf
    model = HostModel(model_id, path, config, config_json, manifest, buffers, files)
    log.info(
        "shard_loaded",
        model=model_id,
        groups=len(groups),
        held_bytes=model.held_bytes,
        load_s=round(time.perf_counter() - started, 3),
    )
    return model


def discover_models(model_dir: Path) -> dict[str, Path]:
    """Every sub-directory holding a config.json is a model; its name is the model id."""
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory {str(model_dir)!r} does not exist")
    return {p.name: p for p in sorted(model_dir.iterdir()) if (p / "config.json").is_file()}
