"""Command line: `smcspec generate PROMPT ...`, `smcspec serve ...`, `smcspec bench ...`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from smcspec.bench.cli import add_parser as add_bench_parser
from smcspec.cli_common import (
    Help,
    add_model_options,
    add_resample_threshold,
    command,
    llm_from_args,
    llm_kwargs,
)
from smcspec.config import (
    MAX_PARTICLES,
    RESAMPLING_SCHEMES,
    SAMPLING_FIELDS,
    SD_DRAFT_TOKENS,
    SERVER_TEMPERATURE,
    SMC_DRAFT_TOKENS,
    SMC_PARTICLES,
    SamplingConfig,
    SMCConfig,
)
from smcspec.engine import configs_from_fields, method_fields, method_names, method_row

METHOD_HELP = "decoding method (default: sd, or smc when a potential is given)"
K_HELP = f"draft tokens K per round (default: {SD_DRAFT_TOKENS} for sd, {SMC_DRAFT_TOKENS} for smc)"


def _version() -> str:
    try:
        return metadata.version("smcspec")
    except metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
        from smcspec import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="smcspec",
        description="SMC speculative decoding for LLM inference.",
        formatter_class=Help,
    )
    parser.add_argument("--version", action="version", version=f"smcspec {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_serve(sub)
    add_bench_parser(sub)
    return parser


def _add_generate(sub: argparse._SubParsersAction) -> None:
    gen = command(sub, "generate", "generate text from a prompt")
    gen.add_argument(
        "prompt", help="the prompt (a user message unless --no-chat); - reads standard input"
    )
    gen.add_argument("--method", choices=method_names(), default=None, help=METHOD_HELP)
    _add_particles(gen, f"SMC particles N; more than {MAX_PARTICLES} need --allow-large")
    gen.add_argument(
        "--allow-large", action="store_true", help=f"allow more than {MAX_PARTICLES} particles"
    )
    gen.add_argument("-k", "--draft-tokens", type=int, default=None, help=K_HELP)
    _add_resampling(gen)
    _add_sampling(gen)
    _add_penalties(gen)
    _add_logprobs(gen)
    add_model_options(gen)
    _add_potentials(gen)
    gen.add_argument(
        "--system", default=None, metavar="TEXT", help="a system message before the prompt"
    )
    gen.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object")


def _add_sampling(gen: argparse.ArgumentParser) -> None:
    """One flag per SamplingConfig field, named after it (stop_at_eos: --ignore-eos); --stop."""
    gen.add_argument(
        "--temperature",
        type=float,
        default=SamplingConfig.temperature,
        help="target temperature (0 = greedy)",
    )
    gen.add_argument(
        "--draft-temperature",
        type=float,
        default=None,
        help="the draft's proposal temperature (default: --temperature)",
    )
    gen.add_argument(
        "--top-k",
        type=int,
        default=SamplingConfig.top_k,
        help="keep the K likeliest tokens; 0: all",
    )
    gen.add_argument(
        "--top-p", type=float, default=SamplingConfig.top_p, help="nucleus mass; 1: all"
    )
    gen.add_argument(
        "--max-new-tokens",
        type=int,
        default=SamplingConfig.max_new_tokens,
        help="new tokens at most",
    )
    gen.add_argument(
        "--min-p",
        type=float,
        default=SamplingConfig.min_p,
        help="drop tokens below this fraction of the likeliest one's probability; 0: none",
    )
    gen.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens")
    gen.add_argument(
        "--seed",
        type=int,
        default=None,
        help="reproduces a run exactly (default: a random one, shown in the summary)",
    )
    gen.add_argument(
        "--stop",
        action="append",
        default=None,
        metavar="STRING",
        help="end the text before this string (repeatable)",
    )


def _add_penalties(gen: argparse.ArgumentParser) -> None:
    """The sampling adjustments that read the sequence's own tokens, and logit_bias."""
    gen.add_argument(
        "--repetition-penalty",
        type=float,
        default=SamplingConfig.repetition_penalty,
        help="divide the positive logits of tokens already in the prompt or text; 1: none",
    )
    gen.add_argument(
        "--presence-penalty",
        type=float,
        default=SamplingConfig.presence_penalty,
        help="subtract from the logit of every token the text holds, in [-2, 2]",
    )
    gen.add_argument(
        "--frequency-penalty",
        type=float,
        default=SamplingConfig.frequency_penalty,
        help="subtract, per occurrence in the text, from a token's logit, in [-2, 2]",
    )
    gen.add_argument(
        "--logit-bias",
        type=_bias_pair,
        action="append",
        default=list(SamplingConfig.logit_bias),
        metavar="ID=BIAS",
        help="add BIAS (in [-100, 100]) to token ID's logit (repeatable)",
    )


def _add_logprobs(gen: argparse.ArgumentParser) -> None:
    gen.add_argument(
        "--logprobs",
        type=int,
        default=SamplingConfig.logprobs,
        metavar="TOP",
        help="with --json: each token's log-probability and the TOP likeliest (0: none)",
    )
    gen.add_argument(
        "--prompt-logprobs",
        type=int,
        default=SamplingConfig.prompt_logprobs,
        metavar="TOP",
        help="with --json: the same for the prompt's tokens (one more pass over the prompt)",
    )


def _bias_pair(text: str) -> tuple[int, float]:
    token, sep, bias = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ID=BIAS, e.g. 13=-100, got {text!r}") from None


def _add_potentials(gen: argparse.ArgumentParser) -> None:
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


def _add_resampling(p: argparse.ArgumentParser) -> None:
    add_resample_threshold(p)
    p.add_argument(
        "--resampling",
        choices=RESAMPLING_SCHEMES,
        default=SMCConfig.resampling,
        help="smc's scheme",
    )


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
    serve = command(sub, "serve", "an OpenAI-compatible HTTP server")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on")
    serve.add_argument(
        "--model-name",
        default=None,
        help="the model id clients send (default: the target's folder or file name)",
    )
    serve.add_argument(
        "--method",
        choices=method_names(),
        default=None,
        help="for requests that name none (default: sd, or smc when a request has a potential)",
    )
    _add_particles(serve, f"N for requests that give none, at most {MAX_PARTICLES}")
    serve.add_argument(
        "-k", "--draft-tokens", type=int, default=None, help="K for requests; " + K_HELP
    )
    _add_resampling(serve)
    serve.add_argument("--temperature", type=float, default=SERVER_TEMPERATURE, help="as OpenAI's")
    serve.add_argument(
        "--max-tokens",
        type=int,
        default=SamplingConfig.max_new_tokens,
        help="for requests that give none",
    )
    _add_serve_limits(serve)
    serve.add_argument(
        "--api-key",
        default=None,
        help="clients must send 'Authorization: Bearer KEY' on every route but /health "
        "(default: $SMCSPEC_API_KEY, else none; the variable keeps the key out of `ps`)",
    )
    _add_replicas(serve)
    add_model_options(serve)


def _add_replicas(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group(
        "replicas on Ray Serve (pip install 'smcspec[ray]'; without these flags: one process)"
    )
    group.add_argument("--replicas", type=int, default=None, help="engines behind Ray's router")
    group.add_argument(
        "--autoscale",
        default=None,
        metavar="MIN:MAX",
        help="let Ray add and remove replicas between MIN and MAX",
    )
    group.add_argument(
        "--target-ongoing",
        type=float,
        default=None,
        help="with --autoscale: requests per replica Ray aims at (default: --max-running / 2)",
    )
    group.add_argument(
        "--replica-cpus",
        type=float,
        default=None,
        help="CPUs each replica reserves, and the threads it computes on (default: 1)",
    )
    group.add_argument(
        "--replica-gpus",
        type=float,
        default=None,
        help="GPUs each replica reserves (default: 0; 1 places one engine per GPU)",
    )
    group.add_argument(
        "--ray-address",
        default=None,
        help="join a running Ray cluster: auto, HOST:PORT or ray://HOST:PORT "
        "(default: $RAY_ADDRESS, else a new one on this machine)",
    )


def _add_serve_limits(serve: argparse.ArgumentParser) -> None:
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
    serve.add_argument(
        "--write-timeout",
        type=float,
        default=60.0,
        help="seconds a client may leave a response unread before it is dropped",
    )


def _generate(args: argparse.Namespace) -> int:
    from smcspec.engine.text import check_stops

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt.strip():
        raise ValueError("prompt is empty")
    if args.system is not None and args.no_chat:
        raise ValueError("--system goes into the chat template, which --no-chat turns off")
    # Every setting is checked, and typed, before a minute of model loading.
    potentials = _potential_args(args)
    decoding, sampling = configs_from_fields(_settings(args), has_potential=bool(potentials))
    check_stops(args.stop)
    llm = llm_from_args(args)
    if args.system is not None:
        prompt = _with_system(llm, args.system, prompt)
    potential = llm.build_potential(
        **potentials, reward_beta=args.reward_beta, reward_every=args.reward_every
    )
    request = llm.plan(prompt, decoding, sampling, potential, stop=args.stop, chat=not args.no_chat)
    result = llm.run(request)
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print(result.text)
        print(summary(result), file=sys.stderr)
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
        write_timeout=args.write_timeout,
        api_key=_api_key(args),
    )
    replicas = _replica_options(args)
    if replicas is not None:
        return _serve_replicas(args, defaults, replicas)
    llm = llm_from_args(args)
    name = args.model_name or public_name(llm.names[0])
    defaults = dataclasses.replace(defaults, model_name=name)
    app = create_app(llm, defaults)
    keyed = ", API key required" if defaults.api_key is not None else ""
    print(
        f"smcspec: serving {defaults.model_name!r} ({llm.backend}, {llm.dtype}{keyed}) on "
        f"http://{args.host}:{args.port}/v1",
        file=sys.stderr,
    )
    HTTPServer(app, args.host, args.port).run()
    return 0


def _replica_options(args: argparse.Namespace):
    """The replica settings when any replica flag is given (checked here, before Ray starts or
    a model loads), else None: the single-process server."""
    from smcspec.server.cluster import ReplicaOptions, parse_autoscale

    flags = (
        "replicas",
        "autoscale",
        "target_ongoing",
        "replica_cpus",
        "replica_gpus",
        "ray_address",
    )
    if all(getattr(args, flag) is None for flag in flags):
        return None
    options = ReplicaOptions(
        replicas=args.replicas,
        autoscale=None if args.autoscale is None else parse_autoscale(args.autoscale),
        target_ongoing=args.target_ongoing,
        replica_cpus=1.0 if args.replica_cpus is None else args.replica_cpus,
        replica_gpus=0.0 if args.replica_gpus is None else args.replica_gpus,
        address=args.ray_address or os.environ.get("RAY_ADDRESS") or None,
    )
    if args.device.startswith("cuda") and options.replica_gpus == 0:
        raise ValueError(f"--device {args.device} needs --replica-gpus > 0 with replicas")
    return options


def _serve_replicas(args: argparse.Namespace, defaults, options) -> int:
    from smcspec.engine.loading import display_name, resolve_specs
    from smcspec.server.cluster import check_reachable, require_ray
    from smcspec.server.runtime import public_name

    require_ray()
    from smcspec.server.ray_app import ReplicaSpec, serve_replicas

    if options.address is not None:
        check_reachable(options.address)

    # Checked, and the default pair fetched, once here rather than by every replica at once.
    kwargs = llm_kwargs(args)
    kwargs["target"], kwargs["draft"] = resolve_specs(args.target, args.draft, args.cache_dir)
    name = args.model_name or public_name(display_name(kwargs["target"]))
    defaults = dataclasses.replace(defaults, model_name=name)
    spec = ReplicaSpec(kwargs, defaults, threads=options.torch_threads)
    serve_replicas(spec, options, args.host, args.port)
    return 0


def _api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else $SMCSPEC_API_KEY (as vLLM reads VLLM_API_KEY); an empty variable is
    unset, but an empty flag is refused rather than silently serving without a key."""
    if args.api_key is not None:
        return args.api_key
    return os.environ.get("SMCSPEC_API_KEY") or None


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """The flags `configs_from_fields` reads, each named as its field: every method's settings
    and every `SamplingConfig` field (--ignore-eos for stop_at_eos), so that a new field needs
    only its flag."""
    names = ("method", "allow_large", *method_fields(), *SAMPLING_FIELDS)
    given = {name: getattr(args, name) for name in names if name != "stop_at_eos"}
    return given | {"stop_at_eos": not args.ignore_eos}


def _potential_args(args: argparse.Namespace) -> dict:
    """The potentials asked for (`build_potential`'s keywords, read and checked: a constraint
    compiles) before any model loads; empty when none is."""
    from smcspec.potentials import Power, Reward, grammar_of

    out: dict = {}
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
    if args.method is not None and out and not method_row(args.method).potentials:
        raise ValueError(
            f"{args.method} cannot take potentials (it samples p exactly); use --method smc"
        )
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


def summary(result) -> str:
    """One line for stderr: speed, time split, the method's own figures, finish and seed."""
    from smcspec.engine import SDStats, SMCStats

    d, stats = result.diagnostics, result.stats
    split = d["time_split"]
    parts = [
        f"[{result.method}] {d['new_tokens']} tokens in {d['seconds']:.2f} s"
        f" = {d['tokens_per_second']:.2f} tok/s",
        f"rounds {d['rounds']}",
        "time prefill/draft/verify/resample/other "
        + "/".join(f"{split[k]:.2f}" for k in ("prefill", "draft", "verify", "resample", "other"))
        + " s",
    ]
    if isinstance(stats, SDStats) and stats.acceptance_rate is not None:  # None: no draft
        parts.append(
            f"acceptance {stats.acceptance_rate:.2f}, "
            f"accepted/round {stats.mean_accepted_length:.2f}"
        )
    if isinstance(stats, SMCStats):
        ess = stats.ess
        mean_ess = sum(ess) / len(ess) if ess else float("nan")
        parts.append(
            f"N {len(stats.weights)}, mean ESS {mean_ess:.2f}, resamples {stats.resamples}, "
            f"log Z-hat {stats.log_z_hat:.3f}"
        )
        if stats.valid_particles is not None:
            parts.append(f"valid particles {stats.valid_particles}")
            if stats.valid_particles == 0:
                parts.append(
                    "WARNING: no particle satisfied the potentials; raise --particles or "
                    "--max-new-tokens"
                )
    parts.append(f"finish {result.finish_reason}")
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
