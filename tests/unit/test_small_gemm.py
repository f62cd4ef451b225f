"""The decode-sized bfloat16 GEMM: against a float32 matmul of the same operands, and `Linear`
routing a decode step's rows to it and a prefill's to oneDNN with results that agree."""

from __future__ import annotations

import pytest
import torch

from services.worker.model import small_gemm
from services.worker.model.llama import Linear

pytestmark = pytest.mark.skipif(small_gemm.small_gemm() is None, reason="no AVX512-BF16 (or no C compiler) here")


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 16, 17, 31, 32])
def test_matches_a_float32_matmul_of_the_same_bfloat16_operands(rows: int) -> None:
    kernel = small_gemm.small_gemm()
    assert kernel is not None
    g = torch.Generator().manual_seed(rows)
    n, k = 16 * 37, 576  # an odd number of 16-column blocks
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, k + 8, generator=g).to(torch.bfloat16)[:, 4 : 4 + k]  # strided rows
    got = kernel(x, kernel.pack(w), n)
    want = x.float() @ w.float().T
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    # Rounded once to bfloat16: within half an ulp of bfloat16 (2^-9 relative) plus float32 noise.
    torch.testing.assert_close(got.float(), want, rtol=2**-8, atol=1e-3)


def test_bad_input_is_refused_naming_it() -> None:
    kernel = small_gemm.small_gemm()
    assert kernel is not None
    with pytest.raises(ValueError, match=r"\(20, 576\)"):
        kernel.pack(torch.zeros(20, 576, dtype=torch.bfloat16))
    packed = kernel.pack(torch.zeros(32, 576, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="float32"):
        kernel(torch.zeros(2, 576), packed, 32)


def test_linear_sends_decode_rows_here_and_prefill_rows_to_onednn_with_agreeing_results() -> None:
    g = torch.Generator().manual_seed(7)
    w = torch.randn(960, 576, generator=g).to(torch.bfloat16)
    lin = Linear(w, pack=True)
    x = torch.randn(64, 576, generator=g).to(torch.bfloat16)
    prefill = lin(x)  # 64 rows: above MAX_ROWS, the oneDNN path
    decode = torch.cat([lin(x[i : i + 4]) for i in range(0, 64, 4)])  # 4 rows at a time: here
    assert lin._pairs is not None
    # The same exact products summed in float32 in another order, each rounded once: at most
    # one bfloat16 ulp apart.
    torch.testing.assert_close(decode.float(), prefill.float(), rtol=2**-7, atol=1e-2)
    with_bias = Linear(w, pack=True, bias=torch.zeros(960, dtype=torch.bfloat16))
    assert with_bias._pairs is None  # a bias keeps the oneDNN path
