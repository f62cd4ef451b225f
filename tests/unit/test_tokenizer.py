"""Tokenizer wrapper: round trips, streaming detokenization, stop strings, chat template."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from services.model_format import synth
from services.model_format.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer, find_stop

TEXTS = [
    "Hello world, the model serves tokens.",
    "Grüße aus 東京! naïve café → 5 €, 😀 and 𝄞 (a character the corpus never saw).",
    "  leading spaces, tabs\tand\nnew lines  ",
    "日本語のテキストと数据",
    "",
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer(synth.synthesize(tmp_path_factory.mktemp("tok") / "tiny", "tiny", seed=0))


def test_vocab_and_special_tokens(tok: Tokenizer) -> None:
    assert tok.vocab_size == synth.PRESETS["tiny"].vocab_size
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert tok.byte_level
    assert {1, 2} <= tok.special_token_ids


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids) == text
    assert tok.encode(text, add_special_tokens=False) == ids[1:]


def test_bpe_actually_merges(tok: Tokenizer) -> None:
    text = "the people have the water"
    assert len(tok.encode(text, add_special_tokens=False)) < len(text) / 2


def test_special_token_text_in_input_is_plain_text(tok: Tokenizer) -> None:
    ids = tok.encode("stop here </s> <s>", add_special_tokens=False)
    assert tok.eos_token_id not in ids and tok.bos_token_id not in ids
    assert tok.decode(ids) == "stop here </s> <s>"


def _stream(tok: Tokenizer, ids: list[int], byte_level: bool) -> list[str]:
    detok = IncrementalDetokenizer(tok, byte_level=byte_level)
    return [*(detok.add(i) for i in ids), detok.flush()]


@pytest.mark.parametrize("byte_level", [True, False], ids=["byte-path", "window-path"])
@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenizer_equals_full_decode(tok: Tokenizer, text: str, byte_level: bool) -> None:
    ids = [tok.bos_token_id, *tok.encode(text, add_special_tokens=False), tok.eos_token_id]
    deltas = _stream(tok, ids, byte_level)
    assert "".join(deltas) == tok.decode(ids) == text
    # Valid text never shows a half character, even where a token ends mid-character.
    assert all("\ufffd" not in d for d in deltas)


def test_characters_split_across_tokens_are_held_back(tok: Tokenizer) -> None:
    ids = tok.encode("a𝄞b", add_special_tokens=False)  # 𝄞 is 4 bytes the corpus never merged
    assert len(ids) >= 4
    detok = tok.incremental_detokenizer()
    deltas = [detok.add(i) for i in ids]
    assert deltas[0] == "a" and "" in deltas and "𝄞" in deltas
    assert "".join(deltas) + detok.flush() == "a𝄞b"


def test_flush_emits_replacement_for_a_truncated_character(tok: Tokenizer) -> None:
    ids = tok.encode("x𝄞", add_special_tokens=False)[:-1]
    detok = tok.incremental_detokenizer()
    text = "".join(detok.add(i) for i in ids) + detok.flush()
    assert text == tok.decode(ids) and text.startswith("x") and text.endswith("\ufffd")


def test_random_token_streams_match_full_decode(tok: Tokenizer) -> None:
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 40))]
        detok = tok.incremental_detokenizer()
        streamed = "".join(detok.add(i) for i in ids) + detok.flush()
        assert streamed == tok.decode(ids)


# ---- stop strings ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "stops", "emitted", "expected"),
    [
        ("Hello world", [], 0, ("Hello world", False)),
        ("Hello wor", ["world"], 0, ("Hello ", False)),  # "wor" may become "world"
        ("Hello world!", ["world"], 0, ("Hello ", True)),
        ("Hello world!", ["world"], 6, ("", True)),
        ("a STOP b END", ["END", "STOP"], 0, ("a ", True)),  # earliest match wins
        ("abcab", ["abd"], 0, ("abc", False)),
        ("xxab", ["abd", "b"], 2, ("a", True)),
        ("no match here", ["zzz"], 2, (" match here", False)),
        ("the end", ["end"], 4, ("", True)),
    ],
)
def test_find_stop(text: str, stops: list[str], emitted: int, expected: tuple[str, bool]) -> None:
    assert find_stop(text, stops, emitted) == expected


def test_stop_matcher_never_emits_the_stop_string() -> None:
    rng = random.Random(1)
    for _ in range(200):
        stop = rng.choice(["STOP", "ab", "\n\n", "aba"])
        body = "".join(rng.choice("abST OP\n") for _ in range(rng.randint(0, 30)))
        matcher = StopStringMatcher([stop])
        out = ""
        i = 0
        while i < len(body) and not matcher.stopped:
            n = rng.randint(1, 4)
            out += matcher.feed(body[i : i + n])[0]
            i += n
        out += matcher.flush()
        cut = body.find(stop)
        assert out == (body if cut < 0 else body[:cut])


def test_stop_matcher_holds_back_then_releases() -> None:
    m = StopStringMatcher(["</end>"])
    assert m.feed("result </") == ("result ", False)
    assert m.feed("e") == ("", False)
    assert m.feed("x") == ("</ex", False)
    assert m.feed(" </en") == (" ", False)
    assert m.flush() == "</en"
    with pytest.raises(ValueError, match="''"):
        StopStringMatcher([""])


# ---- chat template -----------------------------------------------------------------------------

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say hi."},
]


def test_chat_template(tok: Tokenizer) -> None:
    assert tok.apply_chat_template(MESSAGES) == ("<|system|>\nYou are terse.\n<|user|>\nSay hi.\n<|assistant|>\n")
    assert tok.apply_chat_template(MESSAGES, add_generation_prompt=False).endswith("Say hi.\n")
    with pytest.raises(ValueError, match="'bad role'"):
        tok.apply_chat_template([{"role": "bad role", "content": "x"}])
    with pytest.raises(ValueError, match="NoneType"):
        tok.apply_chat_template([{"role": "user", "content": None}])


def test_transformers_reads_the_same_tokenizer_and_template(tok: Tokenizer) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(Path(tok.path).parent))
    for text in TEXTS:
        assert hf(text)["input_ids"] == tok.encode(text)
    rendered = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert rendered == tok.apply_chat_template(MESSAGES)
