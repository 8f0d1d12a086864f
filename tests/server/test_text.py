"""Streaming text: stop strings cut the text, and nothing sent is ever taken back."""

from smcspec.server.text import TextStream, first_stop, held_back

PIECES = ["Hel", "lo", " wor", "ld", "\n\n", "bye", "\ufffd"]


def detok(tokens: list[int]) -> str:
    return "".join(PIECES[t] for t in tokens)


def test_first_stop_and_held_back():
    assert first_stop("abc END def STOP", ["STOP", "END"]) == 4
    assert first_stop("abc", ["x"]) is None
    assert held_back("hello wo", ["world"]) == 2  # "wo" may begin "world"
    assert held_back("hello", ["world"]) == 0
    assert held_back("ab\ufffd", []) == 1  # an unfinished multi-byte character


def test_deltas_add_up_and_hold_back_a_possible_stop():
    stream = TextStream(detok, stops=["world"])
    sent = [stream.update([0]), stream.update([0, 1]), stream.update([0, 1, 2])]
    assert sent == ["Hel", "lo", " "]  # " wor" could start "world": "wor" is held back
    assert stream.update([0, 1, 2, 3]) == ""  # "world" arrived: cut before it
    assert stream.stopped and stream.sent == "Hello "
    assert stream.tokens_used == 4
    assert stream.finish([0, 1, 2, 3, 4]) == ""


def test_a_held_back_prefix_that_is_no_stop_is_sent_later():
    stream = TextStream(detok, stops=["world!"])
    assert stream.update([0, 1, 2, 3]) == "Hello "  # "world" may still become "world!"
    assert stream.update([0, 1, 2, 3, 4]) == "world\n\n"
    assert not stream.stopped


def test_finish_sends_the_rest_and_cuts_at_a_stop_spanning_tokens():
    stream = TextStream(detok, stops=["\nb"])
    assert stream.update([0, 1, 2, 3]) == "Hello world"
    assert stream.finish([0, 1, 2, 3, 4, 5]) == "\n"
    assert stream.sent == "Hello world\n" and stream.tokens_used == 6
    plain = TextStream(detok)
    assert plain.update([0, 6]) == "Hel"  # the replacement character waits
    assert plain.finish([0, 6]) == "\ufffd" and plain.sent == "Hel\ufffd"
