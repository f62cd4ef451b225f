"""One spawned process per argument tuple, each with its own pipe (UCX allows one worker per
process): the tests that put each instance of a group in a process of its own share this."""

from __future__ import annotations

import contextlib
import multiprocessing
from collections.abc import Callable, Iterator, Sequence
from typing import Any


@contextlib.contextmanager
def spawned(target: Callable[..., None], args: Sequence[tuple[Any, ...]]) -> Iterator[list[Any]]:
    """Start `target(*a, child_end)` for each `a` of `args` (spawn context, daemons); yields the
    parent ends of their pipes. On the way out each process is joined, and killed if it is still
    alive after 10 s."""
    ctx = multiprocessing.get_context("spawn")
    pipes = [ctx.Pipe() for _ in args]
    procs = [
        ctx.Process(target=target, args=(*a, child), daemon=True) for a, (_, child) in zip(args, pipes, strict=True)
    ]
    for p in procs:
        p.start()
    try:
        yield [parent for parent, _ in pipes]
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
