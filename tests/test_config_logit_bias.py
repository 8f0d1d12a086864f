"""`SamplingConfig.logit_bias` keys: token ids, as integers or as strings of ASCII digits and
nothing else (JSON's keys are strings), bounded in length; anything else is a `SettingError`
naming `logit_bias`, never another exception and never a silent merge of two keys."""

import pytest

from smcspec.config import MAX_TOKEN_ID_DIGITS, SamplingConfig, SettingError

LONGEST = "9" * MAX_TOKEN_ID_DIGITS


@pytest.mark.parametrize(
    "key",
    [
        "5" * 5000,  # past Python's digit limit: int() raised a bare ValueError (an HTTP 500)
        "1" * (MAX_TOKEN_ID_DIGITS + 1),  # one digit past the bound
        " 5",  # int() strips whitespace: " 5" was taken as 5
        "5 ",
        "\t5",
        "+5",
        "-1",
        "0x5",
        "5.0",
        "",
        "\u00b2",  # str.isdigit takes it, int() does not
        "\u0665",  # ARABIC-INDIC DIGIT FIVE: a digit to int(), not ASCII
        -1,
        2.0,
        True,
    ],
    ids=lambda key: repr(key) if len(repr(key)) < 16 else f"{len(key)}-digits",
)
def test_a_key_that_is_not_a_token_id_is_refused_naming_logit_bias(key):
    with pytest.raises(SettingError, match=r"^logit_bias: .* is not a token id") as err:
        SamplingConfig(logit_bias={key: 1.0})
    assert err.value.field == "logit_bias"
    assert len(str(err.value)) < 200  # a long key is not echoed whole


def test_keys_of_ascii_digits_up_to_the_bound_are_token_ids():
    config = SamplingConfig(logit_bias={LONGEST: 1.0, "7": -2, 3: 0.5, "0": 1})
    assert config.logit_bias == ((0, 1.0), (3, 0.5), (7, -2.0), (int(LONGEST), 1.0))


@pytest.mark.parametrize(
    "bias",
    [{"5": 1.0, "05": 2.0}, {"5": 1.0, 5: 2.0}, [(5, 1.0), (5, 2.0)]],
    ids=["05", "int-and-str", "pairs"],
)
def test_a_token_given_twice_is_refused_not_merged(bias):
    """Before: the later bias silently replaced the first ("05" and "5" are one token)."""
    with pytest.raises(SettingError, match=r"^logit_bias: token 5 is given twice") as err:
        SamplingConfig(logit_bias=bias)
    assert err.value.field == "logit_bias"
