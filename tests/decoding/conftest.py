import pytest

from smcspec.models.toy import perturbed_lm, random_lm


@pytest.fixture(autouse=True)
def _toy_models_on_one_thread(one_torch_thread):
    """Every test here runs toy models (see tests/conftest.py `one_torch_thread`)."""


VOCAB = 4  # EOS = 0 and three ordinary tokens
PROMPT = [1]


@pytest.fixture(scope="module")
def target():
    return random_lm(VOCAB, seed=11, scale=1.5)


@pytest.fixture(scope="module")
def near_draft(target):
    return perturbed_lm(target, seed=12, noise=0.5)


@pytest.fixture(scope="module")
def far_draft(target):
    return perturbed_lm(target, seed=13, noise=2.0)
