"""The engine's limits that both the worker's configuration (`WorkerConfig`, what operators set)
and the engine's own (`EngineConfig`, what the engine runs with) carry: one default per field,
and the cross-field rule both check, so that the worker refuses a bad pair when it parses its
flags rather than after a model has loaded."""

from __future__ import annotations

MAX_BATCH_SIZE = 32  # most requests in one iteration
MAX_NUM_TOKENS = 2048  # most tokens (prompt + decode) in one iteration
BLOCK_SIZE = 16  # tokens per KV block


def check_token_budget(max_num_tokens: int, max_batch_size: int) -> None:
    """A full batch of decodes (one token each) must fit one iteration."""
    if max_num_tokens < max_batch_size:
        raise ValueError(f"max_num_tokens ({max_num_tokens}) must be >= max_batch_size ({max_batch_size})")
