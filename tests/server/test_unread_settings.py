"""Over HTTP, a method's setting given for a method that does not read it is a 400 naming it;
the server's own defaults fill in only what the request's method reads (the Python and command
line sides: tests/test_settings_kept.py)."""

import pytest
import requests


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"method": "sd", "particles": 4}, "particles"),
        ({"method": "ar", "approximate": True}, "approximate"),
        ({"method": "msd", "resampling": "multinomial"}, "resampling"),
        ({"resample_threshold": 0.3}, "resample_threshold"),
    ],
)
def test_http_refuses_an_unread_setting_with_a_400_naming_it(served, body, param):
    """The served defaults (N = 4, K = 3) are the server's, not the request's: a request for
    sd is not refused for them (the next test)."""
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, **body}
    resp = requests.post(served.v1 + "/completions", json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


def test_http_server_defaults_fill_in_only_what_the_method_reads(served):
    """sd reads the server's K = 3, not its N = 4. Failed on: the defaults passed as the
    request's own settings (refused: particles is not sd's)."""
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 4, "method": "sd", "seed": 0}
    resp = requests.post(served.v1 + "/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    ext = resp.json()["choices"][0]["smcspec"]
    assert ext["method"] == "sd"
    assert ext["diagnostics"]["proposed_tokens"] % 3 == 0  # rounds of K = 3 drafts
