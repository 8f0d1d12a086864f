"""Streaming text: stop strings cut the text, nothing sent is ever taken back, and each update
decodes a bounded window of tokens however long the output grows."""

import random
from collections.abc import Sequence

import pytest

from smcspec.engine.text import TextStream, check_stops, first_stop, held_back
from tests.conftest import WORDS

PIECES = ["Hel", "lo", " wor", "ld", "\n\n", "bye", "\ufffd"]
TOKENIZERS = ["byte_bpe", "sentencepiece", "word_level"]
SENTENCE = "Hello world, 你好世界! 😀 naïve café — 🚀 launch. 東京タワー 🎉 done.\n"


def detok(tokens: list[int]) -> str:
    return "".join(PIECES[t] for t in tokens)


@pytest.fixture(scope="module")
def byte_bpe():
    """A real byte-level BPE (as Qwen's and GPT-2's), trained in memory on a few hundred bytes so
    that CJK characters and emoji are split across tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator([SENTENCE] * 20, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>")
    return tok, SENTENCE, range(len(tok))


@pytest.fixture(scope="module")
def sentencepiece():
    """A Llama-style tokenizer: "▁" for spaces, the leading one stripped, and characters
    outside the vocabulary spelled as byte tokens (byte fallback). The random ids avoid the byte
    tokens: an invalid run of them decodes to one U+FFFD per byte, retracting text that a
    shorter run had decoded, which no stream can send without taking it back."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1} | {f"<0x{b:02X}>": 2 + b for b in range(256)}
    for c in "▁" + "".join(chr(i) for i in range(33, 127)):
        vocab[c] = len(vocab)
    core = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    core.pre_tokenizer = pre_tokenizers.Metaspace()
    core.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", unk_token="<unk>")
    return tok, SENTENCE, [0, 1, *range(258, len(vocab))]


@pytest.fixture(scope="module")
def word_level():
    """The test models' word-level tokenizer: decoding joins words with spaces."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", unk_token="<unk>")
    return tok, " ".join(WORDS[3:]) + "\n", range(len(tok))


class Counting:
    """A detokenizer that counts the tokens it is asked to decode."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.tokens = 0

    def __call__(self, ids: list[int]) -> str:
        self.tokens += len(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def feed(stream: TextStream, tokens: list[int], seed: int, max_step: int = 4) -> list[str]:
    """Every delta, the tokens arriving 1..max_step at a time (as sd and smc rounds commit)."""
    rng = random.Random(seed)
    deltas, n = [], 0
    while n < len(tokens) and not stream.stopped:
        n = min(len(tokens), n + rng.randint(1, max_step))
        deltas.append(stream.update(tokens[:n]))
    deltas.append(stream.finish(tokens))
    return deltas


def long_outputs(tokenizer, sentence: str, ids: Sequence[int]) -> dict[str, list[int]]:
    """Thousands of tokens: real text, and random ids (invalid UTF-8 and special tokens)."""
    rng = random.Random(0)
    text = tokenizer.encode(sentence * 120, add_special_tokens=False)
    noise = [rng.choice(ids) for _ in range(3000)]
    return {"text": text, "random ids": noise}


def fewest_tokens_holding(tokenizer, tokens: list[int], stop: str) -> int:
    """Before the last token a trailing U+FFFD may be an unfinished character: it holds no stop."""
    lo, hi = 1, len(tokens)
    while lo < hi:
        mid = (lo + hi) // 2
        if stop in tokenizer.decode(tokens[:mid], skip_special_tokens=True).rstrip("\ufffd"):
            hi = mid
        else:
            lo = mid + 1
    return hi


def test_first_stop_and_held_back():
    assert first_stop("abc END def STOP", ["STOP", "END"]) == 4
    assert first_stop("abc", ["x"]) is None
    assert held_back("hello wo", ["world"]) == 2  # "wo" may begin "world"
    assert held_back("hello", ["world"]) == 0
    assert held_back("ab\ufffd", []) == 1  # an unfinished multi-byte character


def test_stops_are_checked():
    assert check_stops(None) == () and check_stops("x") == ("x",)
    assert check_stops(["a", "bc"]) == ("a", "bc")
    for bad in ("", ["a", ""], [3], ["a", None], 7):
        with pytest.raises(ValueError, match="stop"):
            check_stops(bad)


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


def test_a_character_split_across_tokens_waits_for_its_last_byte(byte_bpe):
    byte_bpe = byte_bpe[0]
    ids = byte_bpe.encode("ok 😀", add_special_tokens=False)
    split = next(n for n in range(1, len(ids)) if byte_bpe.decode(ids[:n]).endswith("\ufffd"))
    stream = TextStream(byte_bpe.decode)
    first = stream.update(ids[:split])
    assert "\ufffd" not in first
    assert first + stream.update(ids) + stream.finish(ids) == "ok 😀"


@pytest.mark.parametrize("tokenizer", TOKENIZERS)
def test_long_outputs_stream_exactly_the_full_decode(request, tokenizer):
    tok, sentence, ids = request.getfixturevalue(tokenizer)
    for name, tokens in long_outputs(tok, sentence, ids).items():
        full = tok.decode(tokens, skip_special_tokens=True)
        stream = TextStream(Counting(tok))
        deltas = feed(stream, tokens, seed=1)
        assert "".join(deltas) == full == stream.sent, name
        assert not any(d.endswith("\ufffd") for d in deltas[:-1]), name
        assert stream.tokens_used == len(tokens)


@pytest.mark.parametrize("tokenizer", TOKENIZERS)
def test_long_outputs_are_cut_at_the_first_stop_string(request, tokenizer):
    tok, sentence, ids = request.getfixturevalue(tokenizer)
    rng = random.Random(2)
    for name, tokens in long_outputs(tok, sentence, ids).items():
        full = tok.decode(tokens, skip_special_tokens=True)
        at = rng.randrange(len(full) // 2, len(full) - 10)
        stop = full[at : at + 3]  # may hold a multi-byte character split across tokens
        stops = [stop, "never appears \x00"]
        stream = TextStream(Counting(tok), stops)
        deltas = feed(stream, tokens, seed=3)
        assert "".join(deltas) == full[: full.index(stop)], name
        assert stream.stopped
        assert stream.tokens_used == fewest_tokens_holding(tok, tokens, stop), name


@pytest.mark.parametrize("tokenizer", TOKENIZERS)
def test_the_work_per_update_does_not_grow_with_the_output(request, tokenizer):
    """Tokens handed to the detokenizer per update stay bounded over thousands of updates
    (decoding everything at every update would hand it up to 4200 tokens at the end)."""
    tok, sentence, _ = request.getfixturevalue(tokenizer)
    tokens = tok.encode(sentence * 150, add_special_tokens=False)[:4200]
    detokenize = Counting(tok)
    stream = TextStream(detokenize, stops=["🚀 launch!", "never"])  # partial matches held back
    per_update = []
    for n in range(1, len(tokens) + 1):
        before = detokenize.tokens
        stream.update(tokens[:n])
        per_update.append(detokenize.tokens - before)
    assert len(tokens) == 4200 and not stream.stopped
    assert max(per_update) <= 16, max(per_update)
    stream.finish(tokens)
    assert stream.sent == tok.decode(tokens)
