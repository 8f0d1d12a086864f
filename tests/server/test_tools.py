"""Tool calling through the `openai` client, on a tiny random model whose tokenizer is byte-level
(so a grammar can spell any call) and has <tool_call> / </tool_call> tokens of its own, as
Qwen2.5's does. Whatever the random model prefers, the grammar makes every reply a well-formed
call whose arguments follow the function's schema."""

import json

import pytest
import requests

from smcspec import LLM
from smcspec.server.app import ServeDefaults
from tests.conftest import save_random_model
from tests.server.conftest import serve

MODEL = "tiny-tools"
# Like Qwen2.5's template: the tools in the prompt, earlier calls and tool results in the chat.
TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }} {% endfor %}</tools>\n"
    "{% endif %}{% for m in messages %}{{ m.role }}: {{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{{ c.function | tojson }}\n</tool_call>"
    "{% endfor %}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Rome"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "now"}}  # no parameters: arguments {}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


def serve_byte_pair(tmp_path_factory, defaults: ServeDefaults):
    """A server over two byte-level models (target seed 0, draft seed 1) in float32, for a
    module-scoped fixture to `yield from`; stopped when the fixture ends."""
    folders = [tmp_path_factory.mktemp(name) for name in ("target", "draft")]
    for seed, folder in enumerate(folders):
        save_byte_model(folder, seed)
    llm = LLM(str(folders[0]), str(folders[1]), backend="native", dtype="float32")
    handle, server, thread = serve(llm, defaults)
    yield handle
    server.should_exit = True
    thread.join(timeout=30)


def save_byte_model(folder, seed: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # one token per byte
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2} | {c: i + 3 for i, c in enumerate(alphabet)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    tok.add_tokens(["<tool_call>", "</tool_call>"])
    tok.chat_template = TEMPLATE
    save_random_model(folder, tok, seed, max_positions=512)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    defaults = ServeDefaults(MODEL, particles=3, draft_tokens=3, max_tokens=96)
    yield from serve_byte_pair(tmp_path_factory, defaults)


def ask(served, **extra):
    """A chat with both tools; one call at most (a random model would chain calls to the
    token limit; several calls are checked on the grammar below)."""
    body = {"model": MODEL, "messages": MESSAGES, "tools": [WEATHER, CLOCK], "seed": 1}
    body |= {"parallel_tool_calls": False, **extra}
    return served.client().chat.completions.create(**body)


def check_call(call) -> dict:
    """A call's arguments as an object, checked against its function's schema."""
    arguments = json.loads(call.function.arguments)
    assert call.type == "function" and call.id.startswith("call_")
    if call.function.name == "get_weather":
        assert arguments["city"] in ("Paris", "Rome")
        assert set(arguments) <= {"city", "days"}
        assert 1 <= arguments.get("days", 1) <= 14
    else:
        assert call.function.name == "now" and arguments == {}
    return arguments


@pytest.mark.parametrize("method", ["smc", "ar"])
def test_a_required_call_is_well_formed(served, method):
    for seed in range(3):
        out = ask(served, tool_choice="required", seed=seed, extra_body={"method": method})
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None and choice.message.tool_calls
        for call in choice.message.tool_calls:
            check_call(call)


def test_a_named_function_is_called_once(served):
    out = ask(served, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    calls = out.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather"]
    check_call(calls[0])


def test_auto_gives_text_or_well_formed_calls(served):
    for seed in range(4):
        choice = ask(served, seed=seed, max_tokens=48).choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            for call in choice.message.tool_calls:
                check_call(call)
        else:
            assert not (choice.message.content or "").startswith("<")


def test_none_hides_the_tools_and_calls_nothing(served):
    out = ask(served, tool_choice="none", max_tokens=8)
    assert out.choices[0].message.tool_calls is None
    tokens = requests.post(
        served.url + "/tokenize", json={"model": MODEL, "messages": MESSAGES}, timeout=30
    ).json()["count"]
    assert out.usage.prompt_tokens == tokens  # the prompt of a chat without tools


def test_streamed_calls_add_up_to_the_same_calls(served):
    whole = ask(served, tool_choice="required").choices[0].message.tool_calls
    parts: dict[int, dict] = {}
    reasons = []
    for chunk in ask(served, tool_choice="required", stream=True):
        if not chunk.choices:
            continue
        reasons.append(chunk.choices[0].finish_reason)
        for call in chunk.choices[0].delta.tool_calls or []:
            part = parts.setdefault(call.index, {"name": "", "arguments": ""})
            part["name"] += call.function.name or ""
            part["arguments"] += call.function.arguments or ""
    assert reasons[-1] == "tool_calls"
    got = [(p["name"], json.loads(p["arguments"])) for _, p in sorted(parts.items())]
    assert got == [(c.function.name, json.loads(c.function.arguments)) for c in whole]


def test_a_conversation_with_calls_and_results_continues(served):
    first = ask(served, tool_choice="required").choices[0].message
    call = first.tool_calls[0]
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"},
    ]
    out = served.client().chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER, CLOCK], max_tokens=8, seed=0
    )
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    longer = out.usage.prompt_tokens - ask(served, max_tokens=1).usage.prompt_tokens
    assert longer >= len(call.function.arguments) + len("18 C, sunny")  # both were rendered


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
        ({"tools": [WEATHER, WEATHER]}, "same name"),
        ({"response_format": {"type": "json_object"}}, "cannot be combined"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "tool_call_id"),
        ({"method": "sd", "tool_choice": "required"}, "sd"),
    ],
)
def test_inconsistent_tool_requests_get_a_400(served, extra, says):
    body = {"model": MODEL, "messages": MESSAGES, "tools": [WEATHER], **extra}
    r = requests.post(served.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert says in r.json()["error"]["message"]


def matches(grammar_text: str, reply: str, tokenizer) -> bool:
    """Whether the grammar accepts `reply` whole, token by token."""
    import llguidance
    import llguidance.hf

    from smcspec.grammars import grammar_of

    ll = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))
    matcher = llguidance.LLMatcher(ll, grammar_of("grammar", grammar_text), log_level=0)
    ids = tokenizer.encode(reply, add_special_tokens=False)
    return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
NOW = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'


@pytest.mark.parametrize(
    ("choice", "parallel", "reply", "accepted"),
    [
        ("required", True, CALL, True),
        ("required", True, CALL + "\n" + NOW, True),
        ("required", False, CALL + "\n", True),  # the newline a template ends a call with
        ("required", False, CALL + "\n\n", False),
        ("required", False, CALL + "\n" + NOW, False),
        ("required", True, "It is sunny.", False),
        ("required", True, CALL.replace("Paris", "Oslo"), False),
        ("required", True, CALL.replace('"Paris"}', '"Paris", "x": 1}'), False),
        ("required", True, NOW.replace("{}", '{"a": 1}'), False),
        ("required", True, CALL.replace('{"name"', '{ "name"'), False),
        ("auto", True, "It is sunny.", True),
        ("auto", True, CALL, True),
        ("auto", True, "<b>sunny</b>", False),
        ({"type": "function", "function": {"name": "now"}}, True, NOW, True),
        ({"type": "function", "function": {"name": "now"}}, True, CALL, False),
    ],
)
def test_the_grammar_admits_exactly_well_formed_replies(
    tmp_path, choice, parallel, reply, accepted
):
    from transformers import AutoTokenizer

    from smcspec.server import tools

    save_byte_model(tmp_path, 0)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    grammar = tools.grammar([WEATHER, CLOCK], choice, parallel, special_tags=True)
    assert matches(grammar, reply, tokenizer) == accepted


def test_replies_parse_into_openai_calls():
    from smcspec.server import tools

    content, calls = tools.parse("Let me look. " + CALL + "\n" + NOW)
    assert content == "Let me look."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("now", {}),
    ]
    assert len({c["id"] for c in calls}) == 2
    assert tools.parse("no call") == ("no call", [])
    cut = CALL[:30]
    assert tools.parse(cut) == (cut, [])  # a call cut short stays text
