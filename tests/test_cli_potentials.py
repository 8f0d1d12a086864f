"""`smcspec generate`'s potential flags reach the decoder with the values typed, and move the
law: read from what `make_decoder` receives and from the --json output, against the model's own
logits (transformers) and the reward's own values. `main` runs in-process on a tiny pair.

With --max-new-tokens 1 a decode is one exact step: every particle's log-weight is
log sum_v p(v)^alpha plus beta r(x_i) (see tests/engine/test_potential_plumbing.py)."""

import json
import math

import llguidance
import pytest
import torch

from smcspec import LLM, cli
from smcspec.cli import generate as cli_generate
from smcspec.potentials import Constraint, Power, Reward
from tests.plumbing import byte_pair, factor, next_token_log_probs, record_decoders

PROMPT = "w1 w2"
REWARD = f"{__name__}:reward_of_words"
# Float32 log-probabilities (two implementations of the model, or one model's rows of a batch)
# summed in float64: log-weights agree to this, so weights to this relative error.
EXACT = 1e-4


def reward_of_words(text: str) -> float:
    """Tells the tiny vocabulary's words apart: the last word's number mod 4 (0 for none)."""
    words = text.split()
    return float(int(words[-1][1:]) % 4) if words else 0.0


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama_folder, tiny_llama_draft_folder):
    return LLM(
        str(tiny_llama_folder), str(tiny_llama_draft_folder), backend="native", dtype="float32"
    )


def generate(monkeypatch, capsys, llm: LLM, *flags: str) -> dict:
    """`smcspec generate PROMPT --json FLAGS` on `llm`: one exact step of 6 particles unless
    the flags say otherwise."""
    monkeypatch.setattr(cli_generate, "llm_from_args", lambda args, **kwargs: llm)
    head = ["generate", PROMPT, "--no-chat", "--json", "--method", "smc", "--seed", "0"]
    steps = ["--particles", "6", "--max-new-tokens", "1", "--temperature", "1"]
    assert cli.main([*head, *steps, *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_power_alpha_reaches_the_decoder_and_sets_the_normalizer(
    monkeypatch, capsys, tiny_llm, tiny_llama_folder
):
    seen = record_decoders(monkeypatch)
    out = generate(monkeypatch, capsys, tiny_llm, "--power-alpha", "4")
    assert factor(seen[-1][1], Power).alpha == 4.0
    logp = next_token_log_probs(str(tiny_llama_folder), tiny_llm.tokenizer.encode(PROMPT))
    assert out["log_z_hat"] == pytest.approx(float(torch.logsumexp(4 * logp, 0)), abs=EXACT)


def test_reward_flags_reach_the_decoder_and_weigh_the_particles(monkeypatch, capsys, tiny_llm):
    seen = record_decoders(monkeypatch)
    flags = ["--reward", REWARD, "--reward-beta", "2.5", "--reward-every", "3"]
    out = generate(monkeypatch, capsys, tiny_llm, *flags)
    reward = factor(seen[-1][1], Reward)
    assert (reward.beta, reward.every) == (2.5, 3)
    ids = tiny_llm.tokenizer.encode("w5 w6 w7 w9")
    assert reward.log_value(ids, final=True) == 2.5 * reward_of_words("w5 w6 w7 w9")
    assert reward.log_value(ids, final=False) == 2.5 * reward_of_words("w5 w6 w7")
    r = torch.tensor([reward_of_words(t) for t in out["particle_texts"]], dtype=torch.float64)
    assert r.unique().numel() > 1, "the particles must differ in reward for beta to show"
    assert out["weights"] == pytest.approx(torch.softmax(2.5 * r, 0).tolist(), rel=EXACT)
    want = float(torch.logsumexp(2.5 * r, 0)) - math.log(r.numel())
    assert out["log_z_hat"] == pytest.approx(want, abs=EXACT)


@pytest.fixture(scope="module")
def byte_llm(tmp_path_factory):
    return byte_pair(tmp_path_factory)


@pytest.mark.parametrize(
    ("flag", "text", "compile_"),
    [
        ("--regex", "(ab|cd)+", llguidance.LLMatcher.grammar_from_regex),
        ("--json-schema", '{"enum": ["ab", "cd"]}', llguidance.LLMatcher.grammar_from_json_schema),
        ("--grammar", 'start: "x" "y"*', llguidance.LLMatcher.grammar_from_lark),
    ],
)
def test_a_constraint_flag_reaches_the_decoder_as_compiled(
    monkeypatch, capsys, tmp_path, byte_llm, flag, text, compile_
):
    """--json-schema and --grammar name files: the file's text is what compiles."""
    given = text
    if flag != "--regex":
        given = str(tmp_path / "constraint.txt")
        (tmp_path / "constraint.txt").write_text(text)
    seen = record_decoders(monkeypatch)
    generate(monkeypatch, capsys, byte_llm, flag, given)
    want = compile_(json.loads(text) if flag == "--json-schema" else text)
    assert factor(seen[-1][1], Constraint).grammar == want
