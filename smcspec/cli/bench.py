"""`smcspec bench ...`: validate everything, then load models, then run."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from smcspec.bench.contenders import LLAMA_CPP, build_grid, parse_ints
from smcspec.bench.tasks import prompt_texts
from smcspec.cli.bench_accuracy import add_accuracy, run_accuracy_args
from smcspec.cli.bench_grid import T_DEFAULT, floats, grid_from_args, precision
from smcspec.cli.bench_grid import add_grid_options as _add_grid_options
from smcspec.cli.bench_law import add_law, run_law_args
from smcspec.cli.common import (
    add_model_options,
    command,
    llm_from_args,
)


def add_parser(sub) -> None:
    """`smcspec bench` and its subcommands, under the root parser's subparsers `sub`."""
    bench = command(sub, "bench", "speed, roofline, accuracy and engine benchmarks")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    for add in (
        _add_speed,
        _add_roofline,
        add_accuracy,
        add_law,
        _add_engine,
        _add_gpu,
        _add_fidelity,
        _add_json,
        _add_serve,
        _add_report,
    ):
        add(bsub)


def _add_speed(bsub) -> None:
    speed = command(bsub, "speed", "tokens/s of every method, interleaved, side by side")
    _add_grid_options(speed, ["ar", "sd", "smc", "msd", "auto"], "2,4,8")
    speed.add_argument(
        "--temperatures", default=str(T_DEFAULT), help="comma-separated, e.g. 0.3,0.7,1.0,1.3"
    )
    speed.add_argument("--prompts", type=int, default=5, help="the prompt set's first P")
    speed.add_argument(
        "--prompt-set",
        choices=["humaneval", "gsm8k", "mt-bench", "copy-edit"],
        default="humaneval",
        help="what to time on: HumanEval's functions, GSM8K's word problems (0-999), "
        "MT-Bench's first turns (conversational) or copy-edit's 20 requests whose answers copy "
        "the request (renames, fixes, JSON edits: prompt lookup's case)",
    )
    speed.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per run")
    speed.add_argument("--natural-stop", action="store_true", help="stop at EOS (default: ignore)")
    speed.add_argument("--reps", type=int, default=1, help="repetitions of every run")
    speed.add_argument(
        "--quants",
        default="Q4_K_M,Q8_0",
        help="llama.cpp GGUF types: the target file's own type runs both files as given, "
        "others are made with llama-quantize (default Q4_K_M,Q8_0)",
    )
    speed.add_argument(
        "--draft-temperatures",
        default="",
        help="also run sd, smc, msd and auto with the draft sampled at these temperatures, e.g. "
        "0.5,2 (a less matched draft; default: the target's temperature)",
    )


def _add_roofline(bsub) -> None:
    roof = command(bsub, "roofline", "predicted vs measured sd and smc speed-ups per (N, K)")
    _add_grid_options(roof, ["sd", "smc"], "1,2,4,8")
    roof.add_argument(
        "--speed-results",
        default=None,
        help="a speed.jsonl to take measured S from (default: measure 2 prompts here)",
    )
    roof.add_argument("--temperature", type=float, default=T_DEFAULT, help="sampling temperature")
    roof.add_argument("--context", type=int, default=150, help="cache length for the timings")
    roof.add_argument("--timing-reps", type=int, default=3, help="timed repetitions per shape")


def _add_engine(bsub) -> None:
    eng = command(bsub, "engine", "native vs transformers engine: steps, resampling, e2e")
    _add_grid_options(eng, ["ar", "sd", "smc"], "2,4")
    eng.add_argument("--backends", default="native,hf", help="comma-separated engines to compare")
    eng.add_argument("--context", type=int, default=150, help="cache length for the timings")
    eng.add_argument("--reps", type=int, default=5, help="timed repetitions per forward shape")
    eng.add_argument("--prompts", type=int, default=3, help="first P HumanEval prompts")
    eng.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per run")
    eng.add_argument("--temperature", type=float, default=T_DEFAULT, help="sampling temperature")


def _add_gpu(bsub) -> None:
    gpu = command(bsub, "gpu", "native engine on one GPU: random weights of the real shapes")
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
    gpu.add_argument("--pairs", default=None, help="comma-separated model pairs (default: all)")
    gpu.add_argument(
        "--time-budget", type=float, default=None, help="seconds; what does not fit is not run"
    )


def _add_fidelity(bsub) -> None:
    fid = command(bsub, "fidelity", "KL of int8 (or bfloat16) against float32")
    fid.add_argument("--target", default=None, help="folder or .gguf (default: built-in)")
    fid.add_argument("--draft", default=None, help="folder or .gguf (default: built-in)")
    fid.add_argument(
        "--dtype", default="int8", choices=["int8", "int4", "bfloat16"], help="compared"
    )
    fid.add_argument("--new-tokens", type=int, default=48, help="greedy continuation length")
    fid.add_argument(
        "--cache-dir",
        default=None,
        help="model cache (default: $SMCSPEC_CACHE or ~/.cache/smcspec)",
    )
    fid.add_argument("--out", default="bench-results", help="folder for the results")


def _add_json(bsub) -> None:
    js = command(bsub, "json", "constrained JSON: validity and speed, ar vs smc")
    js.add_argument("--particles", type=int, default=4, metavar="N", help="smc's particles")
    js.add_argument("-k", "--draft-tokens", type=int, default=4, help="smc's draft tokens K")
    js.add_argument("--reps", type=int, default=2, help="seeds per prompt")
    js.add_argument("--max-new-tokens", type=int, default=96, help="new tokens per run")
    js.add_argument("--out", default="bench-results", help="folder for the results")
    js.add_argument("--methods", nargs="+", default=["ar", "smc"], help=argparse.SUPPRESS)
    add_model_options(js)


def _add_serve(bsub) -> None:
    srv = command(bsub, "serve", "the HTTP server under 1..C concurrent clients")
    srv.add_argument(
        "--methods",
        default="ar,sd K=4,smc N=2 K=8,smc N=4 K=4,msd N=2 K=4,auto",
        help="comma-separated, as bench speed labels them: ar, sd K=k, smc N=n K=k, "
        "msd N=n K=k, auto, auto approx",
    )
    srv.add_argument("--concurrency", default="1,4,16", help="client counts, comma-separated")
    srv.add_argument("--requests", type=int, default=16, help="requests per level")
    srv.add_argument("--max-tokens", type=int, default=32, help="new tokens per request")
    srv.add_argument("--temperature", type=float, default=T_DEFAULT, help="sampling temperature")
    srv.add_argument(
        "--replicas",
        default="0",
        help="servers to measure, comma-separated: 0 is one process, n >= 1 is n replicas on "
        "Ray Serve sharing the machine's cores (e.g. 0,1,2)",
    )
    srv.add_argument("--out", default="bench-results", help="folder for the results")
    add_model_options(srv)


def _add_report(bsub) -> None:
    rep = command(bsub, "report", "tables and plots from result files")
    rep.add_argument("--out", default="bench-results", help="folder holding the results")
    rep.add_argument("--accuracy-files", nargs="*", default=[], help="more accuracy.jsonl files")


def _llm(args: argparse.Namespace, backend: str | None = None):
    return llm_from_args(args, backend)


def run_bench(args: argparse.Namespace) -> int:
    run = {
        "speed": _speed,
        "roofline": _roofline,
        "accuracy": run_accuracy_args,
        "law": run_law_args,
        "engine": _engine,
        "gpu": _gpu,
        "fidelity": _fidelity,
        "json": _json,
        "serve": _serve,
        "report": _report,
    }[args.bench_command]
    return run(args)


def _json(args: argparse.Namespace) -> int:
    from smcspec.bench.constrained import run_json
    from smcspec.engine import configs_from_fields

    configs_from_fields({"particles": args.particles, "draft_tokens": args.draft_tokens})
    if args.reps < 1 or args.max_new_tokens < 1:
        raise ValueError("--reps and --max-new-tokens must be >= 1")
    llm = _llm(args)
    k, new = args.draft_tokens, args.max_new_tokens
    print(run_json(llm, args.out, args.particles, k, args.reps, new))
    return 0


def _speed(args: argparse.Namespace) -> int:
    from smcspec.bench.speed import SpeedPlan, run_speed

    plan = SpeedPlan(
        grid_from_args(args),
        floats(args.temperatures, "--temperatures"),
        args.prompts,
        args.max_new_tokens,
        args.natural_stop,
        args.reps,
        args.seed,
        args.prompt_set,
    )
    prompt_texts(plan.prompt_set, plan.prompts)  # fetched and checked before models load
    with _llama_cpp(args, plan) as peer:  # built, files made, before our models load
        llm = _llm(args)
        run_speed(llm, plan, args.out, precision(llm), peer)
    print((Path(args.out) / "speed.md").read_text())
    return 0


def _llama_cpp(args: argparse.Namespace, plan):
    """The llama.cpp side of `bench speed`, or a null context when no contender needs it."""
    import contextlib

    quants = {c.settings["quant"] for c in plan.contenders if c.method in LLAMA_CPP}
    if not quants:
        return contextlib.nullcontext()
    import torch

    from smcspec.bench import llamacpp
    from smcspec.engine import gguf_files

    if plan.natural_stop:
        raise ValueError("llama-cpp contenders run at a fixed length: drop --natural-stop")
    bin_dir = llamacpp.binaries(args.cache_dir)
    target, draft = gguf_files(args.target, args.draft, args.cache_dir)
    pairs = {q: llamacpp.pair_for(q, target, draft, bin_dir) for q in sorted(quants)}
    return llamacpp.LlamaCpp(pairs, bin_dir, torch.get_num_threads())


def _gpu(args: argparse.Namespace) -> int:
    import dataclasses

    from smcspec.bench.gpu.runner import GpuPlan, run_all

    plan = GpuPlan.smoke() if args.smoke else _gpu_plan(args.device, args.dtype)
    for name in ("new_tokens", "reps"):
        if getattr(args, name) is not None:
            plan = dataclasses.replace(plan, **{name: getattr(args, name)})
    if args.pairs is not None:
        pairs = tuple(p.strip() for p in args.pairs.split(",") if p.strip())
        plan = dataclasses.replace(plan, pairs=pairs)  # an unknown pair: ValueError, exit 2
    if args.time_budget is not None and args.time_budget < 0:
        raise ValueError(f"--time-budget must be >= 0, got {args.time_budget}")
    outcome = run_all(plan, args.out, budget_s=args.time_budget)
    print(outcome.report)
    for line in outcome.failures:
        print(f"smcspec: check failed: {line}", file=sys.stderr)
    for line in outcome.crashed:
        print(f"smcspec: stage raised: {line} (traceback in gpu.md)", file=sys.stderr)
    for line in outcome.skipped:
        print(f"smcspec: not run: {line}", file=sys.stderr)
    # scripts/gpu_check's codes: 1 a check failed, 3 a stage raised, 4 a check did not run
    return outcome.exit_code


def _gpu_plan(device: str, dtype: str):
    """The full plan on `device`; without CUDA it needs --device cpu (7B shapes on a CPU take
    hours), and there attention is the paged reference so that graphs run `eager_capture`."""
    import torch

    from smcspec.bench.gpu.runner import GpuPlan

    if device == "auto":
        if not torch.cuda.is_available():
            raise ValueError("no CUDA device here: use --smoke (tiny models) or --device cpu")
        device = "cuda"
    if device != "cpu" and not (device == "cuda" or device.startswith("cuda:")):
        raise ValueError(f"--device must be auto, cpu, cuda or cuda:<index>, got {device!r}")
    cuda = device != "cpu"
    if cuda and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available here")
    if dtype == "auto":
        dtype = "bfloat16" if cuda else "float32"
    return GpuPlan(device=device, dtype=dtype, attention="auto" if cuda else "reference")


def _serve(args: argparse.Namespace) -> int:
    from smcspec.bench.serving import ServePlan, run_serve_bench
    from smcspec.server.cluster import require_ray

    plan = ServePlan(
        methods=tuple(m.strip() for m in args.methods.split(",") if m.strip()),
        concurrency=tuple(parse_ints(args.concurrency, "--concurrency")),
        requests=args.requests,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        replicas=tuple(parse_ints(args.replicas, "--replicas")),
    )
    if any(plan.replicas):
        require_ray()
    serve_args = ["--dtype", args.dtype, "--device", args.device, "--backend", args.backend]
    for flag, value in (("--target", args.target), ("--draft", args.draft)):
        if value is not None:
            serve_args += [flag, value]
    if args.cache_dir is not None:
        serve_args += ["--cache-dir", args.cache_dir]
    print(run_serve_bench(plan, serve_args, args.out))
    return 0


def _fidelity(args: argparse.Namespace) -> int:
    from smcspec.bench.fidelity import run_fidelity
    from smcspec.engine import loading

    if args.new_tokens < 1:
        raise ValueError(f"--new-tokens must be >= 1, got {args.new_tokens}")
    target, draft = loading.resolve_specs(args.target, args.draft, args.cache_dir)
    specs = {"target": target, "draft": draft}
    for role, spec in specs.items():
        reason = loading.native_refusal(spec)
        if reason is not None:
            raise ValueError(f"{role}: fidelity runs on the native engine: {reason}")
    tokenizer = loading.load_tokenizer(specs["target"])
    print(run_fidelity(specs, tokenizer, args.dtype, args.new_tokens, args.out))
    return 0


def _engine(args: argparse.Namespace) -> int:
    contenders = grid_from_args(args)
    from smcspec.bench.engine import EnginePlan, run_engine
    from smcspec.engine import BACKENDS

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not backends or any(b not in BACKENDS or b == "auto" for b in backends):
        raise ValueError(f"--backends must list native and/or hf, got {args.backends!r}")
    if {"hf", "hf-assisted"} & set(args.methods):
        raise ValueError("bench engine runs ar, sd and smc on each engine; hf peers: bench speed")
    plan = EnginePlan(
        contenders,
        context=args.context,
        prompts=args.prompts,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        reps=args.reps,
        seed=args.seed,
    )
    llms = {b: _llm(args, b) for b in dict.fromkeys(backends)}
    print(run_engine(llms, plan, args.out))
    return 0


def _roofline(args: argparse.Namespace) -> int:
    contenders = grid_from_args(args)
    from smcspec.bench.roofline import run_roofline
    from smcspec.bench.speed import SpeedPlan, prompt_ids, run_speed

    rows = [
        (c.method, c.settings.get("particles", 1), c.settings["draft_tokens"])
        for c in contenders
        if c.method in ("sd", "smc") and "power_alpha" not in c.settings
    ]
    if not rows:
        raise ValueError("roofline needs sd or smc in --methods")
    if args.context < 2:
        raise ValueError(f"--context must be >= 2, got {args.context}")
    if args.speed_results and not Path(args.speed_results).exists():
        raise ValueError(f"--speed-results: no such file: {args.speed_results}")
    llm = _llm(args)
    speed_file = args.speed_results
    if speed_file is None:  # measure end-to-end speed-ups here: 2 prompts, 32 tokens
        sub_out = Path(args.out) / "roofline-speed"
        ar = build_grid(["ar"], [2], [1], [1])
        plan = SpeedPlan(ar + contenders, [args.temperature], 2, 32, False, 1, args.seed)
        run_speed(llm, plan, sub_out, precision(llm))
        speed_file = str(sub_out / "speed.jsonl")
    ids = prompt_ids(llm, 1)[0]
    context = (ids * (args.context // len(ids) + 1))[: args.context]
    print(
        run_roofline(
            llm,
            rows,
            context,
            args.out,
            args.timing_reps,
            speed_file,
            args.temperature,
            precision(llm),
        )
    )
    return 0


def _report(args: argparse.Namespace) -> int:
    from smcspec.bench.accuracy import write_accuracy_report
    from smcspec.bench.speed import write_speed_report

    out = Path(args.out)
    done = False
    if (out / "speed.jsonl").exists():
        write_speed_report(out)
        print((out / "speed.md").read_text())
        done = True
    if (out / "accuracy.jsonl").exists() or args.accuracy_files:
        for f in args.accuracy_files:
            if not Path(f).exists():
                raise ValueError(f"--accuracy-files: no such file: {f}")
        write_accuracy_report(out, args.accuracy_files)
        print((out / "accuracy.md").read_text())
        done = True
    if not done:
        raise ValueError(f"no speed.jsonl or accuracy.jsonl in {out}")
    return 0
