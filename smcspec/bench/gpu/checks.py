"""The correctness checks of `smcspec bench gpu`: the native engine against transformers on the
same weights, CUDA-graph replays against eager steps, and the Triton paged-attention kernel
against the torch reference. Each check is one row: {"check", "ok", "failure", maybe "diff" and
"tol"}."""

from __future__ import annotations

from typing import Any

import torch

from smcspec.bench.gpu.pairs import (
    Deadline,
    GpuPlan,
    Pair,
    cast_parameters,
    generate,
    hf_model,
    label,
    pair_llm,
    replays,
    torch_dtype,
    wrap,
)
from smcspec.engine import start_cache
from smcspec.models.native import NativeCausalLM

Case = tuple[str, list[int], torch.Tensor]  # (check, token ids, native log-probs [T, V])


def check_correctness(
    pair: Pair, plan: GpuPlan, roles: tuple[str, ...] = ("target", "draft"), graphs: bool = True
) -> list[str]:
    """Failures (empty: all passed) of `correctness` over the models `roles` of `pair`, and of
    graphs against eager steps unless `graphs` is False."""
    return [r["failure"] for r in correctness(pair, plan, roles, graphs) if not r["ok"]]


def correctness(
    pair: Pair, plan: GpuPlan, roles: tuple[str, ...] = ("target", "draft"), graphs: bool = True
) -> list[dict]:
    """One row per check: native logits against transformers' on the same weights (prefill, a
    decode step, a verify of K+1, and after a fork, a truncation and a resampling), then
    graph replays against eager steps (tokens of ar, sd and smc, and logits)."""
    rows = [row for role in roles for row in native_vs_transformers(pair, plan, role)]
    if not graphs:
        return rows
    return rows + graphs_vs_eager(pair, plan) + scheduler_batch(pair, plan) + one_token(pair, plan)


def native_vs_transformers(pair: Pair, plan: GpuPlan, role: str) -> list[dict]:
    """`judge` of the native model `role` of `pair` along `native_cases`."""
    cases = native_cases(wrap(getattr(pair, role), False, plan), plan)
    return judge(cases, hf_model(pair, role, plan), plan, f"{pair.name} {role}")


def native_cases(lm: NativeCausalLM, plan: GpuPlan, k: int = 4) -> list[Case]:
    """Log-probs of the native engine along a path through every cache operation the decoders
    use; each case names the full token sequence transformers recomputes from scratch."""
    g = torch.Generator().manual_seed(plan.seed)

    def ids(*shape: int) -> torch.Tensor:
        return torch.randint(0, lm.vocab_size, shape, generator=g)

    def logprobs(tokens: torch.Tensor, cache: Any, num_logits: int) -> torch.Tensor:
        return lm.forward(tokens, cache, num_logits).float().log_softmax(-1)  # [B, n, V]

    cache = lm.new_cache()
    seq = ids(plan.check_tokens).tolist()
    cases: list[Case] = [("prefill", seq, logprobs(torch.tensor([seq]), cache, len(seq))[0])]
    seq = seq + ids(1).tolist()
    cases.append(("decode step", seq, logprobs(torch.tensor([seq[-1:]]), cache, 1)[0]))
    seq = seq + ids(k + 1).tolist()
    cases.append((f"verify {k + 1}", seq, logprobs(torch.tensor([seq[-k - 1 :]]), cache, k + 1)[0]))
    cache.select(torch.zeros(3, dtype=torch.long))  # fork: three rows share the pages
    cache.crop(len(seq) - 2)  # truncate mid-page: the next write copies the shared page
    feed = ids(3, k + 1)  # [3, K+1]
    out = logprobs(feed, cache, k + 1)
    rows = [seq[:-2] + feed[r].tolist() for r in range(3)]
    cases += [(f"fork+truncate row {r}", rows[r], out[r]) for r in range(3)]
    ancestors = torch.tensor([2, 0, 0])
    cache.select(ancestors)  # resampling
    feed = ids(3, 1)
    out = logprobs(feed, cache, 1)
    rows = [rows[a] + feed[r].tolist() for r, a in enumerate(ancestors.tolist())]
    cases += [(f"resampled row {r}", rows[r], out[r]) for r in range(3)]
    cache.release()
    return cases


def judge(cases: list[Case], hf: Any, plan: GpuPlan, what: str) -> list[dict]:
    """Max |native - reference| of log-probs. float32: transformers is the reference and the
    tolerance 1e-3 nats (measured on the CPU at `GpuPlan.check_qk_scale` 2x: 7e-6 on the 0.5B
    shape, 8 and 24 layers; an attention bug moves log-probs by far more). bfloat16: the
    reference is transformers in float32 on the same (bf16) weights, and native may miss it
    by 3x what transformers' own bf16 run does (+1e-3)."""
    ref = _hf_logprobs(hf, cases, plan.device)
    gaps = [0.0] * len(cases)
    if plan.dtype != "float32":
        cast_parameters(hf, torch.float32)  # exact: the weights are bf16 values
        exact = _hf_logprobs(hf, cases, plan.device)
        gaps = [_maxdiff(a, b) for a, b in zip(ref, exact, strict=True)]
        cast_parameters(hf, torch_dtype(plan.dtype))
        ref = exact
    rows = []
    for (check, _, native), want, gap in zip(cases, ref, gaps, strict=True):
        diff = _maxdiff(native, want)
        tol = 1e-3 if plan.dtype == "float32" else 3 * gap + 1e-3
        ok = diff <= tol  # False on NaN
        failure = f"{what}: {check}: max |log p native - log p transformers| {diff:.2e} > {tol:.2e}"
        rows.append(
            {"check": f"{what}: {check}", "diff": diff, "tol": tol, "ok": ok, "failure": failure}
        )
    return rows


def _hf_logprobs(hf: Any, cases: list[Case], device: str) -> list[torch.Tensor]:
    """transformers' log-probs of the last T positions of each case's sequence, [T, V]."""
    out = []
    with torch.inference_mode():
        for _, ids, native in cases:
            logits = hf(torch.tensor([ids], device=device)).logits[0, -native.shape[0] :]
            out.append(logits.float().log_softmax(-1))
    return out


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.to(b.device) - b).abs().max())


def graphs_vs_eager(pair: Pair, plan: GpuPlan, deadline: Deadline | None = None) -> list[dict]:
    """Graph replays against eager steps of the same models: ar, sd and smc tokens with one
    seed must be identical (particle counts on the buckets: an off-bucket count pads, and
    may flip a near-tie), and a padded batch's logits must match an eager run of the same
    padded batch. Methods the deadline leaves out are rows with ok None (not run)."""
    eager, graphs = pair_llm(pair, False, plan), pair_llm(pair, True, plan)
    g = torch.Generator().manual_seed(plan.seed + 2)
    prompt = torch.randint(0, eager.target.vocab_size, (plan.check_tokens,), generator=g).tolist()
    tokens = min(plan.new_tokens, plan.check_tokens)  # identical or not: 64 tokens tell
    rows = []
    for method in plan.methods:
        if method[1] & (method[1] - 1):
            continue
        check = f"{pair.name} graphs vs eager: {label(method)} tokens"
        if deadline is not None and deadline.passed():
            rows.append(not_run(check, "time budget"))
            continue
        want = generate(eager, prompt, method, plan, tokens).token_ids
        got = generate(graphs, prompt, method, plan, tokens).token_ids
        first = next((i for i, (a, b) in enumerate(zip(want, got, strict=True)) if a != b), None)
        failure = f"{pair.name}: graphs vs eager {label(method)}: tokens differ at {first}"
        rows.append({"check": check, "ok": want == got, "failure": failure})
    feed = torch.randint(0, eager.target.vocab_size, (PADDED_ROWS + 1, PADDED_TOKENS), generator=g)
    before = replays(graphs)
    got = _padded_step(graphs.target, prompt, feed[:PADDED_ROWS])
    replayed = replays(graphs) > before  # else eager met eager: proves nothing
    want = _padded_step(eager.target, prompt, feed)[:PADDED_ROWS]
    diff = _maxdiff(got, want)
    tol = 1e-4 if plan.dtype == "float32" else 2e-2
    rows.append(
        {
            "check": f"{pair.name} graphs vs eager: logits of {PADDED_ROWS} rows x "
            f"{PADDED_TOKENS} tokens (padded) vs eager {PADDED_ROWS + 1} rows",
            "diff": diff,
            "tol": tol,
            "ok": diff <= tol and replayed,
            "failure": f"{pair.name}: graphs vs eager logits differ by {diff:.2e} > {tol:.2e}"
            if replayed
            else f"{pair.name}: the padded batch was not served by a graph",
        }
    )
    n = replays(graphs)
    rows.append(
        {
            "check": f"{pair.name} graphs replayed ({n} times)",
            "ok": n > 0,
            "failure": f"{pair.name}: no graph was replayed: the graphs check proves nothing",
        }
    )
    return rows


# A verify of 3 rows x 4 tokens: 12 tokens, which a graph pads to 16 whether it buckets rows (4
# rows of 4) or total tokens (16), so an eager pass of 4 real rows has the graph's shapes.
PADDED_ROWS, PADDED_TOKENS = 3, 4


def not_run(check: str, why: str) -> dict:
    """A check row for a check that did not run: neither passed nor failed."""
    return {"check": check, "ok": None, "failure": f"{check}: not run ({why})"}


def _padded_step(lm: NativeCausalLM, prompt: list[int], feed: torch.Tensor) -> torch.Tensor:
    """Log-probs [B, T, V] of a verify of feed [B, T] over the prompt, one row per feed row."""
    cache = start_cache(lm, torch.tensor(prompt), rows=feed.shape[0])
    out = lm.forward(feed, cache, feed.shape[1]).float().log_softmax(-1)
    cache.release()
    return out


def check_triton(device: str, seed: int = 0) -> list[dict]:
    """The Triton paged-attention kernel against the torch reference on ragged batches of the
    pairs' head shapes (head_dim, query heads per KV head), in bf16 (the bench) and float32
    (the correctness checks): one row each."""
    from smcspec.models import paged_attention as pa

    rows = []
    g = torch.Generator(device=device).manual_seed(seed)
    for dtype, tol in ((torch.bfloat16, 2e-2), (torch.float32, 1e-4)):
        for d, nh, nkv in ((128, 12, 2), (64, 14, 2), (128, 28, 4)):
            pages, page_size, positions = 64, 16, [0, 17, 300, 301, 302, 511]

            def randn(*shape: int, dtype: torch.dtype = dtype) -> torch.Tensor:
                return torch.randn(*shape, generator=g, device=device).to(dtype)

            k, v = randn(pages, page_size, nkv, d), randn(pages, page_size, nkv, d)
            q = randn(len(positions), nh, d)
            perm = torch.randperm(pages, generator=g, device=device)
            tables = perm.view(2, pages // 2).int()  # [2 sequences, 32 pages] of shuffled pages
            seq_index = torch.tensor([0, 0, 1, 1, 1, 1], dtype=torch.int32, device=device)
            pos = torch.tensor(positions, device=device)
            args = (q, k, v, tables, seq_index, pos, d**-0.5)
            # bf16 output: a few units in the last place of values ~1
            diff = _maxdiff(pa.triton_attention(*args).float(), pa.reference(*args).float())
            check = f"triton attention {str(dtype)[6:]} d={d} nh={nh} nkv={nkv}"
            failure = f"{check}: max diff {diff:.2e} > {tol:.0e}"
            rows.append(
                {"check": check, "diff": diff, "tol": tol, "ok": diff <= tol, "failure": failure}
            )
    return rows


def scheduler_batch(pair: Pair, plan: GpuPlan, requests: int = 4) -> list[dict]:
    """The continuous-batching scheduler on the engine as it runs here (graphs): smc requests
    batched into shared passes, against each alone. Rows batched together may round
    differently from rows alone (another matrix size), so the check asks that every request
    completes with all its tokens and that no KV page leaks; the agreement is reported."""
    llm = pair_llm(pair, True, plan)
    g = torch.Generator().manual_seed(plan.seed + 3)
    vocab = llm.target.vocab_size
    prompts = [torch.randint(0, vocab, (8 + 3 * i,), generator=g).tolist() for i in range(requests)]
    new_tokens = plan.check_tokens // 5 * 5 + 1  # rounds of K + 1 = 5, then one of K = 0
    settings = dict(
        particles=4, draft_tokens=4, temperature=plan.temperature,
        max_new_tokens=new_tokens, stop_at_eos=False, seed=plan.seed, chat=False,
    )  # fmt: skip
    passes = count_passes(llm)
    before = replays(llm)
    together = llm.generate_batch(prompts, "smc", **settings)
    served = {"replays": replays(llm) - before, "passes": passes[0]}
    alone = [
        llm.generate(p, "smc", **{**settings, "seed": plan.seed + i}) for i, p in enumerate(prompts)
    ]
    same = sum(a.token_ids == b.token_ids for a, b in zip(alone, together, strict=True))
    complete = all(len(r.token_ids) == new_tokens for r in together)
    leaked = llm.target.pages.used_pages + llm.draft.pages.used_pages
    return [
        {
            "check": f"{pair.name} scheduler: {requests} smc requests batched "
            f"({same}/{requests} token-identical to alone)",
            "ok": complete and leaked == 0,
            "failure": f"{pair.name}: scheduler batch: complete={complete}, "
            f"{leaked} KV pages left in use",
            **served,
        }
    ]


def count_passes(llm: Any) -> list[int]:
    """A counter ([passes]) of the forward passes both models of llm run from now on (their
    `forward_many`, which every batch goes through), graph replays or not."""
    counter = [0]
    for model in (llm.target, llm.draft):

        def counted(calls: list, inner: Any = model.forward_many) -> list:
            counter[0] += 1
            return inner(calls)

        model.forward_many = counted
    return counter


def one_token(pair: Pair, plan: GpuPlan) -> list[dict]:
    """sd and smc asked for one new token: a round with no draft (K = 0), whose empty drafts
    are made on the host while the target's logits live on the device."""
    llm = pair_llm(pair, True, plan)
    rows = []
    for method in (("sd", 1, 4), ("smc", 4, 4)):
        try:
            n = len(generate(llm, list(range(1, 9)), method, plan, 1).token_ids)
            failure = f"{pair.name}: {label(method)} gave {n} tokens for 1"
        except Exception as err:  # the check's point: report it, and go on
            n, failure = 0, f"{pair.name}: {label(method)} with one new token raised {err!r}"
        check = f"{pair.name} {label(method)}: one new token"
        rows.append({"check": check, "ok": n == 1, "failure": failure})
    return rows
