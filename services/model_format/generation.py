"""What a checkpoint says about generation: the token ids that end it.

A chat model often ends a turn with a token other than its config's `eos_token_id` (SmolLM2 and
Qwen2 end turns with `<|im_end|>`, Llama 3 with `<|eot_id|>`), and declares that in
`generation_config.json` or as its tokenizer's EOS token. Generation must stop on all of them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from services.model_format.tokenizer import TOKENIZER_FILE, TOKENIZER_FILES, Tokenizer

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
# Every file `eos_token_ids` reads.
EOS_FILES = (CONFIG_FILE, GENERATION_CONFIG_FILE, *TOKENIZER_FILES)


def eos_token_ids(files: Mapping[str, bytes], tokenizer: Tokenizer | None = None) -> frozenset[int]:
    """Every EOS id a checkpoint declares, from its side files (name -> bytes).

    The union of `eos_token_id` in `config.json` and in `generation_config.json` (an int or a list of
    ints in either) and the id of the tokenizer's EOS token (`tokenizer`, if already built from the
    same files, else one built here). Missing files contribute nothing; a malformed value is a
    ValueError naming the file and quoting the value.
    """
    ids: set[int] = set()
    for name in (CONFIG_FILE, GENERATION_CONFIG_FILE):
        data = files.get(name)
        if data is not None:
            ids |= _declared_ids(name, _json_object(name, data).get("eos_token_id"))
    if tokenizer is None and TOKENIZER_FILE in files:
        tokenizer = Tokenizer.from_files(files)
    if tokenizer is not None:
        eos = tokenizer.eos_token_id
        if eos is not None:
            ids.add(eos)
    return frozenset(ids)


def eos_token_ids_in(directory: str | Path) -> frozenset[int]:
    """`eos_token_ids` of a checkpoint directory."""
    path = Path(directory)
    return eos_token_ids({name: (path / name).read_bytes() for name in EOS_FILES if (path / name).is_file()})


def _json_object(name: str, data: bytes) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except ValueError as e:
        raise ValueError(f"{name} is not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise ValueError(f"{name} must hold a JSON object, got {type(value).__name__}")
    return value


def _declared_ids(name: str, value: Any) -> set[int]:
    if value is None:
        return set()
    values = value if isinstance(value, list) else [value]
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int) or v < 0]
    if bad or not values:
        raise ValueError(f"{name} eos_token_id must be a token id or a non-empty list of them, got {value!r}")
    return set(values)
