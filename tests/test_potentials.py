"""`Constraint` (llguidance) on a toy byte-level model: masks, errors, and SMC converging to the
exact conditional p(x | x in L) where masked sampling does not.

Vocabulary: EOS = 0 and the 256 bytes (token b + 1), so every string has one tokenization and
the language (ab|ba)c? has exactly four members, whose target probabilities are enumerable.
"""

import itertools
import math
from collections import Counter

import llguidance  # a hard dependency: a broken install must fail, not skip
import numpy as np
import pytest
import torch

from smcspec import sampling
from smcspec.config import SamplingConfig, SMCConfig
from smcspec.decoding import AutoregressiveDecoder, SMCDecoder
from smcspec.models.toy import perturbed_lm, random_lm
from smcspec.potentials import Constraint
from tests.stats import ALPHA, chi_square_pvalue, loglog_slope, mean_l1_noise_bound, rate_bound

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # toy models (see tests/conftest.py)

V = 257
PROMPT = [ord("x") + 1]
CFG = SamplingConfig(temperature=1.0, max_new_tokens=5)
LANGUAGE = ["ab", "ba", "abc", "bac"]


class ByteTokenizer:
    eos_token_id = 0
    bos_token_id = None
    tokens = [b"<eos>"] + [bytes([i]) for i in range(256)]
    special_token_ids = (0,)

    def __call__(self, text: bytes) -> list[int]:
        return [c + 1 for c in text]


def byte_guidance_tokenizer() -> llguidance.LLTokenizer:
    """llguidance's view of `ByteTokenizer` (token b + 1 is byte b)."""
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(ByteTokenizer()))


@pytest.fixture(scope="module")
def tokenizer():
    return byte_guidance_tokenizer()


@pytest.fixture(scope="module")
def pair():
    target = random_lm(V, seed=41, scale=2.0)
    return target, perturbed_lm(target, seed=42, noise=0.8)


def ids(text: str) -> tuple[int, ...]:
    return (*[ord(c) + 1 for c in text], 0)


def path_logp(model, seq, masked: bool) -> float:
    """log p of seq after PROMPT; masked: each step renormalized over the language's options."""
    total, prefix = 0.0, list(PROMPT)
    for i, token in enumerate(seq):
        logp = sampling.log_probs(model.logits(tuple(prefix)).double(), 1.0)
        if masked:
            options = {s[i] for s in map(ids, LANGUAGE) if len(s) > i and s[:i] == seq[:i]}
            logp = logp[sorted(options)] - torch.logsumexp(logp[sorted(options)], 0)
            logp = dict(zip(sorted(options), logp.tolist(), strict=True))
            total += logp[token]
        else:
            total += float(logp[token])
        prefix.append(token)
    return total


def law(model, masked: bool) -> dict:
    weights = {ids(s): math.exp(path_logp(model, ids(s), masked)) for s in LANGUAGE}
    z = math.fsum(weights.values())
    return {x: w / z for x, w in weights.items()}


def test_masks_follow_the_language(tokenizer):
    c = Constraint.regex("(ab|ba)c?", tokenizer, V)
    state = c.start()
    assert torch.nonzero(c.allowed(state)).flatten().tolist() == [ord("a") + 1, ord("b") + 1]
    state = c.advance(state, ord("a") + 1)
    fork = c.copy(state)
    assert torch.nonzero(c.allowed(state)).flatten().tolist() == [ord("b") + 1]
    state = c.advance(state, ord("b") + 1)
    assert c.allowed(state)[0] and c.log_end(state) == 0.0  # complete: EOS allowed
    assert c.log_end(fork) == -math.inf  # "a" alone is not in the language


def test_bad_constraints_are_value_errors_that_name_the_problem(tokenizer):
    with pytest.raises(ValueError, match="invalid regex"):
        Constraint.regex("(ab", tokenizer, V)
    with pytest.raises(ValueError, match="invalid JSON schema"):
        Constraint.json_schema("{not json", tokenizer, V)
    with pytest.raises(ValueError, match="invalid grammar"):
        Constraint.lark("start: foo(", tokenizer, V)


def test_smc_converges_to_the_exact_conditional_and_masking_does_not(pair, tokenizer):
    target, draft = pair
    exact, local = law(target, masked=False), law(target, masked=True)
    gap = sum(abs(exact[x] - local[x]) for x in exact)
    assert gap > 0.2  # on this model the locally masked law is far from the conditional
    index = {x: i for i, x in enumerate(exact)}
    exact_vec = np.array(list(exact.values()))
    ns, runs = [2, 8, 32], 300
    measures = []
    for n in ns:
        dec = SMCDecoder(
            target, draft, SMCConfig(n, 2, 0.5), Constraint.regex("(ab|ba)c?", tokenizer, V)
        )
        g = torch.Generator().manual_seed(n)
        m = np.zeros((runs, len(index)))
        for r in range(runs):
            out = dec.decode(PROMPT, CFG, g)
            assert tuple(out.tokens) in index  # every output is in the language
            for tokens, w in zip(out.particles, out.stats.weights, strict=True):
                if w > 0:
                    m[r, index[tuple(tokens)]] += w
        measures.append(m)

    def fit(pick):
        l1 = [np.abs(m[pick].mean(0) - exact_vec).sum() for m in measures]
        return loglog_slope(ns, l1), l1

    slope, l1 = fit(np.arange(runs))
    rng = np.random.default_rng(0)
    se = np.std([fit(rng.integers(0, runs, runs))[0] for _ in range(200)])
    print(f"constraint: L1 {np.round(l1, 4)} slope {slope:.3f} +- {se:.3f}; masked gap {gap:.3f}")
    assert slope <= -0.5 + 3 * se
    assert all(b < a for a, b in itertools.pairwise(l1))
    assert l1[-1] < gap / 4
    noise = [mean_l1_noise_bound(m) for m in measures[-2:]]
    assert l1[-1] <= rate_bound(l1[-2], noise[0], ns[-2], ns[-1], noise[1])

    masked_ar = AutoregressiveDecoder(target, Constraint.regex("(ab|ba)c?", tokenizer, V))
    g = torch.Generator().manual_seed(3)
    counts = Counter(tuple(masked_ar.decode(PROMPT, CFG, g).tokens) for _ in range(3000))
    assert set(counts) <= set(exact)
    assert chi_square_pvalue(counts, local) > ALPHA
    assert chi_square_pvalue(counts, exact) < ALPHA


def test_lark_grammar_and_json_schema_constraints_mask_alike(tokenizer):
    grammar = Constraint.lark('start: "ab" "c"? | "ba" "c"?', tokenizer, V)
    regex = Constraint.regex("(ab|ba)c?", tokenizer, V)
    for text in ["", "a", "ab", "b", "ba", "abc"]:
        g, r = grammar.start(), regex.start()
        for ch in text:
            g, r = grammar.advance(g, ord(ch) + 1), regex.advance(r, ord(ch) + 1)
        assert torch.equal(grammar.allowed(g), regex.allowed(r)), text
    schema = Constraint.json_schema({"type": "boolean"}, tokenizer, V)
    state = schema.start()
    for ch in "true":
        assert schema.allowed(state)[ord(ch) + 1]
        state = schema.advance(state, ord(ch) + 1)
    assert schema.log_end(state) == 0.0


@pytest.mark.parametrize(
    ("kind", "text", "message"),
    [
        ("regex", "(ab", "invalid regex.*unclosed group"),
        ("json_schema", "{not json", "invalid JSON schema"),
        ("json_schema", {"type": "objectx"}, "invalid JSON schema"),
        ("json_schema", "[1, 2]", "invalid JSON schema"),
        ("grammar", "start: foo(", "invalid grammar"),
        ("grammar", "start: undefined_rule", "invalid grammar.*undefined_rule"),
        ("xml", "<a/>", "constraint kind"),
    ],
)
def test_constraints_compile_without_a_tokenizer(kind, text, message):
    """Checked before any model (or its tokenizer) loads, each error in one line."""
    from smcspec.grammars import grammar_of

    with pytest.raises(ValueError, match=message) as err:
        grammar_of(kind, text)
    assert "\n" not in str(err.value)


def test_a_compiled_constraint_is_the_one_the_tokenizer_uses(tokenizer):
    from smcspec.grammars import grammar_of

    for kind, text in (("regex", "(ab|ba)c?"), ("grammar", 'start: "ab"'), ("json_schema", {})):
        assert Constraint(grammar_of(kind, text), tokenizer, V).grammar == grammar_of(kind, text)
