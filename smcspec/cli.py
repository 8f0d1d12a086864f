"""Command line: `smcspec generate PROMPT ...`, `smcspec serve ...`, `smcspec bench ...`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from importlib import metadata
from pathlib import Path

from smcspec.config import (
    MAX_PARTICLES,
    METHODS,
    RESAMPLING_SCHEMES,
    SD_DRAFT_TOKENS,
    SMC_DRAFT_TOKENS,
    SMC_PARTICLES,
)
from smcspec.models.loader import BACKENDS, DTYPES

METHOD_HELP = "decoding method (default: sd, or smc when a potential is given)"
K_HELP = f"draft tokens K per round (default: {SD_DRAFT_TOKENS} for sd, {SMC_DRAFT_TOKENS} for smc)"


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default, unless the help already says it; flags are off
    unless given."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        skip = not action.option_strings or isinstance(action.default, bool)
        if skip or action.default == argparse.SUPPRESS or "default" in text:
            return text
        value = action.default
        if isinstance(value, list):
            value = " ".join(value)
        value = "none" if value in (None, "") else value
        return f"{text} (default: {str(value).replace('%', '%%')})".lstrip()


def _version() -> str:
    try:
        return metadata.version("smcspec")
    except metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
        from smcspec import __version__

        return __version__


def _command(sub, name: str, help: str) -> argparse.ArgumentParser:
    # argparse %-formats a help string, not a description
    escaped = help.replace("%", "%%")
    return sub.add_parser(name, help=escaped, description=help, formatter_class=_Help)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="smcspec",
        description="SMC speculative decoding for LLM inference.",
        formatter_class=_Help,
    )
    parser.add_argument("--version", action="version", version=f"smcspec {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = _command(sub, "generate", "generate text from a prompt")
    gen.add_argument(
        "prompt", help="the prompt (a user message unless --no-chat); - reads standard input"
    )
    gen.add_argument("--method", choices=METHODS, default=None, help=METHOD_HELP)
    _add_particles(gen, f"SMC particles N; more than {MAX_PARTICLES} need --allow-large")
    gen.add_argument(
        "--allow-large", action="store_true", help=f"allow more than {MAX_PARTICLES} particles"
    )
    gen.add_argument("-k", "--draft-tokens", type=int, default=None, help=K_HELP)
    gen.add_argument(
        "--resample-threshold", type=float, default=0.5, help="resample when ESS < this x N"
    )
    gen.add_argument(
        "--resampling", choices=RESAMPLING_SCHEMES, default="systematic", help="smc's scheme"
    )
    gen.add_argument(
        "--temperature", type=float, default=0.7, help="target temperature (0 = greedy)"
    )
    gen.add_argument(
        "--draft-temperature",
        type=float,
        default=None,
        help="the draft's proposal temperature (default: --temperature)",
    )
    gen.add_argument("--top-k", type=int, default=0, help="keep the K likeliest tokens; 0: all")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus mass; 1: all")
    gen.add_argument("--max-new-tokens", type=int, default=128, help="new tokens at most")
    gen.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens")
    gen.add_argument(
        "--stop",
        action="append",
        default=None,
        metavar="STRING",
        help="end the text before this string (repeatable)",
    )
    gen.add_argument(
        "--seed",
        type=int,
        default=None,
        help="reproduces a run exactly (default: a random one, shown in the summary)",
    )
    _add_model_options(gen)
    pot = gen.add_argument_group("potentials (smc samples p(x) phi(x); ar applies them locally)")
    pot.add_argument("--power-alpha", type=float, default=None, help="target p(x)^alpha")
    pot.add_argument("--regex", default=None, help="the output must fully match this regex")
    pot.add_argument("--json-schema", default=None, metavar="FILE", help="JSON schema file")
    pot.add_argument("--grammar", default=None, metavar="FILE", help="Lark grammar file")
    pot.add_argument("--reward", default=None, metavar="MODULE:FUNCTION", help="r(text) -> float")
    pot.add_argument("--reward-beta", type=float, default=1.0, help="weight exp(beta r)")
    pot.add_argument(
        "--reward-every", type=int, default=None, help="also score prefixes every M tokens"
    )
    gen.add_argument(
        "--system", default=None, metavar="TEXT", help="a system message before the prompt"
    )
    gen.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    _add_serve(sub)
    _add_bench(sub)
    return parser


def _add_particles(p: argparse.ArgumentParser, what: str) -> None:
    # No -n: it means choices in OpenAI's API and tokens in llama.cpp.
    p.add_argument(
        "--particles",
        type=int,
        default=None,
        metavar="N",
        help=f"{what} (default: {SMC_PARTICLES})",
    )


def _add_serve(sub) -> None:
    serve = _command(sub, "serve", "an OpenAI-compatible HTTP server")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on")
    serve.add_argument(
        "--model-name",
        default=None,
        help="the model id clients send (default: the target's folder or file name)",
    )
    serve.add_argument(
        "--method",
        choices=METHODS,
        default=None,
        help="for requests that name none (default: sd, or smc when a request has a potential)",
    )
    _add_particles(serve, f"N for requests that give none, at most {MAX_PARTICLES}")
    serve.add_argument(
        "-k", "--draft-tokens", type=int, default=None, help="K for requests; " + K_HELP
    )
    serve.add_argument(
        "--resample-threshold", type=float, default=0.5, help="resample when ESS < this x N"
    )
    serve.add_argument(
        "--resampling", choices=RESAMPLING_SCHEMES, default="systematic", help="smc's scheme"
    )
    serve.add_argument("--temperature", type=float, default=1.0, help="as OpenAI's")
    serve.add_argument("--max-tokens", type=int, default=128, help="for requests that give none")
    serve.add_argument(
        "--max-running", type=int, default=64, help="requests decoded at once; others queue"
    )
    serve.add_argument(
        "--max-batch-tokens",
        type=int,
        default=256,
        help="tokens per forward pass; longer prompts are prefilled in pieces",
    )
    serve.add_argument(
        "--max-body-bytes",
        type=int,
        default=4 * 2**20,
        help="larger request bodies get a 413 before parsing (default: 4 MiB)",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=5.0,
        help="seconds running requests get to finish after SIGTERM before they are cancelled",
    )
    serve.add_argument(
        "--read-timeout",
        type=float,
        default=10.0,
        help="seconds a client has to send a request's headers and body",
    )
    _add_model_options(serve)


def _add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None, help="hub id, folder or .gguf (default: built-in)")
    p.add_argument("--draft", default=None, help="hub id, folder or .gguf (default: built-in)")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPES,
        help="weights; auto = int8 on a CPU (float activations), bfloat16 on CUDA",
    )
    p.add_argument(
        "--device",
        default="auto",
        help="auto (cuda when there is one, else cpu), cpu, cuda or cuda:<index>",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="native engine on CUDA: run every step eagerly instead of replaying CUDA graphs",
    )
    p.add_argument(
        "--backend",
        default="auto",
        choices=BACKENDS,
        help="native: Llama/Qwen2/Mistral on a paged KV cache; hf: transformers (any model); "
        "auto: native where it applies",
    )
    p.add_argument(
        "--cache-dir",
        default=None,
        help="model cache (default: $SMCSPEC_CACHE or ~/.cache/smcspec)",
    )


def _add_grid_options(p: argparse.ArgumentParser, methods: list[str], smc_n: str) -> None:
    p.add_argument(
        "--methods",
        nargs="+",
        default=methods,
        help="of ar sd smc hf hf-assisted (hf peers need --backend hf)",
    )
    p.add_argument("--sd-k", default="2,4", help="K grid for sd")
    p.add_argument("--smc-n", default=smc_n, help="N grid for smc")
    p.add_argument("--smc-k", default="2,4", help="K grid for smc")
    p.add_argument(
        "--smc-power", default="", help="also run each smc setting with Power(alpha), e.g. 2,4"
    )
    p.add_argument(
        "--resample-threshold", type=float, default=0.5, help="resample when ESS < this x N"
    )
    p.add_argument("--out", default="bench-results", help="folder for .jsonl, .md and .png files")
    p.add_argument("--seed", type=int, default=0, help="seed of the first run")
    _add_model_options(p)


def _add_bench(sub) -> None:
    bench = _command(sub, "bench", "speed, roofline, accuracy and engine benchmarks")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    speed = _command(bsub, "speed", "tokens/s of every method, interleaved, side by side")
    _add_grid_options(speed, ["ar", "sd", "smc"], "2,4,8")
    speed.add_argument(
        "--temperatures", default="0.7", help="comma-separated, e.g. 0.3,0.7,1.0,1.3"
    )
    speed.add_argument("--prompts", type=int, default=5, help="first P HumanEval prompts")
    speed.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per run")
    speed.add_argument("--natural-stop", action="store_true", help="stop at EOS (default: ignore)")
    speed.add_argument("--reps", type=int, default=1, help="repetitions of every run")
    roof = _command(bsub, "roofline", "predicted vs measured SMC speed-up per (N, K)")
    _add_grid_options(roof, ["smc"], "1,2,4,8")
    roof.add_argument(
        "--speed-results",
        default=None,
        help="a speed.jsonl to take measured S from (default: measure 2 prompts here)",
    )
    roof.add_argument("--temperature", type=float, default=0.7, help="sampling temperature")
    roof.add_argument("--context", type=int, default=150, help="cache length for the timings")
    roof.add_argument("--timing-reps", type=int, default=3, help="timed repetitions per shape")
    acc = _command(bsub, "accuracy", "HumanEval pass@1 with 95% CI, and speed")
    _add_grid_options(acc, ["ar", "sd", "smc"], "4")
    acc.add_argument("--temperature", type=float, default=0.7, help="sampling temperature")
    acc.add_argument("--offset", type=int, default=0, help="first HumanEval problem")
    acc.add_argument("--limit", type=int, default=20, help="number of problems")
    acc.add_argument("--max-new-tokens", type=int, default=384, help="new tokens per problem")
    acc.add_argument("--timeout", type=float, default=10.0, help="seconds per program")
    eng = _command(bsub, "engine", "native vs transformers engine: steps, resampling, e2e")
    _add_grid_options(eng, ["ar", "sd", "smc"], "2,4")
    eng.add_argument("--backends", default="native,hf", help="comma-separated engines to compare")
    eng.add_argument("--context", type=int, default=150, help="cache length for the timings")
    eng.add_argument("--reps", type=int, default=5, help="timed repetitions per forward shape")
    eng.add_argument("--prompts", type=int, default=3, help="first P HumanEval prompts")
    eng.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per run")
    eng.add_argument("--temperature", type=float, default=0.7, help="sampling temperature")
    gpu = _command(bsub, "gpu", "native engine on one GPU: random weights of the real shapes")
    gpu.add_argument(
        "--device", default="auto", help="auto (cuda; refused without one), cuda[:i], cpu"
    )
    gpu.add_argument("--dtype", default="auto", help="auto (bfloat16 on CUDA), bfloat16 or float32")
    gpu.add_argument("--out", default="bench-results", help="folder for gpu.jsonl and gpu.md")
    gpu.add_argument(
        "--smoke", action="store_true", help="tiny float32 models on the CPU (seconds)"
    )
    gpu.add_argument("--new-tokens", type=int, default=None, help="new tokens per end-to-end run")
    gpu.add_argument("--reps", type=int, default=None, help="timed repetitions per forward shape")
    fid = _command(bsub, "fidelity", "KL of int8 (or bfloat16) against float32")
    fid.add_argument("--target", default=None, help="folder or .gguf (default: built-in)")
    fid.add_argument("--draft", default=None, help="folder or .gguf (default: built-in)")
    fid.add_argument("--dtype", default="int8", choices=["int8", "bfloat16"], help="compared")
    fid.add_argument("--new-tokens", type=int, default=48, help="greedy continuation length")
    fid.add_argument(
        "--cache-dir",
        default=None,
        help="model cache (default: $SMCSPEC_CACHE or ~/.cache/smcspec)",
    )
    fid.add_argument("--out", default="bench-results", help="folder for the results")
    js = _command(bsub, "json", "constrained JSON: validity and speed, ar vs smc")
    js.add_argument("--particles", type=int, default=4, metavar="N", help="smc's particles")
    js.add_argument("-k", "--draft-tokens", type=int, default=4, help="smc's draft tokens K")
    js.add_argument("--reps", type=int, default=2, help="seeds per prompt")
    js.add_argument("--max-new-tokens", type=int, default=96, help="new tokens per run")
    js.add_argument("--out", default="bench-results", help="folder for the results")
    js.add_argument("--methods", nargs="+", default=["ar", "smc"], help=argparse.SUPPRESS)
    _add_model_options(js)
    srv = _command(bsub, "serve", "the HTTP server under 1..C concurrent clients")
    srv.add_argument(
        "--methods", default="ar,sd K=4,smc N=2 K=8,smc N=4 K=4", help="comma-separated"
    )
    srv.add_argument("--concurrency", default="1,4,16", help="client counts, comma-separated")
    srv.add_argument("--requests", type=int, default=16, help="requests per level")
    srv.add_argument("--max-tokens", type=int, default=32, help="new tokens per request")
    srv.add_argument("--temperature", type=float, default=0.7, help="sampling temperature")
    srv.add_argument("--out", default="bench-results", help="folder for the results")
    _add_model_options(srv)
    rep = _command(bsub, "report", "tables and plots from result files")
    rep.add_argument("--out", default="bench-results", help="folder holding the results")
    rep.add_argument("--accuracy-files", nargs="*", default=[], help="more accuracy.jsonl files")


def _generate(args: argparse.Namespace) -> int:
    from smcspec.config import SamplingConfig, method_configs
    from smcspec.engine.text import check_stops

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt.strip():
        raise ValueError("prompt is empty")
    if args.system is not None and args.no_chat:
        raise ValueError("--system goes into the chat template, which --no-chat turns off")
    # Validate every setting before spending a minute loading models.
    SamplingConfig(
        args.temperature,
        args.top_k,
        args.top_p,
        args.max_new_tokens,
        True,
        args.seed,
        args.draft_temperature,
    )
    method_configs(
        args.particles,
        args.draft_tokens,
        args.resample_threshold,
        args.resampling,
        args.allow_large,
    )
    check_stops(args.stop)
    potentials = _potential_args(args)
    llm = llm_from_args(args)
    if args.system is not None:
        prompt = _with_system(llm, args.system, prompt)
    result = llm.generate(
        prompt,
        args.method,
        particles=args.particles,
        draft_tokens=args.draft_tokens,
        resample_threshold=args.resample_threshold,
        resampling=args.resampling,
        temperature=args.temperature,
        draft_temperature=args.draft_temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        max_new_tokens=args.max_new_tokens,
        stop_at_eos=not args.ignore_eos,
        stop=args.stop,
        seed=args.seed,
        chat=not args.no_chat,
        allow_large=args.allow_large,
        **potentials,
    )
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print(result.text)
        print(summary(result.method, result.diagnostics, result.finish_reason), file=sys.stderr)
    return 0


def _with_system(llm, system: str, prompt: str) -> list[int]:
    """The token ids of a system message and the prompt through the chat template."""
    if not getattr(llm.tokenizer, "chat_template", None):
        raise ValueError("--system needs a model with a chat template")
    messages = [{"role": "system", "content": system}, {"role": "user", "content": prompt}]
    return llm.encode_messages(messages)


def _serve(args: argparse.Namespace) -> int:
    from smcspec.server.app import HTTPServer, ServeDefaults, create_app
    from smcspec.server.runtime import public_name

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    defaults = ServeDefaults(  # checked before a minute of model loading
        model_name=args.model_name or "",
        method=args.method,
        particles=args.particles,
        draft_tokens=args.draft_tokens,
        resample_threshold=args.resample_threshold,
        resampling=args.resampling,
        temperature=args.temperature,
        max_tokens=args.max_tokens,
        max_running=args.max_running,
        max_batch_tokens=args.max_batch_tokens,
        max_body_bytes=args.max_body_bytes,
        shutdown_timeout=args.shutdown_timeout,
        read_timeout=args.read_timeout,
    )
    llm = llm_from_args(args)
    name = args.model_name or public_name(llm.names[0])
    defaults = dataclasses.replace(defaults, model_name=name)
    app = create_app(llm, defaults)
    print(
        f"smcspec: serving {defaults.model_name!r} ({llm.backend}, {llm.dtype}) on "
        f"http://{args.host}:{args.port}/v1",
        file=sys.stderr,
    )
    HTTPServer(app, args.host, args.port).run()
    return 0


def llm_from_args(args: argparse.Namespace, backend: str | None = None):
    """The LLM the model options (`_add_model_options`) name; `backend` overrides --backend."""
    from smcspec.engine import LLM

    return LLM(
        args.target,
        args.draft,
        dtype=args.dtype,
        device=args.device,
        cache_dir=args.cache_dir,
        backend=args.backend if backend is None else backend,
        enforce_eager=args.enforce_eager,
    )


def _potential_args(args: argparse.Namespace) -> dict:
    """Read and check the potential options (a constraint compiles) before any model loads."""
    from smcspec.potentials import Power, Reward, grammar_of

    out: dict = {"reward_beta": args.reward_beta, "reward_every": args.reward_every}
    if args.power_alpha is not None:
        Power(args.power_alpha)
        out["power_alpha"] = args.power_alpha
    if args.regex is not None:
        out["regex"] = args.regex
    for key in ("json_schema", "grammar"):
        path = getattr(args, key)
        if path is not None:
            try:
                out[key] = Path(path).read_text()
            except OSError as err:
                raise ValueError(f"--{key.replace('_', '-')}: cannot read {path}: {err}") from err
    for key in ("regex", "json_schema", "grammar"):
        if key in out:
            grammar_of(key, out[key])
    if args.reward is not None:
        out["reward"] = load_function(args.reward)
        Reward(out["reward"], args.reward_beta, args.reward_every)  # checks beta and every
    if args.method == "sd" and len(out) > 2:
        raise ValueError("sd cannot take potentials (it samples p exactly); use --method smc")
    return out


def load_function(spec: str):
    """`module:function` -> the function, or a ValueError that says what is missing."""
    import importlib

    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise ValueError(f"--reward must look like module:function, got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"--reward: cannot import {module_name}: {err}") from err
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"--reward: {module_name} has no function {name}")
    return fn


def summary(method: str, d: dict, finish_reason: str | None = None) -> str:
    split = d["time_split"]
    parts = [
        f"[{method}] {d['new_tokens']} tokens in {d['seconds']:.2f} s"
        f" = {d['tokens_per_second']:.2f} tok/s",
        f"rounds {d['rounds']}",
        "time prefill/draft/verify/resample/other "
        + "/".join(f"{split[k]:.2f}" for k in ("prefill", "draft", "verify", "resample", "other"))
        + " s",
    ]
    if method == "sd":
        parts.append(
            f"acceptance {d['acceptance_rate']:.2f}, accepted/round {d['mean_accepted_length']:.2f}"
        )
    if method == "smc":
        ess = d["ess"]
        mean_ess = sum(ess) / len(ess) if ess else float("nan")
        parts.append(
            f"N {len(d['weights'])}, mean ESS {mean_ess:.2f}, resamples {d['resamples']}, "
            f"log Z-hat {d['log_z_hat']:.3f}"
        )
        if "valid_particles" in d:
            parts.append(f"valid particles {d['valid_particles']}")
            if d["valid_particles"] == 0:
                parts.append(
                    "WARNING: no particle satisfied the potentials; raise --particles or "
                    "--max-new-tokens"
                )
    if finish_reason is not None:
        parts.append(f"finish {finish_reason}")
    parts.append(f"seed {d['seed']}")
    return " | ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "serve":
            return _serve(args)
        if args.command == "bench":
            from smcspec.bench.cli import run_bench

            return run_bench(args)
    except ValueError as err:
        print(f"smcspec: error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:
        print(f"smcspec: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
