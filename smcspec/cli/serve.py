"""`smcspec serve`: its flags, the API key, and one server process or replicas on Ray Serve."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from smcspec.cli.common import (
    K_HELP,
    add_engine_limits,
    add_method_settings,
    add_model_options,
    command,
    engine_limits,
    http_limits,
    llm_from_args,
    llm_kwargs,
)
from smcspec.config import (
    MAX_PARTICLES,
    SERVER_TEMPERATURE,
    EngineLimits,
    HTTPLimits,
    SamplingConfig,
)
from smcspec.engine import method_names


def add_parser(sub: argparse._SubParsersAction) -> None:
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
        help="for requests that name none (default: auto, the fastest setting for each request)",
    )
    n_help = f"N for requests that give none, at most {MAX_PARTICLES}"
    add_method_settings(serve, n_help, "K for requests; " + K_HELP, allow_large=False)
    serve.add_argument(
        "--approximate",
        action="store_true",
        default=None,
        help="auto may choose smc (approximate) for requests that do not say",
    )
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
    """The engine's limits and the flags of one `HTTPLimits` (`http_limits`), defaults read
    from it."""
    add_engine_limits(serve)
    http = HTTPLimits()
    group = serve.add_argument_group("HTTP limits")
    group.add_argument(
        "--max-body-bytes",
        type=int,
        default=http.max_body_bytes,
        help="larger request bodies get a 413 before parsing",
    )
    group.add_argument(
        "--shutdown-timeout",
        type=float,
        default=http.shutdown_timeout,
        help="seconds running requests get to finish after SIGTERM before they are cancelled",
    )
    group.add_argument(
        "--read-timeout",
        type=float,
        default=http.read_timeout,
        help="seconds a client has to send a request's headers and body",
    )
    group.add_argument(
        "--write-timeout",
        type=float,
        default=http.write_timeout,
        help="seconds a client may leave a response unread before it is dropped",
    )


def run_serve(args: argparse.Namespace) -> int:
    from smcspec.engine.loading import public_name
    from smcspec.server.app import HTTPServer, ServeDefaults, create_app

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    limits = engine_limits(args)
    defaults = ServeDefaults(  # checked before a minute of model loading
        model_name=args.model_name or "",
        method=args.method,
        particles=args.particles,
        draft_tokens=args.draft_tokens,
        verify=args.verify,
        proposal=args.proposal,
        lookup_ngram=args.lookup_ngram,
        resample_threshold=args.resample_threshold,
        resampling=args.resampling,
        approximate=args.approximate,
        temperature=args.temperature,
        max_tokens=args.max_tokens,
        http=http_limits(args),
        api_key=_api_key(args),
    )
    replicas = _replica_options(args)
    if replicas is not None:
        return _serve_replicas(args, defaults, replicas, limits)
    llm = llm_from_args(args, limits=limits)
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


def _serve_replicas(args: argparse.Namespace, defaults, options, limits: EngineLimits) -> int:
    from smcspec.engine.loading import display_name, public_name, resolve_specs
    from smcspec.server.cluster import check_reachable, require_ray

    require_ray()
    from smcspec.server.ray_app import ReplicaSpec, serve_replicas

    if options.address is not None:
        check_reachable(options.address)

    # Checked, and the default pair fetched, once here rather than by every replica at once.
    kwargs = llm_kwargs(args, limits=limits)
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
