"""Command line: `smcspec generate PROMPT ...`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from smcspec.config import METHODS, RESAMPLING_SCHEMES
from smcspec.models.loader import BACKENDS, DTYPES


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="smcspec", description="SMC speculative decoding for LLM inference."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text from a prompt")
    gen.add_argument("prompt", help="the prompt (a user message unless --no-chat)")
    gen.add_argument(
        "--method", choices=METHODS, default="smc", help="decoding method (default smc)"
    )
    gen.add_argument("-n", "--particles", type=int, default=8, help="SMC particles N (default 8)")
    gen.add_argument(
        "-k", "--draft-tokens", type=int, default=4, help="draft tokens K per round (4)"
    )
    gen.add_argument(
        "--resample-threshold", type=float, default=0.5, help="resample when ESS < this x N"
    )
    gen.add_argument("--resampling", choices=RESAMPLING_SCHEMES, default="systematic")
    gen.add_argument(
        "--temperature", type=float, default=0.7, help="target temperature (0 = greedy)"
    )
    gen.add_argument("--draft-temperature", type=float, default=None, help="default: --temperature")
    gen.add_argument("--top-k", type=int, default=0, help="0 disables")
    gen.add_argument("--top-p", type=float, default=1.0, help="1 disables")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens")
    gen.add_argument("--seed", type=int, default=None, help="reproduces a run exactly")
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
    gen.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    _add_serve(sub)
    _add_bench(sub)
    return parser


def _add_serve(sub) -> None:
    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--model-name", default=None, help="the model id clients send (default: the target's)"
    )
    serve.add_argument("--method", choices=METHODS, default="smc", help="default for requests")
    serve.add_argument("-n", "--particles", type=int, default=8, help="default N (8)")
    serve.add_argument("-k", "--draft-tokens", type=int, default=4, help="default K (4)")
    serve.add_argument("--resample-threshold", type=float, default=0.5)
    serve.add_argument("--resampling", choices=RESAMPLING_SCHEMES, default="systematic")
    serve.add_argument("--temperature", type=float, default=1.0, help="default (OpenAI's: 1)")
    serve.add_argument(
        "--max-tokens", type=int, default=128, help="default when a request gives none"
    )
    serve.add_argument(
        "--max-running", type=int, default=64, help="requests decoded at once; others queue"
    )
    serve.add_argument(
        "--max-batch-tokens",
        type=int,
        default=256,
        help="tokens per forward pass; longer prompts are prefilled in pieces (256: CPU)",
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
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--backend",
        default="auto",
        choices=BACKENDS,
        help="native: Llama/Qwen2/Mistral on a paged KV cache; hf: transformers (any model); "
        "auto: native where it applies",
    )
    p.add_argument(
        "--cache-dir", default=None, help="model cache (default $SMCSPEC_CACHE or ~/.cache/smcspec)"
    )


def _add_grid_options(p: argparse.ArgumentParser, methods: list[str], smc_n: str) -> None:
    p.add_argument("--methods", nargs="+", default=methods, help="ar sd smc hf hf-assisted")
    p.add_argument("--sd-k", default="2,4", help="K grid for sd")
    p.add_argument("--smc-n", default=smc_n, help="N grid for smc")
    p.add_argument("--smc-k", default="2,4", help="K grid for smc")
    p.add_argument(
        "--smc-power", default="", help="also run each smc setting with Power(alpha), e.g. 2,4"
    )
    p.add_argument("--resample-threshold", type=float, default=0.5)
    p.add_argument("--out", default="bench-results", help="folder for .jsonl, .md and .png files")
    p.add_argument("--seed", type=int, default=0)
    _add_model_options(p)


def _add_bench(sub) -> None:
    bench = sub.add_parser("bench", help="speed, roofline and accuracy benchmarks")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    speed = bsub.add_parser("speed", help="tokens/s of every method, interleaved, side by side")
    _add_grid_options(speed, ["ar", "sd", "smc", "hf", "hf-assisted"], "2,4,8")
    speed.add_argument(
        "--temperatures", default="0.7", help="comma-separated, e.g. 0.3,0.7,1.0,1.3"
    )
    speed.add_argument("--prompts", type=int, default=5, help="first P HumanEval prompts")
    speed.add_argument("--max-new-tokens", type=int, default=64)
    speed.add_argument("--natural-stop", action="store_true", help="stop at EOS (default: ignore)")
    speed.add_argument("--reps", type=int, default=1)
    roof = bsub.add_parser("roofline", help="predicted vs measured SMC speed-up per (N, K)")
    _add_grid_options(roof, ["smc"], "1,2,4,8")
    roof.add_argument("--speed-results", default=None, help="a speed.jsonl to take measured S from")
    roof.add_argument("--temperature", type=float, default=0.7)
    roof.add_argument("--context", type=int, default=150, help="cache length for the timings")
    roof.add_argument("--timing-reps", type=int, default=3)
    acc = bsub.add_parser("accuracy", help="HumanEval pass@1 with 95% CI, and speed")
    _add_grid_options(acc, ["ar", "sd", "smc"], "4")
    acc.add_argument("--temperature", type=float, default=0.7)
    acc.add_argument("--offset", type=int, default=0)
    acc.add_argument("--limit", type=int, default=20)
    acc.add_argument("--max-new-tokens", type=int, default=384)
    acc.add_argument("--timeout", type=float, default=10.0, help="seconds per program")
    eng = bsub.add_parser("engine", help="native vs transformers engine: steps, resampling, e2e")
    _add_grid_options(eng, ["ar", "sd", "smc"], "2,4")
    eng.add_argument("--backends", default="native,hf", help="comma-separated engines to compare")
    eng.add_argument("--context", type=int, default=150, help="cache length for the timings")
    eng.add_argument("--reps", type=int, default=5, help="timed repetitions per forward shape")
    eng.add_argument("--prompts", type=int, default=3, help="first P HumanEval prompts")
    eng.add_argument("--max-new-tokens", type=int, default=64)
    eng.add_argument("--temperature", type=float, default=0.7)
    fid = bsub.add_parser("fidelity", help="KL of int8 (or bfloat16) against float32")
    fid.add_argument("--target", default=None, help="folder or .gguf (default: built-in)")
    fid.add_argument("--draft", default=None, help="folder or .gguf (default: built-in)")
    fid.add_argument("--dtype", default="int8", choices=["int8", "bfloat16"])
    fid.add_argument("--new-tokens", type=int, default=48, help="greedy continuation length")
    fid.add_argument("--cache-dir", default=None)
    fid.add_argument("--out", default="bench-results")
    js = bsub.add_parser("json", help="constrained JSON: validity and speed, ar vs smc")
    js.add_argument("-n", "--particles", type=int, default=4)
    js.add_argument("-k", "--draft-tokens", type=int, default=4)
    js.add_argument("--reps", type=int, default=2, help="seeds per prompt")
    js.add_argument("--max-new-tokens", type=int, default=96)
    js.add_argument("--out", default="bench-results")
    js.add_argument("--methods", nargs="+", default=["ar", "smc"], help=argparse.SUPPRESS)
    _add_model_options(js)
    srv = bsub.add_parser("serve", help="the HTTP server under 1..C concurrent clients")
    srv.add_argument(
        "--methods", default="ar,sd K=4,smc N=2 K=8,smc N=4 K=4", help="comma-separated"
    )
    srv.add_argument("--concurrency", default="1,4,16", help="client counts, comma-separated")
    srv.add_argument("--requests", type=int, default=16, help="requests per level")
    srv.add_argument("--max-tokens", type=int, default=32, help="new tokens per request")
    srv.add_argument("--temperature", type=float, default=0.7)
    srv.add_argument("--out", default="bench-results")
    _add_model_options(srv)
    rep = bsub.add_parser("report", help="tables and plots from result files")
    rep.add_argument("--out", default="bench-results")
    rep.add_argument("--accuracy-files", nargs="*", default=[], help="more accuracy.jsonl files")


def _generate(args: argparse.Namespace) -> int:
    from smcspec.config import SamplingConfig, SDConfig, SMCConfig

    if not args.prompt.strip():
        raise ValueError("prompt is empty")
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
    SDConfig(args.draft_tokens)
    SMCConfig(args.particles, args.draft_tokens, args.resample_threshold, args.resampling)
    potentials = _potential_args(args)
    llm = llm_from_args(args)
    result = llm.generate(
        args.prompt,
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
        seed=args.seed,
        chat=not args.no_chat,
        **potentials,
    )
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print(result.text)
        print(summary(result.method, result.diagnostics), file=sys.stderr)
    return 0


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from smcspec.server.app import ServeDefaults, create_app

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
    )
    llm = llm_from_args(args)
    defaults = dataclasses.replace(defaults, model_name=args.model_name or llm.names[0])
    app = create_app(llm, defaults)
    print(
        f"smcspec: serving {defaults.model_name!r} ({llm.backend}, {llm.dtype}) on "
        f"http://{args.host}:{args.port}/v1",
        file=sys.stderr,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
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
    )


def _potential_args(args: argparse.Namespace) -> dict:
    """Read and check the potential options before any model loads."""
    from smcspec.potentials import Power, Reward

    out: dict = {"reward_beta": args.reward_beta, "reward_every": args.reward_every}
    if args.power_alpha is not None:
        Power(args.power_alpha)
        out["power_alpha"] = args.power_alpha
    if args.regex is not None:
        out["regex"] = args.regex
    for flag, key in (("json_schema", "json_schema"), ("grammar", "grammar")):
        path = getattr(args, flag)
        if path is not None:
            try:
                out[key] = Path(path).read_text()
            except OSError as err:
                raise ValueError(f"--{flag.replace('_', '-')}: cannot read {path}: {err}") from err
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


def summary(method: str, d: dict) -> str:
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
                    "WARNING: no particle satisfied the potentials; raise -n or --max-new-tokens"
                )
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
