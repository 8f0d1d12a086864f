"""A constraint llguidance gives up on (issue 25): refused when it is built if its first tokens
or a JSON schema's `pattern` already make llguidance give up, and otherwise an error at the dead
end, never an output that breaks it. Toy models over the byte vocabulary of tests/test_potentials
(EOS = 0, byte b = token b + 1).

`a{1000000}` and `((a{100}){100}){100}` compile, but llguidance's lexer runs out of fuel
("too many expressions constructed") at the first token inside them."""

import json

import llguidance
import pytest
import torch

from smcspec.config import SamplingConfig, SMCConfig
from smcspec.decoding import AutoregressiveDecoder, SMCDecoder
from smcspec.models.toy import perturbed_lm, random_lm
from smcspec.potentials import Constraint, ConstraintError, Product, TokenRule
from tests.test_potentials import byte_guidance_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # toy models (see tests/conftest.py)

V = 257
PROMPT = [ord("q") + 1]
CFG = SamplingConfig(temperature=1.0, max_new_tokens=6)
BOMBS = ["^a{1000000}$", "^((a{100}){100}){100}$"]
# Compiles and passes the probe, which walks the lowest token id ("x"); "y" is the bomb.
EVADER = "^(x|ya{1000000})$"


def byte(ch: str) -> int:
    return ord(ch) + 1


@pytest.fixture(scope="module")
def tokenizer():
    return byte_guidance_tokenizer()


@pytest.fixture(scope="module")
def pair():
    target = random_lm(V, seed=41, scale=2.0)
    return target, perturbed_lm(target, seed=42, noise=0.8)


def string_schema(pattern: str) -> dict:
    return {
        "type": "object",
        "properties": {"s": {"type": "string", "pattern": pattern}},
        "required": ["s"],
    }


def gives_up(tokenizer, grammar: str, text: str) -> bool:
    """Whether llguidance's own matcher, with its default limits, errs on a prefix of text: the
    oracle that the bombs really are bombs (and the evader's other branch is not)."""
    import llguidance.torch

    m = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    words = llguidance.torch.allocate_token_bitmask(1, V)
    for ch in text:
        llguidance.torch.fill_next_token_bitmask(m, words, 0)
        if m.is_error() or not m.consume_token(byte(ch)):
            break
    llguidance.torch.fill_next_token_bitmask(m, words, 0)
    return m.is_error()


def test_a_bomb_makes_llguidance_give_up_mid_string(tokenizer):
    grammar = llguidance.LLMatcher.grammar_from_json_schema(string_schema(BOMBS[0]))
    assert not gives_up(tokenizer, grammar, '{"s":"')
    assert gives_up(tokenizer, grammar, '{"s":"a')


def build(kind: str, pattern: str, tokenizer) -> Constraint:
    if kind == "json_schema":
        return Constraint.json_schema(string_schema(pattern), tokenizer, V)
    if kind == "regex":
        return Constraint.regex(pattern, tokenizer, V)
    # a tool call's shape: a schema inside a Lark grammar
    text = f'start: "<call>" args\nargs: %json {json.dumps(string_schema(pattern))}\n'
    return Constraint.lark(text, tokenizer, V)


@pytest.mark.parametrize(
    ("kind", "pattern"),
    [("json_schema", BOMBS[0]), ("json_schema", BOMBS[1]), ("regex", BOMBS[0]), ("lark", BOMBS[1])],
)
def test_a_constraint_llguidance_gives_up_on_is_refused_when_built(tokenizer, kind, pattern):
    """Before any decoding, in one line that names the pattern."""
    with pytest.raises(ValueError, match=r"too complex.*llguidance gives up") as err:
        build(kind, pattern, tokenizer)
    assert "\n" not in str(err.value)
    if kind != "regex":
        assert repr(pattern) in str(err.value)


def test_patterns_that_llguidance_handles_still_compile(tokenizer):
    for pattern in ["^a{3000}$", r"^\d{3}-\d{4}$", "^[a-z]{2,8}@x\\.com$", "^.{0,2000}$", EVADER]:
        Constraint.json_schema(string_schema(pattern), tokenizer, V)


def test_a_grammar_over_the_size_bound_is_refused(tokenizer):
    """10,000 optional properties: about 80k symbols, 8 s to compile under llguidance's default
    bound (500k); over ours it is refused at once."""
    many = {"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(10_000)}}
    with pytest.raises(ValueError, match="invalid JSON schema: grammar size"):
        Constraint.json_schema(many, tokenizer, V)


def no_x() -> TokenRule:
    """Anything but "x": with EVADER the only way on is "y", into the bomb."""

    def allowed(prefix):
        mask = torch.ones(V, dtype=torch.bool)
        mask[byte("x")] = False
        return mask

    return TokenRule(allowed, complete=lambda prefix: True)


@pytest.mark.parametrize("method", ["ar", "smc"])
def test_a_decode_that_makes_llguidance_give_up_raises(pair, tokenizer, method):
    """Before: ar returned "y" and smc a particle of free text, both as if they had stopped."""
    target, draft = pair
    potential = Product([Constraint.regex(EVADER, tokenizer, V), no_x()])
    if method == "ar":
        decoder = AutoregressiveDecoder(target, potential)
    else:
        decoder = SMCDecoder(target, draft, SMCConfig(4, 2, 0.5), potential)
    with pytest.raises(
        ConstraintError, match="llguidance gave up on the regex: lexer error"
    ) as err:
        decoder.decode(PROMPT, CFG, torch.Generator().manual_seed(0))
    assert isinstance(err.value, ValueError) and "\n" not in str(err.value)


def test_sampling_settings_that_leave_no_allowed_token_are_named(pair, tokenizer):
    """top_k = 1 keeps only the target's arg-max; a constraint that forbids it is a dead end of
    the settings, not of the grammar."""
    target, _ = pair
    best = int(target.logits(tuple(PROMPT)).argmax())
    other = next(t for t in (byte("a"), byte("b")) if t != best)
    only = Constraint.regex(chr(other - 1) + "+", tokenizer, V)
    greedy = SamplingConfig(temperature=1.0, top_k=1, max_new_tokens=4)
    with pytest.raises(ConstraintError, match="top_k"):
        AutoregressiveDecoder(target, only).decode(PROMPT, greedy, torch.Generator())


def dead_after_a_first_two() -> TokenRule:
    """Vocabulary {EOS, 1, 2}, EOS never allowed: a particle whose first token is 2 hits a dead
    end (nothing allowed after it); the others are cut at the length limit, valid prefixes."""

    def allowed(prefix):
        if prefix[:1] == (2,):
            return torch.zeros(3, dtype=torch.bool)
        return torch.tensor([False, True, True])

    return TokenRule(allowed, complete=lambda prefix: False)


def test_when_no_particle_is_complete_the_answer_is_a_prefix_cut_at_the_limit_not_a_dead_one():
    """Every particle ends with weight zero (dead, or cut before completing). The answer is
    drawn among the cut ones, whose text is still a prefix of the language, and the decode ends
    at the length limit without an error. Before: drawn among all, dead ones included."""
    target = random_lm(3, seed=37, scale=0.5)  # p(1 | prompt) = 0.63 of the two allowed
    draft = perturbed_lm(target, seed=38, noise=0.3)
    decoder = SMCDecoder(target, draft, SMCConfig(8, 2, 0.0), dead_after_a_first_two())
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=3, stop_at_eos=False)
    dead_seen = 0
    for seed in range(12):
        out = decoder.decode([1], cfg, torch.Generator().manual_seed(seed))
        dead = [p[0] == 2 for p in out.particles]
        dead_seen += sum(dead)
        assert out.stats.valid_particles == 0 and not all(dead)
        assert out.tokens[0] != 2 and len(out.tokens) == 3, (seed, out.particles)
    assert dead_seen >= 24  # a quarter of the 96 particles or more: a uniform draw picks some
