"""`smcspec bench ...`: validate everything, then load models, then run."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from smcspec.bench.contenders import build_grid, parse_ints


def _floats(text: str, name: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError as err:
        raise ValueError(f"{name} must be a comma-separated list of numbers, got {text!r}") from err
    if not values:
        raise ValueError(f"{name} is empty")
    return values


def _grid(args: argparse.Namespace):
    if args.backend != "hf" and {"hf", "hf-assisted"} & set(args.methods):
        raise ValueError("hf and hf-assisted need --backend hf (they run transformers' generate)")
    return build_grid(
        args.methods,
        parse_ints(args.sd_k, "--sd-k"),
        parse_ints(args.smc_n, "--smc-n"),
        parse_ints(args.smc_k, "--smc-k"),
        args.resample_threshold,
        _floats(args.smc_power, "--smc-power") if args.smc_power else None,
    )


def _llm(args: argparse.Namespace, backend: str | None = None):
    from smcspec.cli import llm_from_args

    return llm_from_args(args, backend)


def precision(llm) -> str:
    """How the weights ran, for result headers: e.g. "int8, native backend"."""
    return f"{llm.dtype}, {llm.backend} backend"


def run_bench(args: argparse.Namespace) -> int:
    cmd = args.bench_command
    if cmd == "report":
        return _report(args)
    if cmd == "fidelity":
        return _fidelity(args)
    if cmd == "serve":
        return _serve(args)
    if cmd == "gpu":
        return _gpu(args)
    if cmd == "json":
        from smcspec.bench.constrained import run_json
        from smcspec.config import method_configs

        method_configs(args.particles, args.draft_tokens)
        if args.reps < 1 or args.max_new_tokens < 1:
            raise ValueError("--reps and --max-new-tokens must be >= 1")
        llm = _llm(args)
        print(
            run_json(
                llm, args.out, args.particles, args.draft_tokens, args.reps, args.max_new_tokens
            )
        )
        return 0
    contenders = _grid(args)
    if cmd == "speed":
        from smcspec.bench.speed import SpeedPlan, run_speed

        plan = SpeedPlan(
            contenders,
            _floats(args.temperatures, "--temperatures"),
            args.prompts,
            args.max_new_tokens,
            args.natural_stop,
            args.reps,
            args.seed,
        )
        llm = _llm(args)
        run_speed(llm, plan, args.out, precision(llm))
        print((Path(args.out) / "speed.md").read_text())
        return 0
    if cmd == "accuracy":
        from smcspec.bench.accuracy import AccuracyPlan, run_accuracy

        plan = AccuracyPlan(
            contenders,
            args.temperature,
            args.offset,
            args.limit,
            args.max_new_tokens,
            args.timeout,
            args.seed,
        )
        llm = _llm(args)
        run_accuracy(llm, plan, args.out, precision(llm))
        print((Path(args.out) / "accuracy.md").read_text())
        return 0
    if cmd == "engine":
        return _engine(args, contenders)
    return _roofline(args, contenders)


def _gpu(args: argparse.Namespace) -> int:
    import dataclasses

    from smcspec.bench.gpu import GpuPlan, run_all

    plan = GpuPlan.smoke() if args.smoke else _gpu_plan(args.device, args.dtype)
    for name in ("new_tokens", "reps"):
        if getattr(args, name) is not None:
            plan = dataclasses.replace(plan, **{name: getattr(args, name)})
    outcome = run_all(plan, args.out)
    print(outcome.report)
    for line in outcome.failures:
        print(f"smcspec: check failed: {line}", file=sys.stderr)
    return 1 if outcome.failures else 0


def _gpu_plan(device: str, dtype: str):
    """The full plan on `device`; without CUDA it needs --device cpu (7B shapes on a CPU take
    hours), and there attention is the paged reference so that graphs run `eager_capture`."""
    import torch

    from smcspec.bench.gpu import GpuPlan

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

    plan = ServePlan(
        methods=tuple(m.strip() for m in args.methods.split(",") if m.strip()),
        concurrency=tuple(parse_ints(args.concurrency, "--concurrency")),
        requests=args.requests,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
    )
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
    from smcspec.models import defaults, hf
    from smcspec.models.llama import SUPPORTED
    from smcspec.models.loader import architecture, load_tokenizer

    if args.new_tokens < 1:
        raise ValueError(f"--new-tokens must be >= 1, got {args.new_tokens}")
    specs = {}
    for role, spec, default in (
        ("target", args.target, defaults.DEFAULT_TARGET),
        ("draft", args.draft, defaults.DEFAULT_DRAFT),
    ):
        if spec is not None:
            hf.check_spec(spec, role)
        spec = spec or str(defaults.ensure(default, args.cache_dir))
        if architecture(spec) not in SUPPORTED:
            raise ValueError(
                f"{role}: fidelity runs on the native engine; {spec} is not a local "
                f"{'/'.join(SUPPORTED)} folder or .gguf"
            )
        specs[role] = spec
    print(
        run_fidelity(specs, load_tokenizer(specs["target"]), args.dtype, args.new_tokens, args.out)
    )
    return 0


def _engine(args: argparse.Namespace, contenders) -> int:
    from smcspec.bench.engine import EnginePlan, run_engine
    from smcspec.models.loader import BACKENDS

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


def _roofline(args: argparse.Namespace, contenders) -> int:
    from smcspec.bench.roofline import run_roofline
    from smcspec.bench.speed import SpeedPlan, prompt_ids, run_speed

    grid = [
        (c.settings["particles"], c.settings["draft_tokens"])
        for c in contenders
        if c.method == "smc"
    ]
    if not grid:
        raise ValueError("roofline needs smc in --methods")
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
            grid,
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
