import pytest

from smcspec import LLM
from smcspec.engine import check_same_tokenizer
from smcspec.models.toy import perturbed_lm, random_lm


@pytest.fixture
def llm():
    target = random_lm(5, seed=1)
    return LLM.from_models(target, perturbed_lm(target, seed=2, noise=0.5))


@pytest.mark.parametrize("method", ["ar", "sd", "smc"])
def test_generate_returns_tokens_and_diagnostics(llm, method):
    out = llm.generate(
        [1, 2], method, particles=4, draft_tokens=2, max_new_tokens=6, seed=3, stop_at_eos=False
    )
    assert len(out.token_ids) == 6
    d = out.diagnostics
    assert d["new_tokens"] == 6 and d["seed"] == 3 and d["tokens_per_second"] > 0
    assert set(d["time_split"]) == {"prefill", "draft", "verify", "resample", "other"}
    assert sum(d["time_split"].values()) == pytest.approx(d["seconds"], rel=1e-6)
    if method == "sd":
        assert 0 <= d["acceptance_rate"] <= 1 and d["mean_accepted_length"] <= 2
    if method == "smc":
        assert len(d["weights"]) == 4 and sum(d["weights"]) == pytest.approx(1.0)
        assert len(out.particle_texts) == 4 and len(d["ess"]) == d["rounds"]
        assert "log_z_hat" in d and "resamples" in d


def test_same_seed_same_output(llm):
    a = llm.generate([1], "smc", max_new_tokens=8, seed=11)
    b = llm.generate([1], "smc", max_new_tokens=8, seed=11)
    assert a.token_ids == b.token_ids and a.particle_texts == b.particle_texts


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"particles": 0}, "particles"),
        ({"draft_tokens": 0}, "draft_tokens"),
        ({"resample_threshold": 1.5}, "resample_threshold"),
        ({"resample_threshold": -0.1}, "resample_threshold"),
        ({"temperature": -1.0}, "temperature"),
        ({"draft_temperature": -0.5}, "draft_temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -3}, "top_k"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"resampling": "greedy"}, "resampling"),
        ({"method": "beam"}, "method"),
    ],
)
def test_bad_settings_name_the_field(llm, kwargs, field):
    with pytest.raises(ValueError, match=field):
        llm.generate([1], **kwargs)


def test_empty_prompts_are_refused(llm):
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate([], "ar")
    with pytest.raises(ValueError, match="prompt"):
        llm.generate("   ", "ar")


def test_out_of_vocabulary_prompt_is_refused(llm):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([99], "ar")


def test_mismatched_vocabularies_are_refused():
    with pytest.raises(ValueError, match="vocabularies differ"):
        LLM.from_models(random_lm(5, seed=1), random_lm(6, seed=1))


class _Tok:
    def __init__(self, vocab):
        self.vocab = vocab

    def get_vocab(self):
        return self.vocab


def test_mismatched_tokenizers_are_refused():
    check_same_tokenizer(_Tok({"a": 0, "b": 1}), _Tok({"a": 0, "b": 1}))
    with pytest.raises(ValueError, match="tokenizers differ"):
        check_same_tokenizer(_Tok({"a": 0, "b": 1}), _Tok({"a": 1, "b": 0}))


def test_potentials_through_the_api():
    from smcspec.models.toy import perturbed_lm, random_lm

    target = random_lm(4, seed=5)
    llm = LLM.from_models(target, perturbed_lm(target, seed=6, noise=0.5))
    out = llm.generate(
        [1, 2],
        "smc",
        particles=4,
        draft_tokens=2,
        max_new_tokens=6,
        seed=0,
        power_alpha=2.0,
        reward=lambda text: float(text.count("3")),
        reward_every=2,
    )
    assert out.diagnostics["valid_particles"] >= 1 and out.token_ids
    local = llm.generate([1, 2], "ar", max_new_tokens=6, seed=0, power_alpha=2.0)
    assert local.token_ids
    with pytest.raises(ValueError, match="sd targets p exactly"):
        llm.generate([1, 2], "sd", power_alpha=2.0)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        llm.generate([1, 2], "smc", regex="a+")
    with pytest.raises(ValueError, match="at most one"):
        llm.generate([1, 2], "smc", regex="a+", grammar="start: 'a'")
    with pytest.raises(ValueError, match="reward needs smc"):
        llm.generate([1, 2], "ar", reward=lambda text: 1.0)
