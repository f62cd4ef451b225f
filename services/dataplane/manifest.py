"""Manifest of a model's parameter groups: byte layout of every tensor, checksums, chunking.

A model is an ordered list of parameter groups (`embed`, `layers.0` ... `layers.{L-1}`,
`head`). Each group travels as one contiguous buffer in which every tensor sits at
`offset_bytes` (64-byte aligned); the manifest says where, and carries a checksum per group so
that a receiver can tell when a group is usable. It is small (JSON, tens of KB for a 7B model)
and travels over the control plane; the bytes never do.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, NamedTuple

import numpy as np

from .buffers import as_uint8_array
from .checksum import BLOCK_BYTES, CHECKSUM_ALGOS, DEFAULT_CHECKSUM_ALGO, checksum_algo_of, group_checksum
from .errors import ManifestError

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DTYPE_ITEMSIZE",
    "MANIFEST_VERSION",
    "TENSOR_ALIGN_BYTES",
    "Chunk",
    "GroupEntry",
    "Manifest",
    "TensorEntry",
    "build_manifest",
    "chunks",
    "group_layout",
    "group_tensors",
    "pack_group",
    "pack_groups",
]

MANIFEST_VERSION: Final = 1
# 16 MiB chunks: each message costs ~1 ms of fixed Python + UCX handshake time here, so one hop
# over UCX (cma) moved 2 GB/s in 4 MiB chunks and 5 GB/s in 16 MiB ones; a chain pays one chunk
# time per extra hop (16 ms on a 1 GB/s link), which is noise against a multi-GB model.
DEFAULT_CHUNK_BYTES: Final = 16 * 1024 * 1024
# Every tensor starts on a cache line, so views are aligned for any dtype and vector loads.
TENSOR_ALIGN_BYTES: Final = 64

# torch names (without the "torch." prefix); numpy uses the same names where it has the type.
DTYPE_ITEMSIZE: Final[Mapping[str, int]] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "complex64": 8,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint64": 8,
    "uint32": 4,
    "uint16": 2,
    "uint8": 1,
    "bool": 1,
}


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """Where one tensor lives inside its group buffer."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset_bytes: int
    size_bytes: int

    @property
    def end_bytes(self) -> int:
        return self.offset_bytes + self.size_bytes


@dataclass(frozen=True, slots=True)
class GroupEntry:
    """One parameter group: its tensors, its byte size, and the checksum of its bytes."""

    name: str
    tensors: tuple[TensorEntry, ...]
    size_bytes: int
    checksum: str


class Chunk(NamedTuple):
    """A contiguous piece of one group: the unit that travels and is forwarded."""

    group_index: int
    offset_bytes: int
    length_bytes: int


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True, slots=True)
class Manifest:
    """All groups of one model, in layer order, with the chunk size they travel in."""

    model_id: str
    groups: tuple[GroupEntry, ...]
    total_bytes: int
    chunk_bytes: int
    version: int = MANIFEST_VERSION

    def __post_init__(self) -> None:
        self.validate()

    # -- validation ---------------------------------------------------------------------------

    def validate(self) -> None:
        """Raise ManifestError quoting the first bad value found."""
        if self.version != MANIFEST_VERSION:
            raise ManifestError(f"manifest version {self.version!r} unsupported, want {MANIFEST_VERSION}")
        if not isinstance(self.model_id, str) or not self.model_id:
            raise ManifestError(f"model_id must be a non-empty string, got {self.model_id!r}")
        if not isinstance(self.chunk_bytes, int) or self.chunk_bytes <= 0 or self.chunk_bytes % BLOCK_BYTES:
            raise ManifestError(
                f"chunk_bytes must be a positive multiple of {BLOCK_BYTES} (the checksum block), "
                f"got {self.chunk_bytes!r}"
            )
        seen: set[str] = set()
        total = 0
        for g in self.groups:
            if g.name in seen:
                raise ManifestError(f"duplicate group name {g.name!r} in model {self.model_id!r}")
            seen.add(g.name)
            _validate_group(g)
            total += g.size_bytes
        if total != self.total_bytes:
            raise ManifestError(
                f"total_bytes={self.total_bytes} but the groups add up to {total} in model {self.model_id!r}"
            )

    # -- lookup -------------------------------------------------------------------------------

    def group_index(self, name: str) -> int:
        for i, g in enumerate(self.groups):
            if g.name == name:
                return i
        raise KeyError(f"no group {name!r} in model {self.model_id!r}")

    def group(self, name: str) -> GroupEntry:
        return self.groups[self.group_index(name)]

    @property
    def group_names(self) -> list[str]:
        return [g.name for g in self.groups]

    # -- serialisation ------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "model_id": self.model_id,
            "total_bytes": self.total_bytes,
            "chunk_bytes": self.chunk_bytes,
            "groups": [
                {
                    "name": g.name,
                    "size_bytes": g.size_bytes,
                    "checksum": g.checksum,
                    "tensors": [[t.name, t.dtype, list(t.shape), t.offset_bytes, t.size_bytes] for t in g.tensors],
                }
                for g in self.groups
            ],
        }

    def to_bytes(self) -> bytes:
        """Canonical JSON (sorted keys, no spaces): equal manifests give equal bytes."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Manifest:
        try:
            groups = tuple(
                GroupEntry(
                    name=str(g["name"]),
                    size_bytes=int(g["size_bytes"]),
                    checksum=str(g["checksum"]),
                    tensors=tuple(
                        TensorEntry(
                            name=str(t[0]),
                            dtype=str(t[1]),
                            shape=tuple(int(x) for x in t[2]),
                            offset_bytes=int(t[3]),
                            size_bytes=int(t[4]),
                        )
                        for t in g["tensors"]
                    ),
                )
                for g in d["groups"]
            )
            return cls(
                model_id=d["model_id"],
                groups=groups,
                total_bytes=int(d["total_bytes"]),
                chunk_bytes=int(d["chunk_bytes"]),
                version=int(d["version"]),
            )
        except ManifestError:
            raise
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise ManifestError(f"malformed manifest: {type(exc).__name__}: {exc}") from exc

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        try:
            d = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ManifestError(f"manifest is not JSON: {exc}") from exc
        if not isinstance(d, dict):
            raise ManifestError(f"manifest must be a JSON object, got {type(d).__name__}")
        return cls.from_dict(d)

    def digest(self) -> str:
        """Short hash of the canonical bytes: two peers agree on a manifest iff digests match."""
        return hashlib.blake2b(self.to_bytes(), digest_size=16).hexdigest()

    def diff(self, other: Manifest) -> str | None:
        """First difference between two manifests, phrased for an error message; None if equal."""
        for field in ("model_id", "chunk_bytes", "total_bytes"):
            a, b = getattr(self, field), getattr(other, field)
            if a != b:
                return f"{field}: expected {a!r}, got {b!r}"
        if len(self.groups) != len(other.groups):
            return f"group count: expected {len(self.groups)}, got {len(other.groups)}"
        for ga, gb in zip(self.groups, other.groups, strict=True):
            if ga != gb:
                for field in ("name", "size_bytes", "checksum"):
                    a, b = getattr(ga, field), getattr(gb, field)
                    if a != b:
                        return f"group {ga.name!r} {field}: expected {a!r}, got {b!r}"
                return f"group {ga.name!r} tensor layout differs"
        return None


def _validate_group(g: GroupEntry) -> None:
    if g.size_bytes < 0:
        raise ManifestError(f"group {g.name!r}: size_bytes must be >= 0, got {g.size_bytes}")
    try:
        checksum_algo_of(g.checksum)
    except ValueError as exc:
        raise ManifestError(f"group {g.name!r}: {exc}") from None
    names: set[str] = set()
    for t in g.tensors:
        if t.name in names:
            raise ManifestError(f"group {g.name!r}: duplicate tensor name {t.name!r}")
        names.add(t.name)
        itemsize = DTYPE_ITEMSIZE.get(t.dtype)
        if itemsize is None:
            raise ManifestError(
                f"group {g.name!r} tensor {t.name!r}: unknown dtype {t.dtype!r}, known: {sorted(DTYPE_ITEMSIZE)}"
            )
        if any(d < 0 for d in t.shape):
            raise ManifestError(f"group {g.name!r} tensor {t.name!r}: negative dimension in shape {list(t.shape)}")
        want = math.prod(t.shape) * itemsize
        if t.size_bytes != want:
            raise ManifestError(
                f"group {g.name!r} tensor {t.name!r}: size_bytes={t.size_bytes} but shape {list(t.shape)} "
                f"of {t.dtype} needs {want}"
            )
        if t.offset_bytes < 0 or t.end_bytes > g.size_bytes:
            raise ManifestError(
                f"group {g.name!r} tensor {t.name!r}: range [{t.offset_bytes}, {t.end_bytes}) is outside "
                f"the group's {g.size_bytes} bytes"
            )
        if t.offset_bytes % itemsize:
            raise ManifestError(
                f"group {g.name!r} tensor {t.name!r}: offset_bytes={t.offset_bytes} not aligned to its "
                f"{itemsize}-byte {t.dtype} elements"
            )
    ordered = sorted((t for t in g.tensors if t.size_bytes), key=lambda t: t.offset_bytes)
    for a, b in itertools.pairwise(ordered):
        if b.offset_bytes < a.end_bytes:
            raise ManifestError(
                f"group {g.name!r}: tensors {a.name!r} [{a.offset_bytes}, {a.end_bytes}) and {b.name!r} "
                f"[{b.offset_bytes}, {b.end_bytes}) overlap"
            )


# -- building from tensors ----------------------------------------------------------------------

TensorLike = Any  # torch.Tensor or np.ndarray


def _dtype_name(t: TensorLike) -> str:
    if isinstance(t, np.ndarray):
        name = t.dtype.name
    elif type(t).__module__.startswith("torch"):
        name = str(t.dtype).removeprefix("torch.")
    else:
        raise ManifestError(f"expected a torch.Tensor or numpy array, got {type(t).__name__}")
    if name not in DTYPE_ITEMSIZE:
        raise ManifestError(f"unknown dtype {name!r}, known: {sorted(DTYPE_ITEMSIZE)}")
    return name


def _tensor_bytes(t: TensorLike) -> np.ndarray:
    if isinstance(t, np.ndarray):
        return np.ascontiguousarray(t).reshape(-1).view(np.uint8)
    return as_uint8_array(t.detach().cpu().contiguous(), writable=False)


def group_layout(group_name: str, tensors: Mapping[str, TensorLike]) -> tuple[tuple[TensorEntry, ...], int]:
    """Where each tensor of a group goes (64-byte aligned, in the given order), and the group's
    size. Only dtypes and shapes are read, so meta tensors do."""
    entries: list[TensorEntry] = []
    offset = 0
    for name, t in tensors.items():
        dtype = _dtype_name(t)
        shape = tuple(int(d) for d in t.shape)
        size = math.prod(shape) * DTYPE_ITEMSIZE[dtype]
        offset = _align(offset, TENSOR_ALIGN_BYTES)
        entries.append(TensorEntry(name=name, dtype=dtype, shape=shape, offset_bytes=offset, size_bytes=size))
        offset += size
    return tuple(entries), offset


def pack_group(entry: GroupEntry, tensors: Mapping[str, TensorLike], out: np.ndarray | None = None) -> np.ndarray:
    """Copy `tensors` into one group buffer laid out as `entry` says (padding zeroed)."""
    buf = np.zeros(entry.size_bytes, dtype=np.uint8) if out is None else as_uint8_array(out, writable=True)
    if buf.size != entry.size_bytes:
        raise ManifestError(f"group {entry.name!r}: buffer has {buf.size} bytes, layout needs {entry.size_bytes}")
    if set(tensors) != {t.name for t in entry.tensors}:
        raise ManifestError(
            f"group {entry.name!r}: tensors {sorted(tensors)} do not match the layout's "
            f"{sorted(t.name for t in entry.tensors)}"
        )
    for te in entry.tensors:
        src = _tensor_bytes(tensors[te.name])
        if src.size != te.size_bytes:
            raise ManifestError(
                f"group {entry.name!r} tensor {te.name!r}: has {src.size} bytes, layout says {te.size_bytes}"
            )
        buf[te.offset_bytes : te.end_bytes] = src
    return buf


def pack_groups(
    model_id: str,
    groups: Sequence[tuple[str, Mapping[str, TensorLike]]],
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    checksum_algo: str = DEFAULT_CHECKSUM_ALGO,
) -> tuple[Manifest, list[np.ndarray]]:
    """Lay out, pack and checksum `groups`: the manifest plus one contiguous buffer per group.

    This is what a source (the parameter manager's host cache, or a test) keeps in memory.
    """
    if checksum_algo not in CHECKSUM_ALGOS:
        raise ManifestError(f"unknown checksum algo {checksum_algo!r}, known: {list(CHECKSUM_ALGOS)}")
    entries: list[GroupEntry] = []
    buffers: list[np.ndarray] = []
    for name, tensors in groups:
        layout, size = group_layout(name, tensors)
        entry = GroupEntry(name=name, tensors=layout, size_bytes=size, checksum=f"{checksum_algo}:{'0' * 32}")
        buf = pack_group(entry, tensors)
        entries.append(
            GroupEntry(name=name, tensors=layout, size_bytes=size, checksum=group_checksum(buf, checksum_algo))
        )
        buffers.append(buf)
    manifest = Manifest(
        model_id=model_id,
        groups=tuple(entries),
        total_bytes=sum(e.size_bytes for e in entries),
        chunk_bytes=chunk_bytes,
    )
    return manifest, buffers


def build_manifest(
    model_id: str,
    groups: Sequence[tuple[str, Mapping[str, TensorLike]]],
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    checksum_algo: str = DEFAULT_CHECKSUM_ALGO,
) -> Manifest:
    """The manifest of `groups` (name, {tensor name: tensor}) in the given (layer) order."""
    return pack_groups(model_id, groups, chunk_bytes, checksum_algo)[0]


def group_tensors(entry: GroupEntry, buffer: Any) -> dict[str, torch.Tensor]:
    """Torch tensors that are zero-copy views into a group buffer laid out per `entry`."""
    import torch

    arr = as_uint8_array(buffer, writable=False)
    if arr.size != entry.size_bytes:
        raise ManifestError(f"group {entry.name!r}: buffer has {arr.size} bytes, layout needs {entry.size_bytes}")
    if not arr.flags.writeable:
        # torch.from_numpy refuses read-only arrays; a copy keeps the caller's bytes untouched.
        arr = arr.copy()
    base = torch.from_numpy(arr)
    out: dict[str, torch.Tensor] = {}
    for te in entry.tensors:
        dtype = getattr(torch, te.dtype)
        out[te.name] = base[te.offset_bytes : te.end_bytes].view(dtype).view(te.shape)
    return out


def chunks(
    manifest: Manifest,
    groups: Iterable[int] | Iterable[tuple[int, int]] | None = None,
) -> Iterator[Chunk]:
    """Chunks of `manifest` in the order given (default: every group, layer order).

    `groups` holds group indices, or (group index, start offset) pairs to resume a group from a
    chunk boundary. Chunks never span groups; together they cover each selected byte once.
    """
    cb = manifest.chunk_bytes
    selected: Iterable[int] | Iterable[tuple[int, int]] = range(len(manifest.groups)) if groups is None else groups
    for item in selected:
        gi, start = (item, 0) if isinstance(item, int) else item
        size = manifest.groups[gi].size_bytes
        if start % cb and start != size:
            raise ValueError(
                f"start offset {start} of group {manifest.groups[gi].name!r} is not a chunk boundary ({cb})"
            )
        for off in range(start, size, cb):
            yield Chunk(gi, off, min(cb, size - off))
