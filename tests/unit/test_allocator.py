"""The engine's malloc settings: applied once, and large blocks reused instead of re-faulted."""

from __future__ import annotations

import resource
import subprocess
import sys
import textwrap

import pytest

from services.worker.engine import allocator


def _faults_per_alloc(tuned: bool) -> float:
    """Minor page faults per pass of a 1,024-token MLP of the default model's shapes (outputs of
    12.6, 6.3 and 2.4 MB), in a fresh interpreter (malloc settings are process-wide)."""
    code = textwrap.dedent(
        f"""
        import resource, torch
        from concurrent.futures import ThreadPoolExecutor
        from services.worker.engine import allocator
        from services.worker.model.llama import Linear
        if {tuned}:
            assert allocator.tune_allocator()

        def run():  # as the engine runs its steps: on a compute thread with a 2-thread team
            torch.set_num_threads(2)
            gate_up = Linear(torch.randn(3072, 576), pack=True)
            down = Linear(torch.randn(576, 1536), pack=True)

            def mlp(x):  # the MLP's GEMMs of a 1,024-token prefill step of the default model
                return down(gate_up(x)[:, :1536].contiguous())

            x = torch.randn(1024, 576)
            for _ in range(3):
                x = mlp(x)
            r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            for _ in range(10):
                x = mlp(x)
            return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0) / 10

        print(ThreadPoolExecutor(1).submit(run).result())
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    return float(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings")
def test_tuned_malloc_reuses_large_blocks_instead_of_faulting_them_in_again() -> None:
    assert resource.getpagesize() > 0
    default, tuned = _faults_per_alloc(False), _faults_per_alloc(True)
    # Untuned, glibc maps and unmaps the large outputs around every pass (134 faults per pass on
    # the development box); tuned, heap blocks are reused (none).
    assert tuned < default / 4, (default, tuned)


def test_tuning_is_applied_once_per_process() -> None:
    first = allocator.tune_allocator()
    assert allocator.tune_allocator() is first
