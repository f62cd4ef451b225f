"""Reader of HF-layout checkpoint directories, one parameter group at a time.

Tensors are read through `safetensors.safe_open` (memory-mapped), so at most one group is
materialised at once, whatever the size of the shard files.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from safetensors import safe_open

from services.model_format.config import LlamaConfig
from services.model_format.groups import (
    LM_HEAD_WEIGHT,
    group_tensor_shapes,
    param_groups,
)

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"

# Buffers some older exports carry; they are recomputed, never loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# safetensors header dtype -> torch dtype (the ones a checkpoint of ours can hold).
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class CheckpointError(ValueError):
    """A checkpoint directory is incomplete or does not match its config."""


def load_config(path: str | Path) -> LlamaConfig:
    """Read and validate `config.json` of a checkpoint directory."""
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        raise FileNotFoundError(f"checkpoint config not found: {str(file)!r}")
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{str(file)!r} is not valid JSON: {exc}") from exc
    try:
        return LlamaConfig.from_hf_dict(raw)
    except ValueError as exc:
        raise CheckpointError(f"{str(file)!r}: {exc}") from exc


class Checkpoint:
    """An HF checkpoint directory: its config and where each tensor lives."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise FileNotFoundError(f"checkpoint directory not found: {str(self.path)!r}")
        self.config = load_config(self.path)
        self._locations = self._index_tensors()

    @property
    def tokenizer_path(self) -> Path:
        """Path of `tokenizer.json` (FileNotFoundError when absent)."""
        file = self.path / TOKENIZER_FILE
        if not file.is_file():
            raise FileNotFoundError(f"tokenizer not found: {str(file)!r}")
        return file

    def _index_tensors(self) -> dict[str, Path]:
        """Map tensor name -> shard file, from the index when sharded, else from file headers."""
        index = self.path / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{str(index)!r} has no valid weight_map: {exc!r}") from exc
            locations = {name: self.path / file for name, file in weight_map.items()}
            for file in sorted(set(locations.values())):
                if not file.is_file():
                    raise CheckpointError(f"shard {str(file)!r} named in {str(index)!r} is missing")
        else:
            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors weights in {str(self.path)!r}")
            locations = {}
            for file in files:
                with safe_open(str(file), framework="pt") as f:
                    for name in f.keys():
                        locations[name] = file
        # Drop recomputed buffers, and a duplicated lm_head when the config ties it to the
        # embedding (some exporters write both).
        return {
            name: file
            for name, file in locations.items()
            if not name.endswith(_IGNORED_SUFFIXES) and not (name == LM_HEAD_WEIGHT and self.config.tie_word_embeddings)
        }

    def tensor_names(self) -> list[str]:
        """Names of all tensors the checkpoint holds (after dropping ignored ones)."""
        return sorted(self._locations)

    def _files_of(self, group: str) -> tuple[dict[str, tuple[int, ...]], dict[Path, list[str]]]:
        """The group's expected tensor shapes (canonical order), and its tensor names by file."""
        expected = group_tensor_shapes(self.config, group)
        by_file: dict[Path, list[str]] = {}
        for name in expected:
            file = self._locations.get(name)
            if file is None:
                raise CheckpointError(
                    f"tensor {name!r} of group {group!r} is missing from checkpoint {str(self.path)!r}"
                )
            by_file.setdefault(file, []).append(name)
        return expected, by_file

    @staticmethod
    def _check_shape(name: str, file: Path, shape: Sequence[int], expected: tuple[int, ...]) -> None:
        if tuple(shape) != expected:
            raise CheckpointError(f"tensor {name!r} in {str(file)!r} has shape {tuple(shape)}, config says {expected}")

    def read_group(self, group: str, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Read one group's tensors, checking names and shapes against the config."""
        expected, by_file = self._files_of(group)
        tensors: dict[str, torch.Tensor] = {}
        for file, names in by_file.items():
            with safe_open(str(file), framework="pt") as f:
                for name in names:
                    tensor = f.get_tensor(name)
                    self._check_shape(name, file, tensor.shape, expected[name])
                    tensors[name] = tensor if dtype is None else tensor.to(dtype)
        # Return in the group's canonical order, whatever the shard order was.
        return {name: tensors[name] for name in expected}

    def group_meta(self, group: str) -> dict[str, torch.Tensor]:
        """One group's tensors as meta tensors (dtype and shape from the file headers, no data
        read), in the group's canonical order: enough to lay a group out before reading it."""
        expected, by_file = self._files_of(group)
        tensors: dict[str, torch.Tensor] = {}
        for file, names in by_file.items():
            with safe_open(str(file), framework="pt") as f:
                for name in names:
                    header = f.get_slice(name)
                    stored = _SAFETENSORS_DTYPES.get(header.get_dtype())
                    if stored is None:
                        raise CheckpointError(
                            f"tensor {name!r} in {str(file)!r} has unsupported dtype {header.get_dtype()!r}"
                        )
                    self._check_shape(name, file, header.get_shape(), expected[name])
                    tensors[name] = torch.empty(expected[name], dtype=stored, device="meta")
        return {name: tensors[name] for name in expected}

    def iter_groups(
        self, groups: Sequence[str] | None = None, dtype: torch.dtype | None = None
    ) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
        """Yield `(group, tensors)` in group order (or the order given), one group in memory at once.

        A tensor the config does not call for (a bias the config says the model lacks, a module
        this decoder does not have) is an error naming it, not silently dropped.
        """
        expected = {name for g in param_groups(self.config) for name in group_tensor_shapes(self.config, g)}
        unknown = sorted(name for name in self._locations if name not in expected)
        if unknown:
            raise CheckpointError(
                f"checkpoint {str(self.path)!r} holds tensors a {self.config.model_type!r} model with this "
                f"config.json does not have: {unknown[:5]!r}"
            )
        for group in groups if groups is not None else param_groups(self.config):
            yield group, self.read_group(group, dtype)


def iter_groups(
    path: str | Path, groups: Sequence[str] | None = None, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    """Yield `(group_name, {tensor_name: tensor})` of the checkpoint at `path`, in group order."""
    yield from Checkpoint(path).iter_groups(groups, dtype)
