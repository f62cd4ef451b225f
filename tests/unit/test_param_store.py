"""The parameter manager's host store: indexing a checkpoint into one shard of the pool."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from services.dataplane.manifest import pack_groups
from services.model_format.checkpoint import CheckpointError, iter_groups
from services.model_format.synth import synthesize
from services.param_manager.store import index_model, load_shard, partition

CHUNK = 256 * 1024


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Twelve equal layers: every shard is much smaller than the model, unlike tiny's four groups.
    path = tmp_path_factory.mktemp("models") / "m"
    synthesize(path, "tiny", seed=0, overrides={"num_hidden_layers": 12})
    return path


def test_index_holds_one_shard_and_never_the_whole_model(model_path: Path) -> None:
    full, full_bufs = pack_groups("m", list(iter_groups(model_path)), CHUNK)
    largest = max(g.size_bytes for g in full.groups)
    slots = 4
    held_total = 0
    for slot in range(slots):
        tracemalloc.start()
        try:
            model = index_model("m", model_path, slots, slot, CHUNK)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        # The same manifest whichever slot indexes, and exactly this slot's groups, bit for bit.
        assert model.manifest == full
        assert model.held_groups == partition(full, slots)[slot]
        for gi, buf in enumerate(model.buffers):
            if buf is not None:
                assert np.array_equal(buf, full_bufs[gi])
        held_total += model.held_bytes
        # Packed buffers alive at once: the shard, the group being packed, and little else.
        # Reading everything before cutting the shard peaked at about the whole model.
        assert peak < model.held_bytes + 2 * largest + (1 << 20) < full.total_bytes, (
            f"slot {slot}: peak {peak} bytes traced, shard {model.held_bytes}, model {full.total_bytes}"
        )
    assert held_total == full.total_bytes  # one copy across the pool


def test_restarted_cache_reloads_its_shard_against_the_index_manifest(model_path: Path) -> None:
    index = index_model("m", model_path, 3, 0, CHUNK)
    groups = partition(index.manifest, 3)[2]
    shard = load_shard("m", model_path, index.manifest, groups)
    assert shard.held_groups == groups


def test_header_dtype_or_shape_that_disagrees_with_the_config_is_named(tmp_path: Path) -> None:
    path = tmp_path / "m"
    synthesize(path, "tiny", seed=0)
    config = path / "config.json"
    config.write_text(config.read_text().replace('"intermediate_size": ', '"intermediate_size": 1'))
    with pytest.raises(CheckpointError, match="config says"):
        index_model("m", path, 2, 0, CHUNK)
