"""Command line: `smcspec generate PROMPT ...`, `smcspec serve ...`, `smcspec bench ...`.

Each command lives in its own module of this package (`generate`, `serve`, `bench`); this one
assembles the parser and turns errors into exit codes."""

from __future__ import annotations

import argparse
import sys
from importlib import metadata

from smcspec.cli.bench import add_parser as add_bench_parser
from smcspec.cli.common import Help
from smcspec.cli.generate import add_parser as add_generate_parser
from smcspec.cli.generate import load_function, run_generate, summary
from smcspec.cli.serve import add_parser as add_serve_parser
from smcspec.cli.serve import run_serve

# summary and load_function are used from here by tests and users.
__all__ = ["build_parser", "load_function", "main", "summary"]


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
    add_generate_parser(sub)
    add_serve_parser(sub)
    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            return run_generate(args)
        if args.command == "serve":
            return run_serve(args)
        if args.command == "bench":
            from smcspec.cli.bench import run_bench

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
