"""Where a Gemma 3 270M int8 step's time goes, against what memory allows (probe.txt): this
machine's float32 matrix-vector bandwidth (a 168 MB matrix, as large as the output layer), the
output layer alone, every product of a step (each linear's call timed in a real step, whose
layer weights come from memory, not cache), and the step itself. Alone on the machine.

    .venv/bin/python benchmarks/cpu/gemma3-270m-norms/probe.py
"""

import statistics
import time

import torch

from smcspec import LLM
from smcspec.decoding.base import released
from smcspec.engine.timing import start_cache
from smcspec.models import cpu_linear
from smcspec.models import defaults as d


def median_ms(f, n: int = 30) -> float:
    f()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    matrix, x = torch.randn(65536, 640), torch.randn(1, 640)
    ms = median_ms(lambda: x @ matrix.T)
    print(f"float32 matvec, 168 MB: {ms:.2f} ms, {168e6 / ms / 1e6:.1f} GB/s")
    g = str(d.gguf_path(d.GEMMA3_270M))
    model = LLM(target=g, draft=g, dtype="int8").target
    net = model.model
    print(f"output layer alone (int8, 262144 x 640): {median_ms(lambda: net.lm_head(x)):.2f} ms")
    spent = [0.0]
    call = cpu_linear.PackedLinear.__call__

    def timed(self, rows):
        start = time.perf_counter()
        out = call(self, rows)
        spent[0] += time.perf_counter() - start
        return out

    ctx = list(range(1000, 1150))
    with released() as held:
        cache = start_cache(model, torch.tensor(ctx), 1, held)
        length, token = cache.length, torch.tensor([ctx[-1:]])
        step = median_ms(lambda: (model.forward(token, cache, 1), cache.crop(length)), 50)
        cpu_linear.PackedLinear.__call__ = timed
        for _ in range(50):
            model.forward(token, cache, 1)
            cache.crop(length)
        cpu_linear.PackedLinear.__call__ = call
    print(f"step at a 150-token context: {step:.2f} ms")
    print(f"its 73 products (timed in 50 steps): {1e3 * spent[0] / 50:.2f} ms a step")


main()
