"""Stop strings over HTTP when characters arrive a byte per token: the completion, whole and
streamed, ends just before the stop, and no unfinished character's U+FFFD is sent or stops it."""

import pytest

from smcspec.server.app import ServeDefaults
from tests.engine.byte_level import PROMPT, script_llm
from tests.server.conftest import serve

SCRIPT = "x你好y café Grüße 😀!"
MODEL = "bytes"


@pytest.fixture(scope="module")
def served_bytes():
    defaults = ServeDefaults(MODEL, particles=2, draft_tokens=3, max_tokens=64)
    handle, server, thread = serve(script_llm(SCRIPT.encode()), defaults)
    yield handle
    server.should_exit = True
    thread.join(timeout=30)


@pytest.mark.parametrize("method", ["ar", "sd", "smc"])
def test_a_completion_stops_before_a_multibyte_stop_streamed_or_not(served_bytes, method):
    client = served_bytes.client()
    asked = {"model": MODEL, "prompt": PROMPT, "seed": 0, "stop": ["Grüße", "\ufffd"]}
    asked["extra_body"] = {"method": method}
    whole = client.completions.create(**asked).choices[0]
    deltas = [c.choices[0].text for c in client.completions.create(**asked, stream=True)]
    assert whole.text == "".join(deltas) == "x你好y café "
    assert whole.finish_reason == "stop"
    assert not any("\ufffd" in d for d in deltas)
