"""llama.cpp as a contender in `bench speed`, on the same prompts, tokens and threads as ours.

- `llama-cpp`: autoregressive decoding in this process through llama-cpp-python.
- `llama-cpp-spec`: llama.cpp's speculative decoding with the draft model, through its
  `llama-server` (llama-cpp-python has no draft-model decoding). Times are the server's own
  (prompt processing plus generation), so HTTP costs nothing.

Both run one build of llama.cpp, made by `scripts/build_llama_cpp`. Each quant is a pair of
GGUF files: the target's own type means both files as given (the shipped Q4_K_M target and its
draft); any other type (Q8_0) is made from both files by llama.cpp's `llama-quantize`, which
de-quantizes and quantizes again, and is cached beside them.

Sampling is plain temperature sampling over the whole vocabulary, as ours: top-k, top-p and
min-p off, no penalties. Runs ignore EOS, as ours do by default, and no prompt is reused from a
previous run.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from smcspec.bench.machine import free_port

VERSION = "0.3.36"  # llama-cpp-python, as pinned in scripts/build_llama_cpp
METHODS = ("llama-cpp", "llama-cpp-spec")
HOW = (
    "llama.cpp is not built here: run ./scripts/build_llama_cpp "
    "(once, 10-20 minutes on 2 cores; cached under ~/.cache/smcspec/llama.cpp)"
)
N_CTX = 4096
START_SECONDS = 300


def binaries(cache_dir: str | None = None) -> Path:
    """The folder holding llama-server and llama-quantize; ValueError saying how to build them."""
    from smcspec.engine.loading import cache_root

    folder = cache_root(cache_dir) / "llama.cpp" / VERSION / "build" / "bin"
    missing = [b for b in ("llama-server", "llama-quantize") if not (folder / b).is_file()]
    if missing:
        raise ValueError(f"{HOW} ({', '.join(missing)} not found in {folder})")
    try:
        import llama_cpp  # noqa: F401
    except ImportError as err:
        raise ValueError(f"{HOW} (the llama_cpp module does not import: {err})") from err
    return folder


def file_type(path: Path) -> str:
    """A GGUF file's quantization as llama.cpp names it (Q4_K_M, Q8_0, F16, ...)."""
    from gguf import GGUFReader, LlamaFileType

    field = GGUFReader(path).fields.get("general.file_type")
    if field is None:
        raise ValueError(f"{path}: no general.file_type in its metadata")
    return LlamaFileType(int(field.parts[field.data[0]][0])).name.removeprefix("MOSTLY_")


@dataclass(frozen=True)
class GGUFPair:
    """The target and draft files one quant runs on."""

    quant: str
    target: Path
    draft: Path


def pair_for(quant: str, target: Path, draft: Path, bin_dir: Path) -> GGUFPair:
    """`quant` equal to the target file's own type: both files as given. Otherwise both are
    made with llama-quantize, once, and cached beside the originals."""
    if quant == file_type(target):
        return GGUFPair(quant, target, draft)
    return GGUFPair(quant, _quantized(target, quant, bin_dir), _quantized(draft, quant, bin_dir))


def _quantized(src: Path, quant: str, bin_dir: Path) -> Path:
    out = src.with_name(f"{src.stem}-{quant}.gguf")
    if out.exists():
        return out
    partial = out.with_name(out.name + f".partial-{os.getpid()}")
    cmd = [str(bin_dir / "llama-quantize"), "--allow-requantize", str(src), str(partial), quant]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:]
        raise ValueError(f"llama-quantize could not make {quant} from {src}: {' '.join(tail)}")
    partial.replace(out)
    return out


def sampling_fields(temperature: float) -> dict[str, Any]:
    """llama.cpp's sampler settings for plain temperature sampling (greedy at 0)."""
    return {"temperature": temperature, "top_k": 0, "top_p": 1.0, "min_p": 0.0}


class LlamaCpp:
    """The llama.cpp side of one benchmark: a model in this process per quant (`llama-cpp`) and
    a llama-server per (quant, K) (`llama-cpp-spec`), started on first use. `close()` stops the
    servers; use it as a context manager."""

    def __init__(self, pairs: dict[str, GGUFPair], bin_dir: Path, threads: int) -> None:
        self.pairs = pairs
        self.bin_dir = bin_dir
        self.threads = threads
        self._models: dict[str, Any] = {}
        self._servers: dict[tuple[str, int], _Server] = {}

    def __enter__(self) -> LlamaCpp:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def describe(self) -> dict[str, Any]:
        """For result headers: the build, its CPU features, threads and files."""
        import llama_cpp

        built = self.bin_dir.parents[1] / "BUILT"  # scripts/build_llama_cpp's variant
        return {
            "llama_cpp_python": VERSION,
            "build": built.read_text().strip() if built.is_file() else None,
            "system_info": llama_cpp.llama_print_system_info().decode().strip(),
            "threads": self.threads,
            "files": {q: [p.target.name, p.draft.name] for q, p in self.pairs.items()},
        }

    def close(self) -> None:
        for server in self._servers.values():
            server.stop()
        self._servers.clear()
        self._models.clear()

    def run(
        self,
        method: str,
        settings: dict[str, Any],
        prompt_ids: list[int],
        temperature: float,
        max_new: int,
        seed: int,
    ) -> dict[str, Any]:
        quant = settings["quant"]
        if method == "llama-cpp":
            return _run_library(self._model(quant), prompt_ids, temperature, max_new, seed)
        server = self._server(quant, settings["draft_tokens"])
        return server.complete(prompt_ids, temperature, max_new, seed)

    def _model(self, quant: str):
        if quant not in self._models:
            from llama_cpp import Llama

            self._models[quant] = Llama(
                str(self.pairs[quant].target),
                n_ctx=N_CTX,
                n_threads=self.threads,
                n_threads_batch=self.threads,
                verbose=False,
            )
        return self._models[quant]

    def _server(self, quant: str, k: int) -> _Server:
        if (quant, k) not in self._servers:
            self._servers[(quant, k)] = _Server(self.pairs[quant], k, self.bin_dir, self.threads)
        return self._servers[(quant, k)]


def _run_library(model, prompt_ids, temperature, max_new, seed) -> dict[str, Any]:
    model.reset()  # no prefix of an earlier run is reused: every run processes its prompt
    model.set_seed(seed)
    fields = sampling_fields(temperature)
    tokens: list[int] = []
    start = time.perf_counter()
    first = start
    for token in model.generate(
        prompt_ids,
        temp=fields["temperature"],
        top_k=fields["top_k"],
        top_p=fields["top_p"],
        min_p=fields["min_p"],
        repeat_penalty=1.0,
        reset=True,
    ):
        if not tokens:
            first = time.perf_counter()
        tokens.append(token)
        if len(tokens) == max_new:
            break
    seconds = time.perf_counter() - start
    return _result(tokens, seconds, first - start, seed)


def _result(tokens: list[int], seconds: float, prefill: float, seed: int, **extra) -> dict:
    return {
        "token_ids": tokens,
        "seconds": seconds,
        "new_tokens": len(tokens),
        "tokens_per_second": len(tokens) / seconds,
        "time_split": {"prefill": prefill, "other": seconds - prefill},
        "seed": seed,
        **extra,
    }


class _Server:
    """One llama-server with target and draft on a free loopback port."""

    def __init__(self, pair: GGUFPair, k: int, bin_dir: Path, threads: int) -> None:
        self.port = free_port()
        cmd = [str(bin_dir / "llama-server"), "-m", str(pair.target), "-md", str(pair.draft)]
        cmd += ["--spec-type", "draft-simple", "--spec-draft-n-max", str(k)]
        cmd += ["-t", str(threads), "-tb", str(threads)]
        cmd += ["-td", str(threads), "-c", str(N_CTX), "-np", "1", "--no-webui"]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port)]
        self.log = bin_dir.parent / f"server-{self.port}.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log.read_text().strip().splitlines()[-3:]
                raise RuntimeError(f"llama-server exited at start: {' | '.join(tail)}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(
            f"llama-server did not answer within {START_SECONDS} s (log: {self.log})"
        )

    def complete(self, prompt_ids, temperature, max_new, seed) -> dict[str, Any]:
        body = {
            "prompt": list(prompt_ids),
            "n_predict": max_new,
            "ignore_eos": True,
            "cache_prompt": False,
            "return_tokens": True,
            "seed": seed,
            **sampling_fields(temperature),
        }
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/completion",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=600) as response:
            out = json.load(response)
        t = out["timings"]
        prefill, decode = t["prompt_ms"] / 1e3, t["predicted_ms"] / 1e3
        drafted = t.get("draft_n", 0)
        accepted = t.get("draft_n_accepted", 0)
        return _result(
            out["tokens"],
            prefill + decode,
            prefill,
            seed,
            acceptance_rate=accepted / drafted if drafted else None,
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
