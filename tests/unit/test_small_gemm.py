"""The decode-sized GEMM (float32 at AVX-512 and AVX2, and bfloat16 where the CPU has
AVX512-BF16), at every level this CPU runs: against a float32 matmul of the same operands, a row's
result independent of the rows beside it, and `Linear` routing a decode step's rows to it and a
prefill's to oneDNN with results that agree."""

from __future__ import annotations

import pytest
import torch

from services.worker.model import small_gemm
from services.worker.model.llama import Linear


@pytest.fixture
def level(kernel_isa: str) -> str:
    if kernel_isa not in small_gemm.LEVELS:
        pytest.skip(f"the small GEMM has no {kernel_isa} path (levels: {', '.join(small_gemm.LEVELS)})")
    return kernel_isa


def _kernel(dtype: torch.dtype) -> small_gemm.SmallGemm:
    kernel = small_gemm.small_gemm()
    assert kernel is not None
    if dtype == torch.bfloat16 and not kernel.bf16:
        pytest.skip("no AVX512-BF16 at this level on this CPU")
    return kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 16, 17, 31, 32])
def test_matches_a_float32_matmul_of_the_same_operands(level: str, rows: int, dtype: torch.dtype) -> None:
    kernel = _kernel(dtype)
    g = torch.Generator().manual_seed(rows)
    n, k = 16 * 37, 576  # an odd number of 16-column blocks
    w = torch.randn(n, k, generator=g).to(dtype)
    x = torch.randn(rows, k + 8, generator=g).to(dtype)[:, 4 : 4 + k]  # strided rows
    got = kernel(x, kernel.pack(w), n)
    want = x.double() @ w.double().T
    assert got.dtype == dtype and got.shape == (rows, n)
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    else:
        # Rounded once to bfloat16: within half an ulp of bfloat16 (2^-9 relative) plus noise.
        torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=1e-3)
        unrounded = kernel(x, kernel.pack(w), n, torch.float32)
        torch.testing.assert_close(unrounded.double(), want, rtol=1e-5, atol=1e-4)


def test_bad_input_is_refused_naming_it(level: str) -> None:
    kernel = _kernel(torch.float32)
    with pytest.raises(ValueError, match=r"\(20, 576\)"):
        kernel.pack(torch.zeros(20, 576))
    packed = kernel.pack(torch.zeros(32, 576))
    with pytest.raises(ValueError, match="float64"):
        kernel(torch.zeros(2, 576, dtype=torch.float64), packed, 32)
    with pytest.raises(ValueError, match="weight of 48"):
        kernel(torch.zeros(2, 576), packed, 48)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_sends_decode_rows_here_and_prefill_rows_to_onednn_with_agreeing_results(
    level: str, dtype: torch.dtype
) -> None:
    _kernel(dtype)
    g = torch.Generator().manual_seed(7)
    w = torch.randn(960, 576, generator=g).to(dtype)
    lin = Linear(w, pack=True)
    x = torch.randn(64, 576, generator=g).to(dtype)
    prefill = lin(x)  # 64 rows: above MAX_ROWS, the oneDNN path
    decode = torch.cat([lin(x[i : i + 4]) for i in range(0, 64, 4)])  # 4 rows at a time: here
    assert lin._pairs is not None
    # The same exact products summed in float32 in another order, each rounded once: at most
    # one bfloat16 ulp apart.
    torch.testing.assert_close(decode.float(), prefill.float(), rtol=2**-7, atol=1e-2)
    with_bias = Linear(w, pack=True, bias=torch.zeros(960, dtype=dtype))
    assert with_bias._pairs is None  # a bias keeps the oneDNN path


@pytest.mark.parametrize("rows", [3, 9, 32])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(level: str, rows: int) -> None:
    """Batch invariance, which greedy exactness across batch sizes rests on: each row alone gives
    bit for bit what it gives inside a batch of `rows` (every tile shape sums in K order)."""
    kernel = _kernel(torch.float32)
    g = torch.Generator().manual_seed(11)
    n, k = 16 * 5, 576
    w = torch.randn(n, k, generator=g)
    packed = kernel.pack(w)
    x = torch.randn(rows, k, generator=g)
    batch = kernel(x, packed, n)
    alone = torch.cat([kernel(x[i : i + 1], packed, n) for i in range(rows)])
    assert torch.equal(batch, alone)
