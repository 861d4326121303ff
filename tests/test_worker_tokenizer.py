"""Byte tokenizer, incremental detokenization and output processing (stop rules, hold-back)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from server.worker import output
from server.worker.output import Delta, OutputProcessor, SamplingParams
from server.worker.tokenizer import ByteTokenizer, IncrementalDetokenizer, Tokenizer


def merge_deltas(deltas: list[Delta]) -> dict[str, Any]:
    """Text, ids, logprobs and finish reason of a whole (non-streamed) completion: its deltas joined
    (only these tests need it; the worker builds its answers in server/worker/responses.py)."""
    return {
        "text": "".join(d.text for d in deltas),
        "token_ids": [t for d in deltas for t in d.token_ids],
        "logprobs": [lp for d in deltas for lp in d.logprobs],
        "finish_reason": deltas[-1].finish_reason if deltas else None,
    }


TOK = ByteTokenizer()
EOS, END = TOK.special_ids["<|eos|>"], TOK.special_ids["<|end|>"]


def test_byte_tokenizer_round_trip_and_specials() -> None:
    assert isinstance(TOK, Tokenizer)
    text = "héllo <|user|>wörld 🌍"
    ids = TOK.encode(text)
    assert ids[0] == TOK.bos_token_id and TOK.special_ids["<|user|>"] in ids
    assert TOK.decode(ids) == "<|bos|>" + text
    assert TOK.encode("ab", add_special_tokens=False) == [97, 98]
    assert TOK.vocab_size == 262 and TOK.eos_token_ids == [EOS, END]
    assert TOK.decode([0xF0, 0x9F]) == "\ufffd"  # an incomplete character
    with pytest.raises(ValueError, match=r"token id 262 is outside the vocabulary \[0, 262\)"):
        TOK.decode([65, 262])


def test_chat_template() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": None},
    ]
    assert TOK.apply_chat_template(messages) == (
        "<|bos|><|system|>Be brief.<|end|><|user|>Hi there<|end|><|assistant|><|end|><|assistant|>"
    )
    assert TOK.apply_chat_template(messages[:1], add_generation_prompt=False).endswith("<|end|>")
    with pytest.raises(ValueError, match=r"messages\[0\].role must be one of"):
        TOK.apply_chat_template([{"role": "function", "content": "x"}])  # tool and developer are roles now
    with pytest.raises(ValueError, match=r"messages\[0\].content\[0\] must be a text part"):
        TOK.apply_chat_template([{"role": "user", "content": [{"type": "image_url"}]}])
    with pytest.raises(ValueError, match=r"messages\[0\].content must be a string"):
        TOK.apply_chat_template([{"role": "user", "content": 5}])


@given(
    st.text(alphabet=st.characters(blacklist_characters="\ufffd", blacklist_categories=("Cs",)), max_size=60)
)
def test_incremental_detokenization_never_splits_a_character(text: str) -> None:
    detok = IncrementalDetokenizer(TOK, TOK.encode("prompt"))
    deltas = [detok.push([b]) for b in text.encode("utf-8")]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.flush() == text
    assert detok.text == text


def test_detokenizer_flushes_a_dangling_byte_as_replacement() -> None:
    detok = IncrementalDetokenizer(TOK)
    assert detok.push([0x61]) == "a"
    assert detok.push([0xE2, 0x82]) == ""  # two of the three bytes of "€"
    assert detok.flush() == "\ufffd"


def test_a_held_character_costs_one_decode_a_push() -> None:
    """While a character waits for its continuation bytes, the window's prefix text is kept: one
    decode a push, not two (a streaming request's detokenization is a part of every decode step)."""
    calls: list[list[int]] = []

    class Counting(ByteTokenizer):
        def decode(self, ids: Any) -> str:
            calls.append(list(ids))
            return super().decode(ids)

    detok = IncrementalDetokenizer(Counting())
    assert detok.push([0x61]) == "a"
    calls.clear()
    emoji = "\U0001f600".encode()
    assert [detok.push([b]) for b in emoji] == ["", "", "", "\U0001f600"]
    assert len(calls) == 1 + 4  # the prefix once, then the window at each push
    assert detok.push([0x62]) == "b" and detok.flush() == ""


@given(st.lists(st.integers(0, TOK.vocab_size - 1), max_size=40), st.booleans())
def test_byte_tokenizer_decodes_lists_and_arrays_alike(ids: list[int], as_array: bool) -> None:
    """A run of bytes is decoded in one call (bytes()), anything else by the loop: the same text,
    from a list, a tuple, numpy ints or an array (whose buffer bytes() would misread)."""
    import numpy as np

    pieces: list[str] = []
    run = bytearray()
    for i in ids:
        if i < 256:
            run.append(i)
        else:
            pieces += [run.decode("utf-8", errors="replace"), TOK.special_strings[i]]
            run.clear()
    want = "".join(pieces) + run.decode("utf-8", errors="replace")
    given_ids: Any = np.asarray(ids, dtype=np.int32) if as_array else [np.int64(i) for i in ids]
    assert TOK.decode(given_ids) == TOK.decode(tuple(ids)) == TOK.decode(ids) == want


def test_byte_tokenizer_names_an_id_outside_its_vocabulary() -> None:
    for bad in (-1, TOK.vocab_size):
        with pytest.raises(ValueError, match=f"token id {bad} is outside the vocabulary"):
            TOK.decode([0x61, bad])


def process(tokens: list[int], **params: object) -> list:
    sp = SamplingParams(**{"max_tokens": 100, **params})  # type: ignore[arg-type]
    proc = OutputProcessor(TOK, sp)
    deltas = []
    for t in tokens:
        deltas.append(proc.add(t))
        if proc.finished:
            break
    return deltas


def ids(text: str) -> list[int]:
    return list(text.encode())


def test_stop_string_across_tokens_is_cut_and_never_streamed() -> None:
    deltas = process(ids("hello STOP world"), stop=["STOP", "zzz"])
    merged = merge_deltas(deltas)
    assert merged["text"] == "hello " and merged["finish_reason"] == "stop"
    assert len(merged["token_ids"]) == len("hello STOP")  # the stop string's tokens count
    streamed = ""
    for d in deltas:
        streamed += d.text
        assert "S" not in streamed  # held back until ruled in or out


def test_held_back_text_is_released_at_the_end() -> None:
    merged = merge_deltas(process(ids("abcST"), stop=["STOP"], max_tokens=5))
    assert merged == {"text": "abcST", "token_ids": ids("abcST"), "logprobs": [], "finish_reason": "length"}


def test_stop_token_ids_and_eos() -> None:
    merged = merge_deltas(process([*ids("ab"), EOS, *ids("cd")]))
    assert merged["text"] == "ab" and merged["finish_reason"] == "stop" and merged["token_ids"][-1] == EOS
    merged = merge_deltas(process([*ids("ab"), EOS, *ids("cd")], ignore_eos=True, max_tokens=5))
    assert merged["text"] == "ab<|eos|>cd" and merged["finish_reason"] == "length"
    merged = merge_deltas(process(ids("abcd"), stop_token_ids=[ord("c")]))
    assert merged["text"] == "ab" and merged["finish_reason"] == "stop"


def test_the_stop_that_ended_an_answer_is_its_stop_reason() -> None:
    """vLLM's ``stop_reason``: the stop string that matched (the one the text is cut at, where two
    end at the same token), a stop token id, None for an EOS or ``max_tokens``."""
    assert process(ids("hello STOP world"), stop=["zzz", "STOP"])[-1].stop_reason == "STOP"
    assert process(ids("abSTOP"), stop=["OP", "STOP"])[-1].stop_reason == "STOP"
    assert process(ids("abSTOP"), stop=["STOP", "ST"])[-1].stop_reason == "ST"
    assert process(ids("a zz STOP"), stop=["STOP", "zz"])[-1].stop_reason == "zz"
    last = process(ids("abcd"), stop_token_ids=[ord("c")])[-1]
    assert last.stop_reason == ord("c") and type(last.stop_reason) is int
    assert process([*ids("ab"), EOS], stop_token_ids=[ord("c")])[-1].stop_reason is None
    assert process(ids("abcd"), stop=["x"], max_tokens=3)[-1].stop_reason is None
    assert all(d.stop_reason is None for d in process(ids("hello STOP"), stop=["STOP"])[:-1])


def test_finish_early_and_misuse() -> None:
    proc = OutputProcessor(TOK, SamplingParams(max_tokens=10))
    first = proc.add(0xC3)  # first byte of "é"
    assert first.text == "" and first.finish_reason is None
    last = proc.finish_early("not_finished")
    assert last.finish_reason == "not_finished" and last.text == "\ufffd"
    with pytest.raises(RuntimeError, match="finished request"):
        proc.add(65)


@given(
    st.text(alphabet="abcSTOP é€", min_size=1, max_size=40),
    st.lists(st.text(alphabet="abcSTOP é€", min_size=1, max_size=4), max_size=3),
    st.sampled_from([output._KEEP_SENT, 0, 3]),
)
def test_streamed_text_is_the_text_cut_at_the_earliest_stop(text: str, stops: list[str], keep: int) -> None:
    """The streamed text is the brute force's cut at the earliest stop and never runs past it,
    whatever sent text the processor keeps (``keep``: 0 cuts it off at every token)."""
    tokens = list(text.encode())
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(output, "_KEEP_SENT", keep)
        deltas = process(tokens, stop=stops, max_tokens=len(tokens))
    merged = merge_deltas(deltas)
    # Brute force: generation stops at the first token after which some stop string is in the
    # (whole-character) text, cut at the earliest such occurrence.
    want, stopped = text, False
    raw = text.encode()
    for end in range(1, len(raw) + 1):
        prefix = raw[:end].decode(errors="ignore")
        cuts = [i for i in (prefix.find(s) for s in stops) if i >= 0]
        if cuts:
            want, stopped = prefix[: min(cuts)], True
            break
    assert merged["text"] == want
    assert merged["finish_reason"] == ("stop" if stopped else "length")
    # Never streamed past the cut, even briefly.
    streamed = ""
    for d in deltas:
        streamed += d.text
        assert want.startswith(streamed)


class _Counting(ByteTokenizer):
    """The byte tokenizer, counting its decodes."""

    def __init__(self, plain: bool = True) -> None:
        super().__init__()
        self.decodes = 0
        if not plain:
            del self.plain_pieces

    def decode(self, ids: Any) -> str:
        self.decodes += 1
        return super().decode(ids)


def test_a_plain_piece_is_pushed_without_a_decode() -> None:
    """An ASCII byte with nothing held is its own text: push_one decodes nothing for it (a decode
    step pushes one id a stream); after a held byte, or a byte past ASCII, it decodes as push does."""
    tok = _Counting()
    detok = IncrementalDetokenizer(tok, tok.encode("prompt"))
    assert [detok.push_one(b) for b in b"hello"] == list("hello")
    assert tok.decodes == 0
    assert detok.push_one(0xE2) == "" and detok.push_one(0x82) == "" and detok.push_one(0xAC) == "\u20ac"
    assert detok.push_one(0xE2) == "" and detok.push_one(ord("a")) == "\ufffda"  # held: decoded
    assert tok.decodes > 0 and detok.text == "hello\u20ac\ufffda"


def test_a_held_byte_after_a_plain_piece_costs_one_decode() -> None:
    """After a plain piece the window's prefix is that piece (final alone): the byte that starts a
    character after it decodes once (the window), not twice (was: the prefix decoded anew)."""
    tok = _Counting()
    detok = IncrementalDetokenizer(tok)
    assert detok.push_one(ord("a")) == "a" and tok.decodes == 0
    assert detok.push_one(0xC3) == "" and tok.decodes == 1
    assert detok.push_one(0xA9) == "\u00e9" and detok.text == "a\u00e9"


def test_a_stop_string_request_decodes_no_plain_piece_and_keeps_no_long_text() -> None:
    """With stop strings a token goes through the rules, yet its text comes as push_one gives it (no
    decode for a plain piece; was two), and the text kept for the stop search stays bounded over a
    long answer (was the whole answer, copied at each token)."""
    tok = _Counting()
    processor = OutputProcessor(tok, SamplingParams(max_tokens=10_000, stop=["\n\n", "END!"]))
    deltas = [processor.add(b) for b in b"hello world" * 400]
    assert tok.decodes == 0
    assert "".join(d.text for d in deltas) + processor.text[processor.emitted :] == "hello world" * 400
    assert len(processor.text) <= output._KEEP_SENT + 2 * processor.holdback + 1
    assert processor.add(ord("\n")).finish_reason is None
    last = processor.add(ord("\n"))
    assert last.finish_reason == "stop" and last.stop_reason == "\n\n" and last.text == "ld"


ids_and_tails = st.tuples(
    st.lists(st.integers(0, TOK.vocab_size - 1), max_size=40),
    st.lists(st.integers(0, 255), max_size=6),
    st.sampled_from([[], ["\n"], ["ab", "c"]]),
    st.integers(1, 50),
)


@given(ids_and_tails)
def test_output_fast_path_gives_what_the_rules_give(
    case: tuple[list[int], list[int], list[str], int],
) -> None:
    """Deltas (text, ids, finish and stop reasons) of the fast path (push_one of plain pieces, a token
    that ends nothing) equal those of the full rules with a tokenizer that names no plain pieces,
    whatever bytes (partial characters, specials) and stop rules come."""
    ids, tail, stop, max_tokens = case
    runs = []
    for plain in (True, False):
        params = SamplingParams(max_tokens=max_tokens, stop=stop, stop_token_ids=[ord("z")])
        processor = OutputProcessor(_Counting(plain), params, tail)
        if not plain:
            processor._fast_below = 0  # the second run through every rule
        deltas = []
        for token in ids:
            if processor.finished:
                break
            deltas.append(processor.add(token))
        if not processor.finished:
            deltas.append(processor.finish_early("not_finished"))
        with pytest.raises(RuntimeError, match="finished request"):
            processor.add(ord("a"))  # the fast path too is closed
        runs.append([(d.text, d.token_ids, d.finish_reason, d.stop_reason) for d in deltas])
    assert runs[0] == runs[1]
