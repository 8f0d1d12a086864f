"""Stop strings and streamed text when a character's UTF-8 bytes arrive in separate tokens (rare
characters under byte-level BPE, token by token under ar). Stops match complete text only; an
unfinished character (decoded as U+FFFD) is held back, never matched and never sent; a genuine
U+FFFD (bytes no later byte can make valid) is sent in the end. The oracle is Python's
incremental UTF-8 decoder over the bytes, which knows where each character ends."""

import codecs
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from smcspec.engine.text import TextStream, first_stop, held_back
from tests.engine.byte_level import EOS, PROMPT, byte_level_tokenizer, script_llm

# One small alphabet per UTF-8 width (1 to 4 bytes) so that stop strings recur and overlap, U+FFFD
# itself (valid as EF BF BD), and any character at all.
ALPHABET = "ab" + "éü" + "你好" + "😀🚀" + "\ufffd"
CHARS = st.one_of(st.sampled_from(ALPHABET), st.characters(codec="utf-8"))
# Bytes that stay invalid, and beginnings of characters whose end never comes.
JUNK = st.sampled_from([b"\xff", b"\x80", b"\xc3", b"\xe4\xbd", b"\xf0\x9f\x98", b"\xed\xa0"])


class ByteChunks:
    """A byte-level detokenizer whose token i is `pieces[i]`: it decodes as a byte-level BPE
    does (checked against a real one below)."""

    def __init__(self, pieces: Sequence[bytes]) -> None:
        self.pieces = pieces

    def __call__(self, ids: list[int]) -> str:
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


def settled_text(data: bytes) -> str:
    """The characters `data` has settled: those whose bytes have all come, and U+FFFD for
    bytes no later byte can make valid."""
    return codecs.getincrementaldecoder("utf-8")(errors="replace").decode(data, final=False)


def cut_at_first_stop(text: str, stops: Sequence[str]) -> str:
    """`text` up to the stop string completed first (of those completed at once, the longest)."""
    for end in range(1, len(text) + 1):
        done = [len(s) for s in stops if text.endswith(s, 0, end)]
        if done:
            return text[: end - max(done)]
    return text


def fewest_tokens_settling_a_stop(pieces: Sequence[bytes], stops: Sequence[str]) -> int:
    text = [settled_text(b"".join(pieces[:n])) for n in range(len(pieces) + 1)]
    return next((n for n, t in enumerate(text) if any(s in t for s in stops)), len(pieces))


@st.composite
def outputs(draw, junk: bool) -> tuple[list[bytes], list[str], list[int]]:
    """(tokens' bytes, stop strings, how many tokens each update adds)."""
    data = draw(st.text(CHARS, min_size=1, max_size=16)).encode()
    if junk:
        for piece in draw(st.lists(JUNK, min_size=1, max_size=3)):
            at = draw(st.integers(0, len(data)))
            data = data[:at] + piece + data[at:]
    every_byte = st.just(set(range(1, len(data))))
    cuts = sorted(draw(st.one_of(every_byte, st.sets(st.integers(1, max(1, len(data) - 1))))))
    cuts = [c for c in cuts if c < len(data)]
    pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
    full = data.decode("utf-8", errors="replace")
    inside = st.tuples(st.integers(0, len(full) - 1), st.integers(1, 4)).map(
        lambda at: full[at[0] : at[0] + at[1]]
    )
    absent = st.sampled_from(["\ufffd", "zz", "b\ufffd", "好\ufffd", full + "!"])
    stops = draw(st.lists(st.one_of(inside, absent), min_size=1, max_size=3))
    steps = draw(st.one_of(st.just([1] * len(pieces)), st.lists(st.integers(1, 4), min_size=1)))
    return pieces, stops, steps


def stream_in_steps(stream: TextStream, n_tokens: int, steps: list[int]) -> list[tuple[int, str]]:
    """Updates adding `steps` tokens at a time, then `finish`: (tokens so far, text sent so far)
    after each update."""
    sent, n = [], 0
    for step in steps:
        if n >= n_tokens or stream.stopped:
            break
        n = min(n_tokens, n + step)
        stream.update(list(range(n)))
        sent.append((n, stream.sent))
    stream.finish(list(range(n_tokens)))
    return sent


def check_stream(pieces: list[bytes], stops: list[str], steps: list[int]) -> TextStream:
    """The text, sent whole and streamed, is the full decode cut at the first stop; the stream
    sends only settled characters (so it never takes text back)."""
    full = b"".join(pieces).decode("utf-8", errors="replace")
    whole = TextStream(ByteChunks(pieces), stops)
    whole.finish(list(range(len(pieces))))
    assert whole.sent == cut_at_first_stop(full, stops), (pieces, stops)

    stream = TextStream(ByteChunks(pieces), stops)
    for n, sent in stream_in_steps(stream, len(pieces), steps):
        assert settled_text(b"".join(pieces[:n])).startswith(sent), (pieces, stops, steps, n)
    assert stream.sent == cut_at_first_stop(full, stops), (pieces, stops, steps)
    assert stream.stopped == any(s in full for s in stops), (pieces, stops, steps)
    return stream


@settings(max_examples=400, deadline=None, derandomize=True)
@given(outputs(junk=False))
def test_stops_match_complete_characters_split_at_any_byte(output):
    pieces, stops, steps = output
    stream = check_stream(pieces, stops, steps)
    if "\ufffd" not in b"".join(pieces).decode():
        # A U+FFFD that ends the text so far might be a character's first bytes, so one typed
        # by the model (EF BF BD) waits for the next token before it can end a stop string.
        fewest = fewest_tokens_settling_a_stop(pieces, stops)
        assert stream.tokens_used == fewest, (pieces, stops, steps)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(outputs(junk=True))
def test_a_genuine_replacement_character_is_sent_and_can_be_a_stop(output):
    check_stream(*output)


def test_the_issue_cases_token_by_token():
    for text, stop in [("x你好y", "你好"), ("une café.", "café"), ("Liebe Grüße!", "Grüße")]:
        pieces = [bytes([b]) for b in text.encode()]
        for stops in ([stop], ["\ufffd"]):
            stream = TextStream(ByteChunks(pieces), stops)
            history = stream_in_steps(stream, len(pieces), [1] * len(pieces))
            assert stream.sent == cut_at_first_stop(text, stops), (text, stops, history)


@pytest.fixture(scope="module")
def hf_byte_level():
    return byte_level_tokenizer()


@settings(max_examples=200, deadline=None, derandomize=True)
@given(data=st.binary(max_size=12))
def test_the_byte_chunks_decode_as_hugging_face_byte_level_bpe(hf_byte_level, data):
    pieces = [bytes([b]) for b in data]
    decoded = hf_byte_level.decode([*data, EOS], skip_special_tokens=True)
    assert ByteChunks(pieces)(list(range(len(data)))) == decoded


def test_a_stop_is_matched_where_it_is_completed_first():
    assert first_stop("abc", ["abc", "b"]) == 1  # "b" is complete a character before "abc"
    assert first_stop("abc", ["bc", "abc"]) == 0  # both complete at "c": the longer
    assert held_back("x你\ufffd", ["你好"]) == 2  # "你" may begin the stop; "\ufffd" may be "好"
    assert held_back("\ufffdab", ["c"]) == 0  # a U+FFFD that text follows is final


SCRIPT = "x你好y café Grüße 😀!"
METHODS = {
    "ar": {},
    "sd": {"draft_tokens": 3},
    "smc": {"particles": 2, "draft_tokens": 3, "resample_threshold": 1.0},
}


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("stop", ["你好", "café", "Grüße", "😀!", "\ufffd"])
def test_every_method_stops_on_complete_characters(method, stop):
    """Each method's text, whole and streamed, ends just before the stop, and its tokens end
    with the stop's last byte; the transient U+FFFD of each split character fires no stop."""
    llm = script_llm(SCRIPT.encode())
    settings = {"stop": [stop], "seed": 0, "max_new_tokens": 64, **METHODS[method]}
    out = llm.generate(PROMPT, method, **settings)
    streamed: list[str] = []
    llm.run(llm.request(PROMPT, method, **settings), on_text=streamed.append)
    text = cut_at_first_stop(SCRIPT, [stop])
    assert out.text == "".join(streamed) == text
    assert "\ufffd" not in "".join(streamed)
    assert out.finish_reason == "stop"
    if stop in SCRIPT:
        assert bytes(out.token_ids) == (text + stop).encode()
    else:
        assert out.token_ids == [*SCRIPT.encode(), EOS]


@pytest.mark.parametrize("method", METHODS)
def test_every_method_sends_genuine_replacement_characters(method):
    """Invalid bytes mid-output, and a character cut off by EOS: each stays a U+FFFD and is
    sent; a stop string may hold one."""
    script = b"x\xff" + "你".encode() + b"\x80y" + "好".encode()[:2]
    llm = script_llm(script)
    full = script.decode("utf-8", errors="replace")  # "x\ufffd你\ufffdy\ufffd"
    for stops in (["zz"], ["\ufffdy"]):
        settings = {"stop": stops, "seed": 0, "max_new_tokens": 64, **METHODS[method]}
        streamed: list[str] = []
        out = llm.run(llm.request(PROMPT, method, **settings), on_text=streamed.append)
        assert out.text == "".join(streamed) == cut_at_first_stop(full, stops)
