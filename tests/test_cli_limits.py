"""The limit flags: `--max-running`, `--max-batch-tokens`, `--kv-pages`, `--kv-memory` on
generate and serve build one `EngineLimits`, serve's HTTP flags one `HTTPLimits`; their defaults
are read from those classes; a bad value is one line naming the flag, before any model loads;
`--kv-pages 8` gives the tiny models pools of 8 pages, and a request longer than that is refused
naming the flag."""

import json
from dataclasses import dataclass

import pytest

from smcspec import cli
from smcspec.cli import common as cli_common
from smcspec.cli import generate as cli_generate
from smcspec.cli import serve as cli_serve
from smcspec.config import EngineLimits, HTTPLimits

ENGINE = ("max_running", "max_batch_tokens", "kv_pages", "kv_memory")
HTTP = ("max_body_bytes", "shutdown_timeout", "read_timeout", "write_timeout")


def parsed(*words: str):
    return cli.build_parser().parse_args(list(words))


def test_the_flags_defaults_are_the_limits_defaults():
    engine, http = EngineLimits(), HTTPLimits()
    for args in (parsed("generate", "x"), parsed("serve")):
        assert cli_common.engine_limits(args) == engine
        assert {n: getattr(args, n) for n in ENGINE} == {n: getattr(engine, n) for n in ENGINE}
    serve = parsed("serve")
    assert cli_common.http_limits(serve) == http
    assert {n: getattr(serve, n) for n in HTTP} == {n: getattr(http, n) for n in HTTP}


def test_a_changed_default_reaches_the_flags(monkeypatch):
    """Failed on: --max-running's default written as 64 in cli_common; --read-timeout's as 10.0
    in cli_serve."""

    @dataclass(frozen=True)
    class Engine(EngineLimits):
        max_running: int = 3
        max_batch_tokens: int = 11

    @dataclass(frozen=True)
    class Http(HTTPLimits):
        read_timeout: float = 2.5

    monkeypatch.setattr(cli_common, "EngineLimits", Engine)
    monkeypatch.setattr(cli_serve, "HTTPLimits", Http)
    for args in (parsed("generate", "x"), parsed("serve")):
        assert (args.max_running, args.max_batch_tokens) == (3, 11)
    assert parsed("serve").read_timeout == 2.5


def test_help_prints_the_pool_default(capsys):
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--kv-pages N native engine: pages of 16 positions" in text
    assert "(default: 4096)" in text


@pytest.mark.parametrize("command", [["generate", "w1"], ["serve"]])
@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--max-running", "0"),
        ("--max-batch-tokens", "0"),
        ("--kv-pages", "0"),
        ("--kv-memory", "0"),
        ("--kv-memory", "1.5"),
    ],
)
def test_a_bad_engine_limit_is_one_line_naming_the_flag(no_loading, capsys, command, flag, value):
    """Failed on: run_generate building no EngineLimits before loading (the models are looked
    for: Loading)."""
    assert cli.main([*command, flag, value]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"smcspec: error: {flag}: ") and "\n" not in err


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--max-body-bytes", "0"),
        ("--shutdown-timeout", "-1"),
        ("--read-timeout", "0"),
        ("--write-timeout", "0"),
    ],
)
def test_a_bad_http_limit_is_one_line_naming_the_flag(no_loading, capsys, flag, value):
    assert cli.main(["serve", flag, value]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"smcspec: error: {flag}: ") and "\n" not in err


def test_kv_pages_and_kv_memory_exclude_each_other(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["generate", "w1", "--kv-pages", "8", "--kv-memory", "0.5"])
    assert done.value.code == 2
    assert "not allowed with argument --kv-pages" in capsys.readouterr().err


@pytest.fixture
def tiny_args(tiny_llama_folder, tiny_llama_draft_folder):
    return ["--target", str(tiny_llama_folder), "--draft", str(tiny_llama_draft_folder)]


def test_generate_kv_pages_sizes_the_pools(monkeypatch, capsys, tiny_args):
    """auto's costs are pinned to ones that favour rows (every row free: N = 4, K = 8 is the
    fastest setting), so the outcome does not hang on this machine's speed. 1 + 20 + 8
    positions are 3 pages a row with the spare one: 4 rows need 12 of the 8 pages, so auto must
    weigh 2 rows at most. Failed on: run_generate loading the LLM without its limits (4096
    pages); auto reserving and choosing 4 rows (exit 1, "sequence 2 needs 1 pages, 0 free",
    seen on a 2-core Xeon where the profile's speeds picked them)."""
    from smcspec.engine import costs as cm
    from smcspec.engine import probes

    built = []
    real = cli_common.llm_from_args

    def spy(args, **kwargs):
        built.append(real(args, **kwargs))
        return built[-1]

    monkeypatch.setattr(cli_generate, "llm_from_args", spy)
    flat = cm.StepCosts(target_fit=(1.0, 0.0), draft_fit=(0.01, 0.0))
    monkeypatch.setattr(probes, "profile", lambda llm, **kwargs: flat)
    words = ["generate", "w1", *tiny_args, "--backend", "native", "--dtype", "float32"]
    limits = ["--kv-pages", "8", "--max-running", "2"]
    assert cli.main([*words, *limits, "--max-new-tokens", "20", "--seed", "0", "--json"]) == 0
    [llm] = built
    assert llm.limits == EngineLimits(max_running=2, kv_pages=8)
    assert llm.target.pages.num_pages == llm.draft.pages.num_pages == 8
    out = json.loads(capsys.readouterr().out)
    assert out["new_tokens"] == 20
    assert max(s.get("particles", 1) for s in out["settings"]) == 2


def test_serve_kv_pages_reaches_the_server_which_refuses_a_longer_request(monkeypatch, tiny_args):
    """`serve --kv-pages 8 --read-timeout 3`, up to the point where it would listen. The
    server's limits are those flags; 3 + 120 positions need 9 pages with the scheduler's spare
    one: refused, naming the pool and the flag. Failed on: run_serve dropping its limits (4096
    pages); the HTTP flags not reaching ServeDefaults.http (read_timeout 10)."""
    from smcspec.server import app as app_module

    apps = []

    class Listening:
        def __init__(self, app, host, port):
            apps.append(app)

        def run(self):
            pass

    monkeypatch.setattr(app_module, "HTTPServer", Listening)
    words = ["serve", *tiny_args, "--backend", "native", "--dtype", "float32"]
    assert cli.main([*words, "--kv-pages", "8", "--read-timeout", "3"]) == 0
    server = apps[0].state.server
    try:
        limits = server.limits()
        assert (limits["kv_pages"], limits["page_size"], limits["read_timeout"]) == (8, 16, 3)
        # refused when planned (the server's plan turns it into a 400), before it is queued
        with pytest.raises(ValueError, match=r"\(8 pages x 16 positions\).*--kv-pages"):
            server.llm.request([3, 4, 5], "ar", max_new_tokens=120, stop_at_eos=False)
    finally:
        server.shutdown()
