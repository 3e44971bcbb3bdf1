"""Incremental detokenization and stop strings, with the real sparrow-tiny tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from sparrow.engine.detokenizer import IncrementalDetokenizer, TokenDecoder, find_stop_string
from sparrow.sampling_params import SamplingParams
from sparrow.tiny.tokenizer import IM_END, IM_START, build_tokenizer, load_tokenizer

MULTI_BYTE_TEXTS = [
    "Good morning ☀️ The coffee is ready ☕ 🍞🐦",
    "早上七点，城市慢慢醒来。麻雀在屋檐下叫个不停。",
    "日本語には、ひらがな、カタカナ、漢字があります 🎌",
    "서울의 아침은 바쁩니다 🚇 Crème brûlée à Łódź",
    "Unseen: 𝄞 ꙮ 👨‍👩‍👧 🇵🇹 Ω",
]


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    path: Path = tmp_path_factory.mktemp("detok_tokenizer")
    build_tokenizer(path)
    return load_tokenizer(path)


@pytest.fixture(scope="session")
def decoder(tokenizer) -> TokenDecoder:
    return TokenDecoder.from_tokenizer(tokenizer)


def stream(detokenizer: IncrementalDetokenizer, token_ids: list[int], chunk: int = 1) -> tuple[list[str], str | None]:
    """Feed ids ``chunk`` at a time as the output processor would, in DELTA mode; finish at the end."""
    deltas: list[str] = []
    stop_string = None
    for start in range(0, len(token_ids), chunk):
        finished = start + chunk >= len(token_ids)
        stop_string = detokenizer.update(token_ids[start:start + chunk], finished=finished) or stop_string
        deltas.append(detokenizer.get_next_output_text(finished or stop_string is not None, delta=True))
        if stop_string is not None:
            break
    return deltas, stop_string


@pytest.mark.parametrize("text", MULTI_BYTE_TEXTS)
def test_multi_byte_characters_are_never_split(tokenizer, decoder, text: str) -> None:
    ids = tokenizer.encode(text)
    # The case is only interesting if some token holds part of a character.
    assert any("\ufffd" in decoder.decode_token(token_id) for token_id in ids)
    deltas, _ = stream(IncrementalDetokenizer(decoder), ids)
    for delta in deltas:
        assert "\ufffd" not in delta
        delta.encode("utf-8")  # no lone surrogates either
    assert "".join(deltas) == tokenizer.decode(ids) == text


@pytest.mark.parametrize("chunk", [2, 3, 7])
def test_batches_of_tokens_give_the_same_text(tokenizer, decoder, chunk: int) -> None:
    text = " ".join(MULTI_BYTE_TEXTS)
    ids = tokenizer.encode(text)
    deltas, _ = stream(IncrementalDetokenizer(decoder), ids, chunk=chunk)
    assert all("\ufffd" not in delta for delta in deltas)
    assert "".join(deltas) == text


def test_an_incomplete_character_is_released_when_the_request_finishes(tokenizer, decoder) -> None:
    emoji_ids = tokenizer.encode("🐦")
    assert len(emoji_ids) > 1
    truncated = tokenizer.encode("ok ") + emoji_ids[:1]  # the bird's first bytes only
    detokenizer = IncrementalDetokenizer(decoder)
    detokenizer.update(truncated)
    assert detokenizer.output_text == "ok "
    detokenizer.update([], finished=True)
    assert detokenizer.output_text == tokenizer.decode(truncated)
    assert detokenizer.output_text.endswith("\ufffd")


def test_random_token_sequences_match_a_full_decode(tokenizer, decoder) -> None:
    # What a model with random weights produces: any id, including partial and invalid bytes.
    import random

    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(3, len(tokenizer)) for _ in range(rng.randrange(1, 60))]
        deltas, _ = stream(IncrementalDetokenizer(decoder), ids)
        assert "".join(deltas) == tokenizer.decode(ids)


def test_long_outputs_keep_a_bounded_window(tokenizer, decoder) -> None:
    ids = tokenizer.encode(" ".join(MULTI_BYTE_TEXTS * 40))
    detokenizer = IncrementalDetokenizer(decoder)
    longest_window = 0
    for token_id in ids:
        detokenizer.update([token_id])
        longest_window = max(longest_window, len(detokenizer._tokens))
    assert len(ids) > 1000 and longest_window < 64
    detokenizer.update([], finished=True)
    assert detokenizer.output_text == tokenizer.decode(ids)


def test_prompt_context_does_not_change_the_output_text(tokenizer, decoder) -> None:
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                           tokenize=False)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    output_ids = tokenizer.encode(" The sparrow 🐦 sings.")
    for skip in (True, False):
        detokenizer = IncrementalDetokenizer(decoder, prompt_token_ids=prompt_ids, skip_special_tokens=skip)
        stream(detokenizer, output_ids)
        assert detokenizer.output_text == " The sparrow 🐦 sings."


# -- special tokens ----------------------------------------------------------------------------
def test_special_tokens_are_skipped_or_kept(tokenizer, decoder) -> None:
    ids = tokenizer.encode(f"Hi{IM_END}there{IM_START}🐦")
    skipped, _ = stream(IncrementalDetokenizer(decoder, skip_special_tokens=True), ids)
    assert "".join(skipped) == "Hithere🐦" == tokenizer.decode(ids, skip_special_tokens=True)

    # A fast tokenizer (this one, and vLLM V1's detokenizer for it) puts no space around added
    # tokens, whatever spaces_between_special_tokens says: the text is Hugging Face's decode.
    for spaces in (True, False):
        kept, _ = stream(IncrementalDetokenizer(decoder, skip_special_tokens=False,
                                                spaces_between_special_tokens=spaces), ids)
        assert "".join(kept) == f"Hi{IM_END}there{IM_START}🐦" == tokenizer.decode(ids)


def test_a_slow_tokenizer_spaces_added_tokens(tokenizer) -> None:
    """The option keeps its meaning for a slow tokenizer (Hugging Face's Python decode)."""
    slow = TokenDecoder.from_tokenizer(tokenizer)
    slow.spaces_between_added = True
    ids = tokenizer.encode(f"Hi{IM_END}there")
    spaced, _ = stream(IncrementalDetokenizer(slow, skip_special_tokens=False), ids)
    assert "".join(spaced) == f"Hi {IM_END} there"


def test_eos_that_stopped_the_request_is_not_shown(tokenizer, decoder) -> None:
    period = tokenizer.encode(".")
    assert len(period) == 1
    ids = tokenizer.encode("The end") + period  # stopped by stop_token_ids=[period]
    hidden = IncrementalDetokenizer(decoder)
    hidden.update(ids, stop_terminated=True)
    assert hidden.output_text == "The end"
    shown = IncrementalDetokenizer(decoder, include_stop_str_in_output=True)
    shown.update(ids, stop_terminated=True)
    assert shown.output_text == "The end."
    assert hidden.num_output_tokens == shown.num_output_tokens == len(ids)


# -- stop strings ------------------------------------------------------------------------------
def spans_several_tokens(tokenizer, text: str, stop: str) -> bool:
    return not any(stop in tokenizer.decode([token_id]) for token_id in tokenizer.encode(text))


def test_stop_string_split_across_tokens(tokenizer, decoder) -> None:
    text = "The sparrow sings at dawn and sleeps at dusk."
    assert spans_several_tokens(tokenizer, text, "sings at")
    detokenizer = IncrementalDetokenizer(decoder, stop=["sings at"])
    deltas, stop_string = stream(detokenizer, tokenizer.encode(text))
    assert stop_string == "sings at"
    assert detokenizer.output_text == "The sparrow "
    # Streamed text never showed part of the stop string and was never taken back.
    assert "".join(deltas) == "The sparrow "
    # After the stop, more tokens change nothing.
    assert detokenizer.update(tokenizer.encode(" more")) is None
    assert detokenizer.output_text == "The sparrow "


def test_stop_string_kept_with_include_stop_str_in_output(tokenizer, decoder) -> None:
    text = "The sparrow sings at dawn."
    detokenizer = IncrementalDetokenizer(decoder, stop=["sings at"], include_stop_str_in_output=True)
    deltas, stop_string = stream(detokenizer, tokenizer.encode(text))
    assert stop_string == "sings at"
    assert detokenizer.output_text == "".join(deltas) == "The sparrow sings at"


@pytest.mark.parametrize(
    ("text", "stop", "expected"),
    [
        ("早上七点，城市慢慢醒来。", "城市", "早上七点，"),  # "城" itself is split in two tokens
        ("麻雀在屋檐下叫 🐦🐦 咕咕", "🐦🐦", "麻雀在屋檐下叫 "),
    ],
)
def test_multi_byte_stop_string_split_across_tokens(tokenizer, decoder, text, stop, expected) -> None:
    assert spans_several_tokens(tokenizer, text, stop)
    detokenizer = IncrementalDetokenizer(decoder, stop=[stop])
    deltas, stop_string = stream(detokenizer, tokenizer.encode(text))
    assert stop_string == stop and "".join(deltas) == expected


def test_earliest_stop_string_wins_within_one_batch(tokenizer, decoder) -> None:
    detokenizer = IncrementalDetokenizer(decoder, stop=["dusk", "dawn"])
    stop_string = detokenizer.update(tokenizer.encode("Up at dawn, asleep at dusk."))
    assert stop_string == "dawn"
    assert detokenizer.output_text == "Up at "


def test_stop_strings_wait_for_min_tokens(tokenizer, decoder) -> None:
    ids = tokenizer.encode("a b a b a b")
    detokenizer = IncrementalDetokenizer(decoder, stop=["a"], min_tokens=3)
    _, stop_string = stream(detokenizer, ids)
    assert stop_string == "a"
    # Tokens are "a", " b", " a", ...: the "a"s of tokens 1 and 3 come within min_tokens=3, so
    # the stop string first counts at token 5.
    assert detokenizer.output_text == "a b a b "


def test_stream_holds_back_a_possible_stop_string_prefix(tokenizer, decoder) -> None:
    detokenizer = IncrementalDetokenizer(decoder, stop=["STOP!"])
    detokenizer.update(tokenizer.encode("one two ST"))
    assert detokenizer.get_next_output_text(False, delta=False) == "one tw"  # last 4 chars held
    assert detokenizer.get_next_output_text(True, delta=False) == "one two ST"


def test_from_sampling_params(tokenizer, decoder) -> None:
    params = SamplingParams(stop="dawn", include_stop_str_in_output=True, skip_special_tokens=False)
    detokenizer = IncrementalDetokenizer.from_sampling_params(decoder, params)
    assert detokenizer.update(tokenizer.encode(f"at dawn{IM_END}")) == "dawn"
    assert detokenizer.output_text == "at dawn"


@pytest.mark.parametrize(
    ("text", "num_new", "stop", "include", "expected"),
    [
        ("hello world", 5, ["wor"], False, ("wor", 6)),
        ("hello world", 5, ["wor"], True, ("wor", 9)),
        ("hello world", 2, ["hello"], False, None),  # ended before the new characters
        ("hello world", 3, ["o w", "rld"], False, ("rld", 8)),  # "o w" ends before the last 3
        ("hello world", 5, ["rld", "o w"], False, ("o w", 4)),  # earliest start wins
        ("abc", 3, [], False, None),
    ],
)
def test_find_stop_string(text, num_new, stop, include, expected) -> None:
    assert find_stop_string(text, num_new, stop, include) == expected
