"""Sampling parameters validation and the per-request sampler."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from services.worker.engine.sampling import SamplingParams, TokenHistory, sample


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
        ({"presence_penalty": 2.5}, "2.5"),
        ({"frequency_penalty": -3}, "-3"),
        ({"frequency_penalty": float("inf")}, "inf"),
        ({"repetition_penalty": 0.0}, "0.0"),
        ({"logit_bias": {7: 101}}, "101"),
        ({"logit_bias": {-1: 1}}, "-1"),
        ({"logit_bias": {"7": 1}}, "'7'"),
        ({"logprobs": 21}, "21"),
        ({"prompt_logprobs": -1}, "-1"),
        ({"logprobs": True}, "True"),
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
    tokens, logprobs, _ = sample(logits, params, [p.make_generator() for p in params])
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


def test_penalties_match_a_hand_computation() -> None:
    """vLLM's order: logit_bias, repetition (prompt + output), frequency and presence (output)."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    p = SamplingParams(
        temperature=0,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        repetition_penalty=2.0,
        logit_bias={5: 10.0, 3: -1.5},
    )
    history = TokenHistory(p, prompt=[1, 4], vocab_size=6)
    for token in (0, 0, 2):  # generated so far: token 0 twice, token 2 once
        history.add(token)
    got = history.apply(logits[0])
    expected = [
        2.0 / 2 - 0.25 * 2 - 0.5,  # generated twice: divided (positive), two frequencies, presence
        -1.0 * 2,  # in the prompt only: multiplied (negative), no frequency or presence
        0.5 / 2 - 0.25 - 0.5,  # generated once
        3.0 - 1.5,  # bias only; never seen
        -2.0 * 2,  # in the prompt
        1.0 + 10.0,  # bias only
    ]
    torch.testing.assert_close(got, torch.tensor(expected))
    assert torch.equal(logits, torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]]))  # input untouched
    # Greedy picks from the processed logits; the reported log-prob is the raw model's.
    tokens, logprobs, _ = sample(logits, [p], [None], [history])
    assert tokens == [5]
    assert logprobs[0] == pytest.approx(float(torch.log_softmax(logits, -1)[0, 5]))


def test_logit_bias_forces_and_bans_tokens_under_sampling() -> None:
    logits = _logits(1, vocab=50, seed=3)
    banned = int(logits.argmax())
    force = SamplingParams(temperature=1.0, seed=5, logit_bias={17: 100.0})
    ban = SamplingParams(temperature=0, logit_bias={banned: -100.0})
    gens = [force.make_generator(), None]
    hist = [TokenHistory.create(q, [1], 50) for q in (force, ban)]
    for _ in range(20):
        tokens, _, _ = sample(torch.cat([logits, logits]), [force, ban], gens, hist)
        assert tokens[0] == 17 and tokens[1] != banned
    with pytest.raises(ValueError, match="logit_bias token id 50 "):
        TokenHistory(SamplingParams(logit_bias={50: 1.0}), [1], 50)


def test_frequency_penalty_discourages_repeats_over_a_run() -> None:
    # Flat logits: greedy would repeat token 0 forever; a frequency penalty walks through the vocab.
    logits = torch.zeros(1, 5)
    p = SamplingParams(temperature=0, frequency_penalty=1.0)
    history = TokenHistory(p, [0], 5)
    picked = []
    for _ in range(5):
        token = sample(logits, [p], [None], [history]).tokens[0]
        history.add(token)
        picked.append(token)
    assert sorted(picked) == [0, 1, 2, 3, 4]


def test_greedy_without_options_is_bit_identical_to_argmax() -> None:
    logits = _logits(6, vocab=300, seed=11)
    params = [SamplingParams(temperature=0)] * 6
    out = sample(logits, params, [None] * 6, [None] * 6)
    assert out.tokens == logits.argmax(-1).tolist()
    assert out.logprobs == torch.log_softmax(logits, -1).gather(1, logits.argmax(-1, keepdim=True)).squeeze(1).tolist()
    # A batch-mate with penalties leaves the other rows' picks and log-probs exactly as they were.
    mixed = [SamplingParams(temperature=0, repetition_penalty=1.3, logit_bias={4: 3.0}), *params[1:]]
    hist = [TokenHistory.create(q, [1, 2, 3], 300) for q in mixed]
    other = sample(logits, mixed, [None] * 6, hist)
    assert other.tokens[1:] == out.tokens[1:] and other.logprobs[1:] == out.logprobs[1:]


def test_top_logprobs_are_sorted_and_hold_the_chosen_token() -> None:
    logits = _logits(3, vocab=40, seed=4)
    params = [
        SamplingParams(temperature=0, logprobs=5),
        SamplingParams(temperature=0.8, seed=3, logprobs=0),
        SamplingParams(temperature=0, logprobs=20),
    ]
    out = sample(logits, params, [p.make_generator() for p in params])
    raw = torch.log_softmax(logits, -1)
    assert [len(t) for t in out.top_logprobs] == [5, 0, 20]
    for row in (0, 2):
        top = out.top_logprobs[row]
        values = [lp for _, lp in top]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        assert top[0] == (out.tokens[row], out.logprobs[row])  # greedy: the chosen one leads
        for token, lp in top:
            assert lp == pytest.approx(float(raw[row, token]))
        assert values[-1] >= float(raw[row].sort(descending=True).values[len(top)])
    assert all(lp <= 0 and math.isfinite(lp) for lp in out.logprobs)


def test_seeded_choices_reproduce_and_differ_by_seed() -> None:
    """What n > 1 relies on: seed + i gives choice i the same tokens on every run."""
    logits = _logits(1, vocab=50, seed=8)

    def run(seed: int) -> list[int]:
        p = SamplingParams(temperature=1.0, seed=seed, presence_penalty=0.5)
        gen, hist = p.make_generator(), TokenHistory(p, [1], 50)
        out = []
        for _ in range(12):
            token = sample(logits, [p], [gen], [hist]).tokens[0]
            hist.add(token)
            out.append(token)
        return out

    choices = [run(100 + i) for i in range(3)]
    assert [run(100 + i) for i in range(3)] == choices
    assert len({tuple(c) for c in choices}) == 3
