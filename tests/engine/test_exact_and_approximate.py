"""`exact` (AutoConfig's field) and `approximate` (its opposite, as the CLI and HTTP bodies spell
it) given together must agree: exact=True with approximate=True is refused naming
`approximate`, never settled by one silently winning. Only Python can give both: the CLI has no
`--exact` and an HTTP body no `exact` field (pinned here and in tests/server/test_api.py), so a
front end that starts taking `exact` shows up in these tests."""

import pytest

from smcspec import LLM, cli
from smcspec.config import AutoConfig, SettingError
from smcspec.engine import configs_from_fields
from smcspec.models.toy import perturbed_lm, random_lm


@pytest.fixture(scope="module")
def toy_llm() -> LLM:
    target = random_lm(5, seed=1)
    return LLM.from_models(target, perturbed_lm(target, seed=2, noise=0.5))


@pytest.mark.parametrize("exact", [True, False])
def test_exact_contradicting_approximate_is_refused_naming_approximate(exact):
    """Failed on: `_exact_of` without its refusal (approximate silently won)."""
    with pytest.raises(SettingError, match="contradict") as err:
        configs_from_fields({"exact": exact, "approximate": exact})
    assert err.value.field == "approximate"


def test_the_refusal_reaches_llm_request(toy_llm):
    with pytest.raises(ValueError, match="contradict") as err:
        toy_llm.request([1, 2], exact=True, approximate=True)
    assert getattr(err.value, "field", None) == "approximate"


@pytest.mark.parametrize("exact", [True, False])
def test_exact_agreeing_with_approximate_is_taken(exact):
    decoding, _ = configs_from_fields({"exact": exact, "approximate": not exact})
    assert decoding == AutoConfig(exact=exact)


def test_the_cli_has_no_exact_flag(capsys):
    """Exit 2 from argparse: `--approximate` is the CLI's one spelling, so the contradiction
    cannot be written there."""
    with pytest.raises(SystemExit) as done:
        cli.main(["generate", "hello", "--approximate", "--exact"])
    assert done.value.code == 2
    assert "unrecognized arguments: --exact" in capsys.readouterr().err
