"""Fuzzing the server's OpenAPI schema (schemathesis): valid and invalid bodies, no 5xx."""

import zlib

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.server.conftest import MODEL

EXAMPLES = 150  # per operation and generation mode; bounded so CI stays fast


def operations(served):
    schema = schemathesis.openapi.from_url(served.url + "/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


def test_the_schema_lists_every_endpoint(served):
    listed = {(op.method.upper(), op.path) for op in operations(served)}
    assert listed == {
        ("GET", "/health"),
        ("GET", "/metrics"),
        ("GET", "/v1/models"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
    }


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_no_generated_request_gets_a_server_error(served, mode):
    """Half the bodies name the served model so generation itself is exercised, with every
    setting the schema allows (fuzzing found a NaN law at top_p = 5e-324 and power_alpha =
    5e-324, both fixed with tests in tests/test_sampling.py and tests/decoding)."""
    generation = schemathesis.GenerationMode(mode)
    statuses: dict[int, int] = {}
    for op in operations(served):
        if mode == "negative" and op.method.upper() != "POST":
            continue  # nothing in a bare GET can be made invalid

        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=op.as_strategy(generation_mode=generation))
        def check(case):
            if (
                isinstance(case.body, dict)
                and "model" in case.body
                and zlib.crc32(repr(case.body).encode()) % 2
            ):
                case.body["model"] = MODEL
            response = case.call(timeout=120)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            assert response.status_code < 500, (case.body, response.text[:500])
            if response.status_code >= 400:
                assert response.json()["error"]["message"]

        check()
    assert statuses.get(400, 0) > 0
    if mode == "positive":
        assert statuses.get(200, 0) > 10, statuses
    served.wait_idle()
    assert served.llm.target.pages.used_pages == 0
