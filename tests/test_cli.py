"""The CLI refuses bad input with one line and exit status 2, before loading any model."""

import subprocess
import sys

import pytest

from smcspec import cli


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["-n", "0"], "particles"),
        (["-k", "0"], "draft_tokens"),
        (["--resample-threshold", "2"], "resample_threshold"),
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "0"], "top_p"),
        (["--max-new-tokens", "0"], "max_new_tokens"),
        (["--target", "/no/such/target.gguf", "--draft", "/no/such/draft"], "does not exist"),
        (["--power-alpha", "0"], "alpha"),
        (["--json-schema", "/no/such/schema.json"], "cannot read"),
        (["--reward", "no_such_module_xyz:f"], "cannot import"),
        (["--reward", "json:no_such_function"], "no function"),
        (["--reward", "json"], "module:function"),
        (["--reward", "json:dumps", "--reward-every", "0"], "every"),
        (["--method", "sd", "--power-alpha", "2"], "sd cannot take potentials"),
    ],
)
def test_bad_input_exits_2_with_one_line(capsys, args, field):
    assert cli.main(["generate", "hello", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("smcspec: error:") and field in err and "\n" not in err


def test_empty_prompt_exits_2(capsys):
    assert cli.main(["generate", "  "]) == 2
    assert "prompt is empty" in capsys.readouterr().err


def test_unknown_method_is_an_argparse_error():
    result = subprocess.run(
        [sys.executable, "-m", "smcspec.cli", "generate", "hi", "--method", "beam"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2 and "invalid choice" in result.stderr
    assert "Traceback" not in result.stderr
