"""Unit tests of the data plane manifest, chunking, checksums and buffer views (no sockets)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from services.dataplane.buffers import as_uint8_array, host_buffer
from services.dataplane.checksum import BLOCK_BYTES
from services.dataplane.errors import ManifestError
from services.dataplane.manifest import (
    TENSOR_ALIGN_BYTES,
    GroupEntry,
    Manifest,
    TensorEntry,
    build_manifest,
    chunks,
    group_tensors,
    pack_groups,
)


def _groups(num_layers: int = 3) -> list[tuple[str, dict[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(0)
    out: list[tuple[str, dict[str, torch.Tensor]]] = [
        ("embed", {"model.embed_tokens.weight": torch.randn(50, 16, generator=g, dtype=torch.float32)})
    ]
    for i in range(num_layers):
        out.append(
            (
                f"layers.{i}",
                {
                    f"model.layers.{i}.mlp.up_proj.weight": torch.randn(33, 17, generator=g).to(torch.bfloat16),
                    f"model.layers.{i}.input_layernorm.weight": torch.randn(17, generator=g).to(torch.float16),
                    f"model.layers.{i}.rotary.inv_freq": torch.arange(5, dtype=torch.int64),
                },
            )
        )
    out.append(("head", {"lm_head.weight": torch.randn(16, 50, generator=g)}))
    return out


def test_manifest_round_trip_and_digest() -> None:
    manifest = build_manifest("tiny", _groups(), chunk_bytes=BLOCK_BYTES)
    again = Manifest.from_bytes(manifest.to_bytes())
    assert again == manifest
    assert again.digest() == manifest.digest()
    assert manifest.group_names == ["embed", "layers.0", "layers.1", "layers.2", "head"]
    assert manifest.total_bytes == sum(g.size_bytes for g in manifest.groups)
    assert json.loads(manifest.to_bytes())["model_id"] == "tiny"


def test_layout_is_aligned_and_tensors_round_trip_bit_identical() -> None:
    groups = _groups()
    manifest, buffers = pack_groups("tiny", groups, chunk_bytes=BLOCK_BYTES)
    for (name, tensors), entry, buf in zip(groups, manifest.groups, buffers, strict=True):
        assert entry.name == name
        for te in entry.tensors:
            assert te.offset_bytes % TENSOR_ALIGN_BYTES == 0
        views = group_tensors(entry, buf)
        for tname, t in tensors.items():
            assert views[tname].dtype == t.dtype
            assert views[tname].shape == t.shape
            assert torch.equal(views[tname].view(torch.uint8), t.contiguous().view(torch.uint8))
        # Views share the group buffer: no copy was made.
        first = entry.tensors[0]
        assert views[first.name].data_ptr() == buf.ctypes.data + first.offset_bytes


def test_numpy_tensors_are_accepted() -> None:
    manifest = build_manifest("np", [("layers.0", {"w": np.ones((4, 4), np.float16)})], chunk_bytes=BLOCK_BYTES)
    assert manifest.groups[0].tensors[0].dtype == "float16"


@pytest.mark.parametrize("chunk_bytes", [BLOCK_BYTES, 2 * BLOCK_BYTES, 4 << 20])
def test_chunks_cover_every_byte_exactly_once_in_layer_order(chunk_bytes: int) -> None:
    rng = np.random.default_rng(1)
    groups = [
        (f"layers.{i}", {"w": rng.integers(0, 255, size=int(n), dtype=np.uint8)})
        for i, n in enumerate([1, BLOCK_BYTES - 1, BLOCK_BYTES, 3 * BLOCK_BYTES + 7, 0, 200_001])
    ]
    manifest = build_manifest("cover", groups, chunk_bytes=chunk_bytes)
    covered = [np.zeros(g.size_bytes, np.int32) for g in manifest.groups]
    order = []
    for c in chunks(manifest):
        assert 0 < c.length_bytes <= chunk_bytes
        assert c.offset_bytes % chunk_bytes == 0
        covered[c.group_index][c.offset_bytes : c.offset_bytes + c.length_bytes] += 1
        order.append(c.group_index)
    assert order == sorted(order)
    for cov in covered:
        assert (cov == 1).all()


def test_chunks_resume_from_an_offset() -> None:
    groups = [("layers.0", {"w": np.zeros(5 * BLOCK_BYTES, np.uint8)}), ("layers.1", {"w": np.zeros(10, np.uint8)})]
    manifest = build_manifest("resume", groups, chunk_bytes=2 * BLOCK_BYTES)
    got = list(chunks(manifest, [(0, 2 * BLOCK_BYTES), (1, 0)]))
    assert [(c.group_index, c.offset_bytes, c.length_bytes) for c in got] == [
        (0, 2 * BLOCK_BYTES, 2 * BLOCK_BYTES),
        (0, 4 * BLOCK_BYTES, BLOCK_BYTES),
        (1, 0, 10),
    ]
    with pytest.raises(ValueError, match="not a chunk boundary"):
        list(chunks(manifest, [(0, 3)]))


def _entry(**kw: object) -> Manifest:
    base = TensorEntry(name="w", dtype="float32", shape=(4, 4), offset_bytes=0, size_bytes=64)
    tensors = kw.pop("tensors", (base,))
    group = GroupEntry(
        name="layers.0",
        tensors=tensors,
        size_bytes=int(kw.pop("size_bytes", 64)),  # type: ignore[arg-type]
        checksum=str(kw.pop("checksum", "blocksum64:" + "0" * 32)),
    )
    return Manifest(
        model_id=str(kw.pop("model_id", "m")),
        groups=(group,),
        total_bytes=int(kw.pop("total_bytes", group.size_bytes)),  # type: ignore[call-overload]
        chunk_bytes=int(kw.pop("chunk_bytes", BLOCK_BYTES)),
    )  # type: ignore[call-overload]


def test_validation_errors_quote_the_bad_values() -> None:
    t = TensorEntry(name="w", dtype="float32", shape=(4, 4), offset_bytes=0, size_bytes=64)
    with pytest.raises(ManifestError, match="unknown dtype 'float13'"):
        _entry(tensors=(dataclasses.replace(t, dtype="float13"),))
    with pytest.raises(ManifestError, match=r"size_bytes=60 but shape \[4, 4\] of float32 needs 64"):
        _entry(tensors=(dataclasses.replace(t, size_bytes=60),))
    with pytest.raises(ManifestError, match=r"'a' \[0, 64\) and 'b' \[32, 96\) overlap"):
        _entry(
            size_bytes=128,
            tensors=(dataclasses.replace(t, name="a"), dataclasses.replace(t, name="b", offset_bytes=32)),
        )
    with pytest.raises(ManifestError, match=r"range \[64, 128\) is outside the group's 64 bytes"):
        _entry(tensors=(dataclasses.replace(t, offset_bytes=64),))
    with pytest.raises(ManifestError, match="total_bytes=99 but the groups add up to 64"):
        _entry(total_bytes=99)
    with pytest.raises(
        ManifestError, match=r"chunk_bytes must be a positive multiple of 65536 \(the checksum block\), got 1000"
    ):
        _entry(chunk_bytes=1000)
    with pytest.raises(ManifestError, match="malformed checksum 'nope'"):
        _entry(checksum="nope")
    with pytest.raises(ManifestError, match="not JSON"):
        Manifest.from_bytes(b"{nope")
    with pytest.raises(ManifestError, match="malformed manifest"):
        Manifest.from_bytes(b'{"version": 1}')
    with pytest.raises(ManifestError, match="unknown dtype 'complex128'"):
        build_manifest("m", [("g", {"w": np.zeros(2, np.complex128)})])


def test_manifest_diff_names_the_first_difference() -> None:
    a = build_manifest("m", [("layers.0", {"w": np.zeros(8, np.float32)})], chunk_bytes=BLOCK_BYTES)
    b = build_manifest("m", [("layers.0", {"w": np.ones(8, np.float32)})], chunk_bytes=BLOCK_BYTES)
    assert a.diff(a) is None
    assert "group 'layers.0' checksum" in (a.diff(b) or "")
    c = build_manifest("other", [("layers.0", {"w": np.zeros(8, np.float32)})], chunk_bytes=BLOCK_BYTES)
    assert a.diff(c) == "model_id: expected 'm', got 'other'"


def test_buffer_views_are_zero_copy_and_checked() -> None:
    t = torch.zeros(10, dtype=torch.bfloat16)
    arr = as_uint8_array(t, writable=True)
    arr[0] = 0x80
    assert t.view(torch.uint8)[0] == 0x80
    assert as_uint8_array(bytearray(3), writable=True).size == 3
    with pytest.raises(ValueError, match="writable"):
        as_uint8_array(b"abc", writable=True)
    with pytest.raises(ValueError, match="C-contiguous"):
        as_uint8_array(np.zeros((4, 4))[:, 1], writable=False)
    buf = host_buffer(1 << 20)
    assert buf.size == 1 << 20 and buf.dtype == np.uint8 and not buf.any()
