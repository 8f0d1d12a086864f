"""The CLI: every subcommand's help and plain form work; bad input gets one line and exit
status 2 before any model loads; generate's options reach `LLM.generate`."""

import argparse
import io
import json
import subprocess
import sys

import pytest
import torch

from smcspec import LLM, cli
from smcspec.cli import generate as cli_generate
from smcspec.config import AutoConfig, SMCConfig
from tests.conftest import Loading


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["--particles", "0"], "particles"),
        (["--particles", "65"], "--allow-large"),
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


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(words, parser) of the root and every subcommand, read from the parser itself."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, (*path, name))


def is_leaf(parser: argparse.ArgumentParser) -> bool:
    return not any(isinstance(a, argparse._SubParsersAction) for a in parser._actions)


ALL = list(commands(cli.build_parser()))
LEAVES = [(path, p) for path, p in ALL if is_leaf(p)]


@pytest.mark.parametrize("path", [path for path, _ in ALL], ids=" ".join)
def test_every_command_has_a_help(capsys, path):
    with pytest.raises(SystemExit) as done:
        cli.main([*path, "--help"])
    assert done.value.code == 0
    assert "usage: smcspec" in capsys.readouterr().out


@pytest.mark.parametrize(("path", "parser"), ALL, ids=[" ".join(p) for p, _ in ALL])
def test_every_option_states_its_default(path, parser):
    formatter = parser._get_formatter()
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS:
            continue
        if isinstance(action, argparse._HelpAction | argparse._VersionAction):
            continue
        if isinstance(action, argparse._StoreTrueAction):
            continue  # off unless given
        shown = action.help and formatter._get_help_string(action)  # no help: nothing shown
        assert shown and "default" in shown, (path, action.option_strings)


def toy_speed_results(folder) -> None:
    """A speed.jsonl for `bench report` to read, from toy models."""
    from smcspec.bench.contenders import build_grid
    from smcspec.bench.speed import SpeedPlan, run_speed
    from smcspec.models.toy import perturbed_lm, random_lm
    from tests.bench.test_runs import WordTokenizer

    target = random_lm(5, seed=1)
    llm = LLM.from_models(target, perturbed_lm(target, seed=2, noise=0.5), WordTokenizer())
    plan = SpeedPlan(build_grid(["ar"], [2], [2], [2]), [0.7], prompts=1, max_new_tokens=2)
    run_speed(llm, plan, folder)


@pytest.mark.parametrize("path", [path for path, _ in LEAVES], ids=" ".join)
def test_every_command_runs_without_options(no_loading, tmp_path, monkeypatch, path):
    """Each subcommand with only its required arguments passes every check and gets as far as
    loading the models (or, for report, reads the results in ./bench-results)."""
    monkeypatch.chdir(tmp_path)
    toy_speed_results(tmp_path / "bench-results")
    parser = dict(LEAVES)[path]
    positionals = ["w1" for a in parser._actions if not a.option_strings]
    try:
        status = cli.main([*path, *positionals])
    except Loading:
        return  # every check passed; the models were next
    if path == ("bench", "gpu") and not torch.cuda.is_available():
        assert status == 2  # refused in one line: hours of CPU time otherwise (test_gpu.py)
        return
    assert status == 0


def test_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"smcspec {version('smcspec')}"


def test_n_is_not_an_option_any_more(capsys):
    """`-n` means choices in OpenAI's API and tokens in llama.cpp: only --particles exists."""
    for command in (["generate", "w1"], ["serve"], ["bench", "json"]):
        with pytest.raises(SystemExit) as done:
            cli.main([*command, "-n", "4"])
        assert done.value.code == 2
        assert "unrecognized arguments: -n" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--device", "cuda"], "CUDA is not available"),
        (["--device", "cuda:1"], "CUDA is not available"),
        (["--device", "tpu"], "device must be"),
        (["--regex", "(ab"], "invalid regex"),
        (["--regex", "[z-a]"], "invalid regex"),
        (["--system", "be brief", "--no-chat"], "--system"),
    ],
)
def test_device_and_constraints_are_checked_before_loading(
    capsys, monkeypatch, no_loading, args, message
):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert cli.main(["generate", "w1", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("smcspec: error:") and message in err and "\n" not in err


@pytest.mark.parametrize(
    ("flag", "text", "message"),
    [
        ("--json-schema", "{not json", "invalid JSON schema"),
        ("--json-schema", '{"type": "objectx"}', "invalid JSON schema"),
        ("--json-schema", "[1, 2]", "invalid JSON schema"),
        ("--grammar", "start: foo(", "invalid grammar"),
        ("--grammar", "start: undefined_rule", "invalid grammar"),
    ],
)
def test_bad_schema_and_grammar_files_are_checked_before_loading(
    capsys, no_loading, tmp_path, flag, text, message
):
    path = tmp_path / "file"
    path.write_text(text)
    assert cli.main(["generate", "w1", flag, str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("smcspec: error:") and message in err and "\n" not in err


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama_folder, tiny_llama_draft_folder):
    return LLM(str(tiny_llama_folder), str(tiny_llama_draft_folder), dtype="float32")


def run_generate(monkeypatch, capsys, llm, args, stdin: str | None = None):
    """`smcspec generate ARGS --json` on `llm`; (the arguments `LLM.plan` got, output)."""
    calls = []
    real = llm.plan

    def spy(prompt, decoding, sampling, potential, **kw):
        calls.append({"prompt": prompt, "decoding": decoding, "sampling": sampling, **kw})
        return real(prompt, decoding, sampling, potential, **kw)

    monkeypatch.setattr(llm, "plan", spy)
    monkeypatch.setattr(cli_generate, "llm_from_args", lambda args, **kwargs: llm)
    if stdin is not None:
        monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    assert cli.main(["generate", *args, "--max-new-tokens", "3", "--seed", "0", "--json"]) == 0
    return calls[0], json.loads(capsys.readouterr().out)


def test_generate_defaults_to_auto_which_runs_smc_with_a_potential(monkeypatch, capsys, tiny_llm):
    call, out = run_generate(monkeypatch, capsys, tiny_llm, ["w1 w2"])
    assert call["decoding"] == AutoConfig() and out["method"] == "auto"
    assert {s["method"] for s in out["settings"]} <= {"ar", "sd", "msd"}
    call, _ = run_generate(monkeypatch, capsys, tiny_llm, ["w1 w2", "--approximate"])
    assert call["decoding"] == AutoConfig(exact=False)
    call, out = run_generate(monkeypatch, capsys, tiny_llm, ["w1", "--power-alpha", "2"])
    assert call["decoding"] == AutoConfig() and out["method"] == "auto"
    [chosen] = out["settings"]
    assert chosen["method"] == "smc" and len(out["particle_texts"]) == chosen["particles"]
    assert call["sampling"].max_new_tokens == 3 and call["sampling"].seed == 0


def test_system_message_goes_before_the_prompt(monkeypatch, capsys, tiny_llm):
    call, _ = run_generate(monkeypatch, capsys, tiny_llm, ["w1 w2", "--system", "w5"])
    messages = [{"role": "system", "content": "w5"}, {"role": "user", "content": "w1 w2"}]
    assert call["prompt"] == tiny_llm.encode_messages(messages)


def test_a_dash_reads_the_prompt_from_standard_input(monkeypatch, capsys, tiny_llm):
    call, _ = run_generate(monkeypatch, capsys, tiny_llm, ["-"], stdin="w3 w4\n")
    assert call["prompt"] == "w3 w4\n"


def test_an_empty_standard_input_is_an_empty_prompt(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert cli.main(["generate", "-"]) == 2
    assert "prompt is empty" in capsys.readouterr().err


def test_stop_strings_reach_generate(monkeypatch, capsys, tiny_llm):
    args = ["w1", "--stop", "w7", "--stop", "w9 w9"]
    call, out = run_generate(monkeypatch, capsys, tiny_llm, args)
    assert call["stop"] == ["w7", "w9 w9"]
    assert "finish_reason" in out


def test_every_default_is_read_from_the_configs():
    """Each default is written once, in its dataclass: the CLI, `generate`'s keywords, the
    server and the bench read it there (the server starts from OpenAI's temperature)."""
    from smcspec.config import SERVER_TEMPERATURE, SamplingConfig
    from smcspec.engine import configs_from_fields
    from smcspec.server.runtime import ServeDefaults

    parser = cli.build_parser()
    gen, serve = parser.parse_args(["generate", "x"]), parser.parse_args(["serve"])
    converted = configs_from_fields({"method": "smc"})[0]
    sampling, smc = SamplingConfig(), SMCConfig()
    for name in ("temperature", "top_k", "top_p", "max_new_tokens"):
        assert getattr(gen, name) == getattr(sampling, name), name
    assert configs_from_fields({})[1] == sampling
    for name in ("resample_threshold", "resampling"):
        # unset (None) up to the config: smc's own default there, and no other method is
        # refused a value nobody gave (tests/test_settings_kept.py)
        assert getattr(gen, name) is getattr(serve, name) is None, name
        assert getattr(ServeDefaults, name) is None, name
        assert getattr(converted, name) == getattr(smc, name), name
    assert serve.temperature == ServeDefaults.temperature == SERVER_TEMPERATURE
    assert serve.max_tokens == ServeDefaults.max_tokens == sampling.max_new_tokens
    for command in ("roofline", "accuracy", "engine"):
        args = parser.parse_args(["bench", command])
        assert args.temperature == sampling.temperature
        assert args.resample_threshold == smc.resample_threshold
    assert parser.parse_args(["bench", "speed"]).temperatures == str(sampling.temperature)


# For every SamplingConfig field a user sets by its own name: a value other than the default
# (as generate and the server take it), as the CLI's flag takes it, and as the config holds it.
GIVEN = {
    "temperature": (0.3, "0.3", 0.3),
    "top_k": (5, "5", 5),
    "top_p": (0.5, "0.5", 0.5),
    "draft_temperature": (0.9, "0.9", 0.9),
    "min_p": (0.1, "0.1", 0.1),
    "repetition_penalty": (1.3, "1.3", 1.3),
    "presence_penalty": (0.5, "0.5", 0.5),
    "frequency_penalty": (-0.25, "-0.25", -0.25),
    "logit_bias": ({"3": 2.0}, "3=2", ((3, 2.0),)),
    "logprobs": (3, "3", 3),  # the chat endpoint spells it logprobs + top_logprobs
    "prompt_logprobs": (2, "2", 2),  # completions also take echo + logprobs
}


def test_every_sampling_field_reaches_every_front_end():
    """The front ends pass SamplingConfig's fields by name, so a new field needs only its CLI
    flag and its server field: a value given to generate's keywords, to the CLI and to the
    server arrives in the config. (max_new_tokens is the server's max_tokens, stop_at_eos the
    CLI's --ignore-eos, seed per choice: covered by their own tests.)"""
    from smcspec.config import SAMPLING_FIELDS, SamplingConfig
    from smcspec.engine import configs_from_fields
    from smcspec.server.request_fields import sampling as _sampling
    from smcspec.server.schema import CompletionRequest

    assert set(SAMPLING_FIELDS) == set(GIVEN) | {"max_new_tokens", "stop_at_eos", "seed"}
    for name, (value, text, held) in GIVEN.items():
        assert getattr(configs_from_fields({name: value})[1], name) == held
        flag = "--" + name.replace("_", "-")
        args = cli.build_parser().parse_args(["generate", "x", flag, text])
        assert getattr(configs_from_fields(cli_generate.settings(args))[1], name) == held, flag
        body = CompletionRequest(model="m", prompt="x", **{name: value})
        assert getattr(SamplingConfig(**_sampling(body, temperature=1.0)), name) == held, name
    with pytest.raises(TypeError, match="'top_q'"):
        configs_from_fields({"top_q": 0.5})


def test_the_summary_line_reads_each_methods_typed_stats(tiny_llm):
    """sd with nothing drafted (one new token) has no acceptance: the line says so instead of
    failing; smc's line names its particles, ESS and log Z-hat."""
    one = cli.summary(tiny_llm.generate("w1", "sd", max_new_tokens=1, seed=0))
    assert one.startswith("[sd] 1 tokens") and "acceptance" not in one
    sd = cli.summary(tiny_llm.generate("w1", "sd", max_new_tokens=6, seed=0, stop_at_eos=False))
    assert "acceptance" in sd and "accepted/round" in sd
    smc = cli.summary(tiny_llm.generate("w1", "smc", particles=3, max_new_tokens=4, seed=0))
    assert "N 3, mean ESS" in smc and "log Z-hat" in smc and "seed 0" in smc
    out = tiny_llm.generate("w1", "msd", particles=2, max_new_tokens=6, seed=0, stop_at_eos=False)
    depths = "/".join("-" if a is None else f"{a:.2f}" for a in out.stats.acceptance_by_depth)
    msd = cli.summary(out)
    assert f"accepted/round {out.stats.mean_accepted_length:.2f}" in msd
    assert f"acceptance by depth {depths}" in msd
    one = cli.summary(tiny_llm.generate("w1", "msd", particles=2, max_new_tokens=1, seed=0))
    assert one.startswith("[msd] 1 tokens") and "accepted/round" not in one
