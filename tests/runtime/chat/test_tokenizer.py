"""Tokenizer wrapper: special ids by spelling, decode round trips, streaming-safe detokenization."""

from __future__ import annotations

import random

import pytest

from megagraph.runtime.chat import SPECIAL, Tokenizer

from .conftest import dr

TEXTS = [
    "Hello, world! The weather in Paris is 21 °C.",
    "中文测试：天气很好。日本語のテキスト。한국어 텍스트.",
    "emoji 🎉🚀👩‍👩‍👧‍👦 and flags 🇫🇷🇯🇵, math ∑∫√, accents é è ñ ü",
    "code:\n    def f(x):\n        return x ** 2  # comment\n\n\n",
    "<think>literal markup</think> <｜DSML｜ calls> and ｜DSML｜ inside text",
]


def test_special_spellings_match_recipe():
    names = {"bos": "Bos", "eos": "Eos", "think_start": "ThinkingStart", "think_end": "ThinkingEnd",
             "system": "System", "user": "User", "assistant": "Assistant",
             "latest_reminder": "LatestReminder", "dsml": "Dsml"}
    for key, attr in names.items():
        assert SPECIAL[key] == getattr(dr.SpecialToken, attr).default_str()


def test_special_ids_looked_up(tok):
    sp = tok.special
    assert (sp.bos, sp.eos) == (0, 1)
    assert tok.decode([sp.think_end]) == "</think>"
    assert tok.decode([sp.dsml]) == "｜DSML｜"
    assert tok.decode([sp.user, sp.assistant]) == "<｜User｜><｜Assistant｜>"
    assert sp.system is None  # the V4 vocab has no <｜System｜>
    with pytest.raises(KeyError, match="System"):
        tok.token_id("<｜System｜>")
    assert sp.eos in tok.stream_skip_ids and sp.bos in tok.stream_skip_ids
    assert not {sp.think_start, sp.think_end, sp.dsml} & tok.stream_skip_ids


def test_round_trip_and_bytes(tok):
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert b"".join(tok.token_bytes(i) for i in ids).decode("utf-8") == text
    vocab = tok.encoded_vocab()
    assert len(vocab) == tok.vocab_size == 129280 and all(vocab)


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_one_token_at_a_time(tok, text):
    ids = tok.encode(text)
    det = tok.detokenizer()
    pieces = [det.push(i) for i in ids] + [det.flush()]
    assert "".join(pieces) == text == det.text
    assert all("\ufffd" not in p for p in pieces)


def test_emoji_split_across_tokens_is_held(tok):
    text = "a🦩b"  # a rare emoji: byte-level BPE splits its 4 bytes over several tokens
    ids = tok.encode(text)
    partial = [i for i in ids if not _decodes_alone(tok, i)]
    assert partial, "expected at least one token holding part of a UTF-8 character"
    det = tok.detokenizer()
    outs = [det.push(i) for i in ids]
    assert "".join(outs) == text
    assert "" in outs  # some step had to wait for the rest of the character
    assert all("\ufffd" not in o for o in outs)


def _decodes_alone(tok, i):
    try:
        tok.token_bytes(i).decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_incremental_matches_hf_on_random_ids(tok):
    rng = random.Random(0)
    det_ids = [rng.randrange(0, 128000) for _ in range(3000)]
    det = tok.detokenizer(skip_ids=())
    for k in range(0, len(det_ids), 7):
        det.push(det_ids[k:k + 7])
    det.flush()
    assert det.text == tok.decode(det_ids)


def test_skips_eos_keeps_markup(tok):
    sp = tok.special
    ids = tok.encode("hi") + [sp.think_end] + tok.encode("ok") + [sp.eos]
    det = tok.detokenizer()
    assert det.push(ids) + det.flush() == "hi</think>ok"


def test_window_fallback_when_decoder_is_not_byte_level(tok):
    t2 = Tokenizer.from_file(tok.path)
    t2.__dict__["_byte_level"] = False  # force the generic re-decode path
    for text in TEXTS:
        det = t2.detokenizer()
        out = "".join(det.push(i) for i in t2.encode(text)) + det.flush()
        assert out == text
