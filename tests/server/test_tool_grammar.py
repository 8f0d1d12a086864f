"""The tool-call grammar refuses, by its own token mask, a call of a function that is not among
the tools and a call of one tool with another tool's arguments: a random model that never
happens to write such a call would not show it over HTTP.

Each reply is fed through the mask the decoders sample under (`potentials.Constraint`), one
byte-level token at a time, and the test names the token where the mask first says no: it must
be the first byte where the reply leaves every allowed call, so a grammar that refused the reply
for some other reason (or only at the end) fails too."""

import pytest

from smcspec.potentials import Constraint
from smcspec.server import tools
from tests.server.test_tools import CALL, CLOCK, NOW, WEATHER, save_byte_model

TOOLS = [WEATHER, CLOCK]
NAMED_NOW = {"type": "function", "function": {"name": "now"}}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("byte-model")
    save_byte_model(folder, 0)
    return AutoTokenizer.from_pretrained(folder)


def refused_at(choice, parallel: bool, reply: str, tokenizer) -> str | None:
    """The reply up to and with the first token the grammar's mask refuses; None when every
    token is allowed and the whole reply is a complete one."""
    grammar = tools.grammar(TOOLS, choice, parallel, special_tags=True)
    constraint = Constraint.lark(grammar, tokenizer, len(tokenizer))
    state = constraint.start()
    ids = tokenizer.encode(reply, add_special_tokens=False)
    for n, token in enumerate(ids):
        if not constraint.allowed(state)[token]:
            return tokenizer.decode(ids[: n + 1])
        state = constraint.advance(state, token)
    assert constraint.log_end(state) == 0.0, f"{reply!r} is allowed but not complete"
    return None


def call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


@pytest.mark.parametrize("choice", ["required", "auto"])
@pytest.mark.parametrize("parallel", [True, False])
def test_the_well_formed_calls_pass_the_mask(tokenizer, choice, parallel):
    assert refused_at(choice, parallel, CALL, tokenizer) is None
    assert refused_at(choice, parallel, NOW, tokenizer) is None


UNKNOWN = {
    "another name": (call("get_time", "{}"), '"name": "get_t'),
    "a known name made longer": (call("nowcast", "{}"), '"name": "nowc'),
    "a known name cut short": (call("get_weath", '{"city": "Paris"}'), '"name": "get_weath"'),
    "an empty name": (call("", "{}"), '"name": ""'),
    "another name in a second call": (CALL + "\n" + call("set_alarm", "{}"), '"name": "s'),
}


@pytest.mark.parametrize("choice", ["required", "auto"])
@pytest.mark.parametrize(("reply", "refused"), UNKNOWN.values(), ids=UNKNOWN.keys())
def test_a_function_that_is_not_a_tool_is_refused_by_the_mask(tokenizer, choice, reply, refused):
    got = refused_at(choice, True, reply, tokenizer)
    assert got is not None and got.endswith(refused), got


SWAPPED = {
    # now takes no arguments: after "{" only "}" may come
    "now with get_weather's arguments": (call("now", '{"city": "Paris"}'), '"arguments": {"'),
    # get_weather requires city: "{}" cannot close its arguments
    "get_weather with now's arguments": (call("get_weather", "{}"), '"arguments": {}'),
    "get_weather with now's arguments, second call": (
        NOW + "\n" + call("get_weather", "{}"),
        '"get_weather", "arguments": {}',
    ),
}


@pytest.mark.parametrize("choice", ["required", "auto"])
@pytest.mark.parametrize(("reply", "refused"), SWAPPED.values(), ids=SWAPPED.keys())
def test_a_tool_with_another_tools_arguments_is_refused_by_the_mask(
    tokenizer, choice, reply, refused
):
    got = refused_at(choice, True, reply, tokenizer)
    assert got is not None and got.endswith(refused), got


def test_the_named_function_with_another_tools_arguments_is_refused_by_the_mask(tokenizer):
    reply, refused = SWAPPED["now with get_weather's arguments"]
    got = refused_at(NAMED_NOW, True, reply, tokenizer)
    assert got is not None and got.endswith(refused), got
