"""A constraint llguidance gives up on, through the Python API and the command line (issue 25):
refused before decoding when the probe sees it (ValueError; exit 2 with one line), a
`ConstraintError` (a ValueError; exit 2) when a decode reaches it, never text that breaks it.

On a tiny random model with one token per byte (tests/server/test_tools.py), so any text can be
spelled. `logit_bias` +100 on "y" steers a decode into the branch of `EVADER` that the probe
(which walks the lowest token id, "x") does not take."""

import json

import pytest

from smcspec import LLM, cli
from smcspec.cli import generate as cli_generate
from smcspec.potentials import ConstraintError
from tests.server.test_tools import save_byte_model

BOMB = "^a{1000000}$"  # compiles; llguidance's lexer gives up at the first "a"
EVADER = "^(x|ya{1000000})$"
SCHEMA = {"type": "string", "pattern": EVADER}


def with_pattern(pattern: str) -> dict:
    return {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    folders = [tmp_path_factory.mktemp(name) for name in ("target", "draft")]
    for seed, folder in enumerate(folders):
        save_byte_model(folder, seed)
    return LLM(str(folders[0]), str(folders[1]), backend="native", dtype="float32")


def towards_y(llm: LLM) -> dict:
    (y,) = llm.tokenizer.encode("y", add_special_tokens=False)
    return {"logit_bias": {y: 100.0}, "max_new_tokens": 16, "seed": 0, "chat": False}


@pytest.mark.parametrize("method", ["ar", "smc"])
def test_a_schema_llguidance_gives_up_on_is_refused_before_decoding(llm, method):
    with pytest.raises(ValueError, match=r"invalid JSON schema: pattern .* too complex") as err:
        llm.request("hi", method, json_schema=with_pattern(BOMB), chat=False)
    assert repr(BOMB) in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("method", ["ar", "smc"])
def test_a_decode_where_llguidance_gives_up_raises_constraint_error(llm, method):
    """Before: finish_reason "stop" and the text '"y', which the schema does not match."""
    settings = towards_y(llm)
    llm.request("hi", method, json_schema=SCHEMA, **settings)  # the probe lets it through
    with pytest.raises(ConstraintError, match="llguidance gave up on the JSON schema") as err:
        llm.generate("hi", method, json_schema=SCHEMA, **settings)
    assert "\n" not in str(err.value)


def test_the_same_constraint_without_the_push_still_decodes(llm):
    """The evader's other branch is fine: without the bias the decode ends in "x"."""
    (x,) = llm.tokenizer.encode("x", add_special_tokens=False)
    out = llm.generate(
        "hi", "smc", json_schema=SCHEMA, **(towards_y(llm) | {"logit_bias": {x: 100.0}})
    )
    assert json.loads(out.text) == "x" and out.finish_reason == "stop"


def run_cli(monkeypatch, capsys, llm: LLM, *flags: str) -> tuple[int, str]:
    monkeypatch.setattr(cli_generate, "llm_from_args", lambda args, **kwargs: llm)
    head = ["generate", "hi", "--no-chat", "--seed", "0", "--max-new-tokens", "16"]
    status = cli.main([*head, *flags])
    return status, capsys.readouterr().err


def test_the_cli_refuses_a_schema_llguidance_gives_up_on_in_one_line(
    monkeypatch, capsys, llm, tmp_path
):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(with_pattern(BOMB)))
    status, err = run_cli(monkeypatch, capsys, llm, "--method", "smc", "--json-schema", str(path))
    assert status == 2, err
    assert err.count("\n") == 1 and "too complex" in err and repr(BOMB) in err, err


@pytest.mark.parametrize("method", ["ar", "smc"])
def test_the_cli_exits_2_in_one_line_when_a_decode_makes_llguidance_give_up(
    monkeypatch, capsys, llm, method
):
    """Before: exit 0, the text "y" on standard output."""
    (y,) = llm.tokenizer.encode("y", add_special_tokens=False)
    flags = ["--method", method, "--regex", EVADER, "--logit-bias", f"{y}=100"]
    status, err = run_cli(monkeypatch, capsys, llm, *flags)
    assert status == 2, err
    assert err.count("\n") == 1 and "llguidance gave up on the regex" in err, err
