"""Sampling parameters validation and the per-request sampler."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from services.worker.engine.sampling import SamplingParams, sample


@pytest.mark.parametrize(
    ("kwargs", "quoted"),
    [
        ({"temperature": -0.5}, "-0.5"),
        ({"temperature": float("nan")}, "nan"),
        ({"top_p": 0.0}, "0.0"),
        ({"top_p": 1.5}, "1.5"),
        ({"top_k": -2}, "-2"),
        ({"top_k": 2.5}, "2.5"),
        ({"max_tokens": 0}, "0"),
        ({"stop_token_ids": (3, -1)}, "-1"),
        ({"seed": "7"}, "'7'"),
        ({"seed": 2**64}, str(2**64)),
        ({"ignore_eos": 1}, "1"),
    ],
)
def test_params_reject_bad_values_quoting_them(kwargs: dict[str, Any], quoted: str) -> None:
    with pytest.raises(ValueError, match=quoted):
        SamplingParams(**kwargs)


def test_params_defaults_and_normalisation() -> None:
    p = SamplingParams(stop_token_ids=[5, 6])  # type: ignore[arg-type]
    assert p.stop_token_ids == (5, 6) and not p.greedy
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=0).make_generator() is None


def _logits(rows: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_and_degenerate_filters_pick_the_argmax() -> None:
    logits = _logits(4)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, top_k=1, seed=1),
        SamplingParams(temperature=1.0, top_p=1e-6, seed=2),
        SamplingParams(temperature=1e-4, seed=3),
    ]
    tokens, logprobs = sample(logits, params, [p.make_generator() for p in params])
    assert tokens == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1).gather(1, logits.argmax(-1, keepdim=True)).squeeze(1)
    torch.testing.assert_close(torch.tensor(logprobs), expected)


def test_seeded_rows_do_not_depend_on_batch_neighbours() -> None:
    row = _logits(1, seed=9)
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=1234)

    def draw(batch: torch.Tensor, index: int, others: list[SamplingParams]) -> list[int]:
        params = [*others[:index], p, *others[index:]]
        gens = [q.make_generator() for q in params]
        out = []
        for _ in range(20):  # 20 consecutive draws from the same generator
            out.append(sample(batch, params, gens)[0][index])
        return out

    alone = draw(row, 0, [])
    crowd = torch.cat([_logits(2, seed=1), row, _logits(3, seed=2)])
    others = [SamplingParams(temperature=0.7, seed=s) for s in range(4)] + [SamplingParams(temperature=0)]
    assert draw(crowd, 2, others) == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=4321)
    gen = other_seed.make_generator()
    assert [sample(row, [other_seed], [gen])[0][0] for _ in range(20)] != alone


def test_top_k_and_top_p_restrict_the_support() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, -10.0, -10.0]])
    k2 = SamplingParams(temperature=5.0, top_k=2, seed=0)
    gen = k2.make_generator()
    assert {sample(logits, [k2], [gen])[0][0] for _ in range(200)} == {0, 1}
    # Probabilities ~ [0.665, 0.245, 0.090, ...]: top_p 0.8 keeps exactly the first two.
    p8 = SamplingParams(temperature=1.0, top_p=0.8, seed=0)
    gen = p8.make_generator()
    assert {sample(logits, [p8], [gen])[0][0] for _ in range(300)} == {0, 1}


def test_sample_checks_shapes() -> None:
    with pytest.raises(ValueError, match=r"\(2, 50\)"):
        sample(_logits(2), [SamplingParams()], [None])
