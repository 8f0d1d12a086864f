"""No setting a user gives is dropped (issue 53): a method's setting given for a method that
does not read it is refused, naming it and the methods that read it, from Python, the command
line and HTTP; under auto (the default) a given N or K narrows its choice instead, and a
server's own defaults fill in only what the request's method reads.

Which method reads which setting is written out here, not taken from the method table it
checks."""

import contextlib

import pytest

from smcspec import LLM, cli
from smcspec.config import AutoConfig, SettingError
from smcspec.decoding.methods import configs_from_fields
from smcspec.engine import costs as cm
from smcspec.models.toy import perturbed_lm, random_lm

READS = {
    "ar": set(),
    "sd": {"draft_tokens", "verify", "proposal", "lookup_ngram"},
    "msd": {"particles", "draft_tokens", "verify", "proposal", "lookup_ngram"},
    "smc": {"particles", "draft_tokens", "resample_threshold", "resampling"},
    "auto": {"particles", "draft_tokens", "approximate"},
}
VALUES = {
    "particles": 2,
    "draft_tokens": 3,
    "verify": "block",
    "proposal": "lookup",
    "lookup_ngram": 2,
    "resample_threshold": 0.4,
    "resampling": "multinomial",
    "approximate": True,
}
UNREAD = [(m, f) for m in READS for f in VALUES if f not in READS[m]]
# every row free: unnarrowed, auto would take the most rows and drafts it may
ROWS_FREE = cm.StepCosts(target_fit=(1.0, 0.0), draft_fit=(0.01, 0.0))


@pytest.mark.parametrize(("method", "name"), UNREAD, ids=[f"{m}-{f}" for m, f in UNREAD])
def test_a_setting_the_method_does_not_read_is_refused_naming_it(method, name):
    """Failed on: configs_from_fields checking every method's settings, then keeping only the
    chosen method's (particles with sd, resampling with msd, approximate with ar: all taken)."""
    with pytest.raises(SettingError, match=f"^{name} is a setting of .*not of {method}") as err:
        configs_from_fields({"method": method, name: VALUES[name]})
    assert err.value.field == name


@pytest.mark.parametrize("method", list(READS))
def test_every_setting_the_method_reads_is_taken(method):
    given = {name: VALUES[name] for name in READS[method]}
    decoding, _ = configs_from_fields({"method": method, **given})
    for name, value in given.items():
        own = ("exact", not value) if name == "approximate" else (name, value)
        assert getattr(decoding, own[0]) == own[1]


def test_auto_takes_a_given_n_and_k_as_the_only_ones_it_weighs():
    decoding, _ = configs_from_fields({"particles": 8, "draft_tokens": 2})
    assert decoding == AutoConfig(particles=8, draft_tokens=2)


def test_exact_and_approximate_together_are_refused_naming_approximate():
    """Failed on: the refusal removed (approximate then won: an exact caller could get smc)."""
    with pytest.raises(SettingError, match="contradict") as err:
        configs_from_fields({"exact": True, "approximate": True})
    assert err.value.field == "approximate"


@pytest.fixture
def toy():
    target = random_lm(6, seed=1)
    llm = LLM.from_models(target, perturbed_lm(target, seed=2, noise=0.5))
    llm.tuner.costs = ROWS_FREE
    return llm


@pytest.mark.parametrize(
    ("given", "n", "k"), [({"particles": 8}, 8, None), ({"draft_tokens": 2}, None, 2)]
)
def test_generate_under_auto_runs_only_the_n_or_k_given(toy, given, n, k):
    """Rows free, auto alone picks 4 rows and 8 drafts. Failed on: particles / draft_tokens
    validated and dropped under auto (`generate --particles 8` ran sd K=2 without a word)."""
    out = toy.generate([1, 2], max_new_tokens=24, stop_at_eos=False, seed=0, **given)
    assert out.method == "auto" and out.diagnostics["settings"]
    for setting in out.diagnostics["settings"]:
        assert setting.get("particles") == n if n else setting["method"] in ("sd", "msd")
        assert setting.get("draft_tokens") == k if k else True


def test_generate_refuses_particles_for_sd(toy):
    message = "particles is a setting of smc, msd and auto, not of sd"
    with pytest.raises(SettingError, match=message):
        toy.generate([1, 2], "sd", particles=4)


@pytest.mark.parametrize(
    ("args", "name"),
    [
        (["--method", "sd", "--particles", "4"], "particles"),
        (["--method", "ar", "--approximate"], "approximate"),
        (["--method", "msd", "--resampling", "multinomial"], "resampling"),
        (["--resample-threshold", "0.3"], "resample_threshold"),  # auto: smc's alone
        (["--approximate", "--exact"], None),  # not a flag: argparse's exit 2
    ],
)
def test_the_cli_refuses_an_unread_setting_in_one_line_before_loading(
    no_loading, capsys, args, name
):
    with pytest.raises(SystemExit) if name is None else contextlib.nullcontext():
        assert cli.main(["generate", "hi", *args]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"smcspec: error: {name} is a setting of") and "\n" not in err


def test_the_cli_takes_smcs_settings_with_smc(no_loading):
    from tests.conftest import Loading

    with pytest.raises(Loading):  # every check passed: the models were next
        cli.main(["generate", "hi", "--method", "smc", "--resampling", "multinomial"])
