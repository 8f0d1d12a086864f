"""Command line: `smcspec generate PROMPT ...`."""

from __future__ import annotations

import argparse
import json
import sys

from smcspec.config import METHODS, RESAMPLING_SCHEMES


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
    gen.add_argument("--target", default=None, help="hub id, folder or .gguf (default: built-in)")
    gen.add_argument("--draft", default=None, help="hub id, folder or .gguf (default: built-in)")
    gen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    gen.add_argument("--device", default="cpu")
    gen.add_argument(
        "--cache-dir", default=None, help="model cache (default $SMCSPEC_CACHE or ~/.cache/smcspec)"
    )
    gen.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def _generate(args: argparse.Namespace) -> int:
    from smcspec.config import SamplingConfig, SDConfig, SMCConfig
    from smcspec.engine import LLM

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
    llm = LLM(
        args.target, args.draft, dtype=args.dtype, device=args.device, cache_dir=args.cache_dir
    )
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
    )
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print(result.text)
        print(summary(result.method, result.diagnostics), file=sys.stderr)
    return 0


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
    parts.append(f"seed {d['seed']}")
    return " | ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            return _generate(args)
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
