"""Pure functions from logits to the next-token law, and sampling from it.

The law every method targets is  softmax(l / T)  restricted to the top-k tokens, then to the
smallest nucleus of mass >= top_p, then to the tokens of probability >= min_p times the largest
(the order Hugging Face uses), renormalized. T = 0 is greedy: all mass on the arg-max token.
The logits l are the model's, adjusted first for the sequence they continue (`adjust`):
logit_bias added, then the repetition penalty, then the presence and frequency penalties.

Extremes never make a NaN law nor an id outside the vocabulary: a NaN logit is a token of
probability 0, +inf the largest finite logit, and a row whose scaled logits overflow takes the
greedy law (see `log_probs`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from smcspec.config import SamplingConfig

NEG_INF = float("-inf")


def log_probs(
    logits: torch.Tensor,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> torch.Tensor:
    """Normalized log-probabilities of the truncated, tempered law.  [..., V] -> [..., V].

    Computed in fp32 (fp64 if given fp64). A row whose logits / T overflow (T below
    |logit| / 3.4e38 in fp32, or T rounding to 0) gets the greedy law: there any two distinct
    logits are at least one ulp (|logit| * 6e-8) apart, more than 1e31 once scaled, so every
    token but the arg-max has tempered mass exp(-1e31) = 0 in any float; the greedy law IS the
    tempered law, up to ties among maxima (then the first one, as T = 0 does)."""
    finite = _finite(logits if logits.dtype == torch.float64 else logits.float())  # a copy
    if temperature == 0:
        return _greedy(finite)
    # Asking whether any row overflowed is a host sync on a GPU, where the select always runs
    # instead. On the CPU one min/max pass usually shows that none can, and the copy is then
    # scaled in place: over 152k tokens a row, every pass and every new tensor counts.
    if logits.device.type != "cpu" or _may_overflow(finite, temperature):
        scaled = finite / temperature  # [..., V]
        overflow = (scaled.isinf() & finite.isfinite()).any(dim=-1, keepdim=True)  # [..., 1]
        scaled = torch.where(overflow, _greedy(finite), scaled)
    else:
        scaled = finite.div_(temperature)
    if 0 < top_k < scaled.shape[-1]:
        scaled = _keep_top_k(scaled, top_k)
    if top_p < 1.0:
        scaled = _keep_top_p(scaled, top_p)
    if min_p > 0.0:
        scaled = _keep_min_p(scaled, min_p)
    return torch.log_softmax(scaled, dim=-1)


def _may_overflow(logits: torch.Tensor, temperature: float) -> bool:
    """False when no finite logit can leave the float range once divided by `temperature`
    (logits: no NaN, no +inf). Dividing by T >= 1 never can; below, the bound is the largest
    magnitude, unless some token is masked at -inf (then the finite minimum is unknown: True)."""
    if temperature >= 1.0:
        return False
    lo, hi = torch.aminmax(logits)
    bound = max(abs(float(lo)), abs(float(hi)))
    return not math.isfinite(bound) or bound >= torch.finfo(logits.dtype).max * temperature


def _finite(logits: torch.Tensor) -> torch.Tensor:
    # NaN (a broken model row) is probability 0 and +inf the largest finite logit, so that
    # log_softmax never sees inf - inf; -inf stays a masked token.
    top = torch.finfo(logits.dtype).max
    return logits.nan_to_num(nan=NEG_INF, posinf=top, neginf=NEG_INF)


def _greedy(logits: torch.Tensor) -> torch.Tensor:
    out = torch.full_like(logits, NEG_INF)
    return out.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 0.0)


def _keep_top_k(scaled: torch.Tensor, k: int) -> torch.Tensor:
    # Exactly k survivors even under ties: mask by index, not by threshold value.
    # The survivors' values come back from topk as they were: writing them into a masked row
    # gives the masked copy bit for bit, in three operations instead of five.
    top = scaled.topk(k, dim=-1)
    return torch.full_like(scaled, NEG_INF).scatter_(-1, top.indices, top.values)


def _keep_top_p(scaled: torch.Tensor, top_p: float) -> torch.Tensor:
    # Keep token i (in descending order) while the mass strictly before it is < top_p, so the
    # token that crosses top_p stays in; the most likely token always stays (a top_p below
    # float32's smallest number would otherwise keep nothing).
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    keep_sorted = mass_before < top_p
    keep_sorted[..., 0] = True
    keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
    return scaled.masked_fill(~keep, NEG_INF)


def _keep_min_p(scaled: torch.Tensor, min_p: float) -> torch.Tensor:
    # p_i >= min_p * p_max  <=>  l_i >= l_max + log(min_p): no softmax needed, and the arg-max
    # always stays.
    floor = scaled.max(dim=-1, keepdim=True).values + math.log(min_p)
    return scaled.masked_fill(scaled < floor, NEG_INF)


def law(
    logits: torch.Tensor,
    cfg: SamplingConfig,
    temperature: float,
    context: Sequence[torch.Tensor],
    prompt_len: int,
) -> torch.Tensor:
    """The next-token law (log-probabilities) at each position of logits [B, P, V]: `adjust`ed
    for the sequences they continue, then `log_probs` at `temperature` with cfg's truncation.
    context: pieces [B, *] that joined along dim 1 are the prompt, the text and the P - 1 tokens
    fed before the last position; they are joined (and moved to the logits' device) only when
    an adjustment needs them."""
    return tempered(scores(logits, cfg, context, prompt_len), cfg, temperature)


def scores(
    logits: torch.Tensor, cfg: SamplingConfig, context: Sequence[torch.Tensor], prompt_len: int
) -> torch.Tensor:
    """The logits [B, P, V] `adjust`ed for the sequences they continue (context as in `law`):
    what the temperature divides, and what T = 0 takes the arg-max of. The same tensor when
    cfg adjusts nothing."""
    if not cfg.adjusts_logits:
        return logits
    tokens = torch.cat([to_device(piece, logits.device) for piece in context], dim=1)
    return adjust(logits, tokens, prompt_len, cfg)


def tempered(scores: torch.Tensor, cfg: SamplingConfig, temperature: float) -> torch.Tensor:
    """`log_probs` of scores [..., V] at `temperature`, truncated as cfg says."""
    return log_probs(scores, temperature, cfg.top_k, cfg.top_p, cfg.min_p)


def greedy_among(scores: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """The T = 0 law among the allowed tokens [..., V] (bool; None: all): all mass on the
    arg-max of scores [..., V] over them, the first under ties, as `log_probs` at T = 0. Scores
    read as `log_probs` reads logits (NaN is -inf, +inf the largest finite). A row where no
    allowed token has a finite score comes back all -inf: an empty law, as the restricted law
    is at every T > 0 there."""
    finite = _finite(scores if scores.dtype == torch.float64 else scores.float())  # a copy
    if allowed is not None:
        finite.masked_fill_(~allowed, NEG_INF)
    best = finite.argmax(dim=-1, keepdim=True)  # [..., 1]
    empty = torch.isneginf(finite.gather(-1, best))  # [..., 1]
    return torch.full_like(finite, NEG_INF).scatter_(-1, best, 0.0).masked_fill_(empty, NEG_INF)


def adjust(
    logits: torch.Tensor, tokens: torch.Tensor, prompt_len: int, cfg: SamplingConfig
) -> torch.Tensor:
    """Logits [B, P, V] adjusted for the sequence each continues: position j of row b follows
    tokens[b, : T - P + 1 + j] (tokens [B, T]: the prompt, the text so far, then the P - 1
    tokens the earlier positions were fed, e.g. a round's drafts). Unchanged (the same tensor)
    when `cfg` sets no logit bias and no penalty.

    In order: l += logit_bias; repetition penalty r on every token of the prompt and text
    (l / r where l > 0, l * r elsewhere); l -= frequency * c + presence * [c > 0], with c the
    token's count in the generated text (tokens past prompt_len)."""
    if not cfg.adjusts_logits:
        return logits
    b, p, v = logits.shape
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    tokens = to_device(tokens, logits.device)
    start = tokens.shape[1] - p + 1  # the first position's context length
    seen = torch.zeros(b, v, dtype=torch.bool, device=logits.device)
    seen.scatter_(1, tokens[:, :start], True)
    counts = torch.zeros(b, v, dtype=dtype, device=logits.device)
    ones = torch.ones_like(tokens, dtype=dtype)
    counts.scatter_add_(1, tokens[:, prompt_len:start], ones[:, prompt_len:start])
    bias = dense_bias(cfg.logit_bias, v, dtype, logits.device) if cfg.logit_bias else None
    out = []
    for j in range(p):
        if j > 0:  # the position after token j - 1 of the block
            x = tokens[:, start + j - 1 : start + j]  # [B, 1]
            seen.scatter_(1, x, True)
            if start + j - 1 >= prompt_len:  # a generated token (a scored prompt's is not)
                counts.scatter_add_(1, x, ones[:, :1])
        out.append(_penalize(logits[:, j].to(dtype), seen, counts, bias, cfg))
    return torch.stack(out, dim=1)


@functools.lru_cache(maxsize=16)
def dense_bias(
    pairs: tuple[tuple[int, float], ...], vocab: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """logit_bias (sorted (id, bias) pairs) as a dense [V] vector on `device`, never written to.

    Kept (a few per device): a request's every draft step adds it, and building it anew each
    step was a [V] host tensor and a copy to the device per step. A pure function of its
    arguments, so keeping it changes nothing but the cost."""
    ids, values = zip(*pairs, strict=True)
    if max(ids) >= vocab:
        raise ValueError(f"logit_bias: token {max(ids)} is outside the vocabulary ({vocab})")
    bias = torch.zeros(vocab, dtype=dtype)
    bias[list(ids)] = torch.tensor(values, dtype=dtype)
    return to_device(bias, device)


def _penalize(
    logits: torch.Tensor,
    seen: torch.Tensor,
    counts: torch.Tensor,
    bias: torch.Tensor | None,
    cfg: SamplingConfig,
) -> torch.Tensor:
    """One position's logits [B, V], after its context's seen tokens [B, V] and generated
    counts [B, V]."""
    if bias is not None:
        logits = logits + bias
    r = cfg.repetition_penalty
    if r != 1:
        logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
    if cfg.frequency_penalty != 0 or cfg.presence_penalty != 0:
        # the logits dtype: a float32 mask would round the penalty of a float64 law
        present = (counts > 0).to(counts.dtype)
        logits = logits - cfg.frequency_penalty * counts - cfg.presence_penalty * present
    return logits


def sample(logp: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Draw one token per row by inverting the CDF with one uniform per row (cheaper than
    Gumbel-max over a 150k vocabulary). [..., V] -> [...] int64, always in [0, V).
    `sample_at` with the next uniforms of `generator`."""
    return sample_at(logp, uniforms(logp.shape[:-1], generator, logp.device))


CPU_CHUNKED_FROM = 16384
"""The vocabulary size from which the CPU samples in two levels too. Its ~12 extra small
operations cost more than a short row's one scan; measured on this project's 2-core CPU at 8
rows (minimum of many, one thread): V = 1k 68 against 122 us, 8k 219 / 241, 32k 717 / 634,
152k 3.8-8.2 / 2.8-3.4 ms (one level / two). On a GPU the scan is serial: always two levels."""


def sample_at(logp: torch.Tensor, u: torch.Tensor, chunked: bool | None = None) -> torch.Tensor:
    """The token of each row of logp [..., V] at which its CDF first exceeds u [...] (float64
    in [0, 1), on logp's device) times the row's total. [...] int64, always in [0, V).

    chunked: in two levels (`_invert_chunked`), with no scan over the whole row; False: the
    one-level reference (`_invert_flat`); None: two levels but on the CPU below
    `CPU_CHUNKED_FROM` tokens. The two agree but where u falls within rounding of a CDF step.

    A token of probability zero has the same CDF value as its predecessor, so `u < cdf[i]`
    first holds at a token of positive probability. A row without mass (all -inf, or NaN: a
    caller's dead particle) has nothing to draw; it gets its arg-max id (0 if all -inf), never
    V, which would fail the next forward pass of every request batched with it."""
    rows = logp.reshape(-1, logp.shape[-1])  # [N, V]
    if chunked is None:
        chunked = logp.device.type != "cpu" or rows.shape[1] >= CPU_CHUNKED_FROM
    invert = _invert_chunked if chunked else _invert_flat
    token, total = invert(rows, u.reshape(-1))  # [N] each
    # as in `log_probs`: no host sync on a device; on the CPU one read of the few totals
    # usually shows every row has mass (NaN fails `0 < x`), fewer ops than the mask and `any`
    if logp.device.type != "cpu" or not all(0 < x < math.inf for x in total.tolist()):
        empty = ~(total > 0) | total.isinf()  # [N], True where NaN, 0 or inf
        token = torch.where(empty, rows.nan_to_num(nan=NEG_INF).argmax(dim=-1), token)
    return token.reshape(logp.shape[:-1])


def _invert_flat(rows: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(token [N], total mass [N]) of rows [N, V] at u [N]: one float64 cumsum over the row.
    On CUDA that scan is serial within a row, ~150 dependent steps at V = 152k."""
    cdf = rows.to(torch.float64, copy=True).exp_().cumsum_(dim=-1)  # [N, V], one new tensor
    total = cdf[:, -1]
    target = _below(u * total, total)  # [N]
    return torch.searchsorted(cdf, target[:, None], right=True).squeeze(1), total


def _invert_chunked(rows: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`_invert_flat` in two levels: the row is cut into C chunks of W ~ sqrt(V) tokens; the
    CDF at the chunk ends (a sum per chunk, then a scan over C) finds the chunk the target
    u * total falls in, and a scan inside that chunk only, of the target less the mass before
    the chunk, finds the token. Two scans of ~sqrt(V) steps instead of one of V: at
    V = 152k, 390 and 390 against 152k.

    Never a token of probability zero: the chosen chunk c ends strictly above the target and
    the one before it at or below, so c's own mass is positive, and the target is kept
    strictly below the mass the scan inside c adds up (rounding may differ from the chunk's
    sum), so the scan stops at a token that adds mass."""
    n, v = rows.shape
    width = math.isqrt(v - 1) + 1  # W = ceil(sqrt(V))
    count = -(-v // width)  # C
    p = rows.new_zeros((n, count * width), dtype=torch.float64)  # the padding: probability 0
    p[:, :v].copy_(rows).exp_()
    p = p.view(n, count, width)  # [N, C, W]
    ends = p.sum(dim=-1).cumsum_(dim=-1)  # [N, C] the CDF at each chunk's last token
    total = ends[:, -1]
    target = _below(u * total, total)[:, None]  # [N, 1]
    # clamped only for rows without mass (NaN sums), whose token `sample_at` replaces
    c = torch.searchsorted(ends, target, right=True).clamp_(max=count - 1)  # [N, 1]
    before = ends.gather(1, (c - 1).clamp(min=0)).masked_fill_(c == 0, 0.0)  # [N, 1]
    inside = p.gather(1, c[:, :, None].expand(n, 1, width)).squeeze(1).cumsum_(dim=-1)  # [N, W]
    rest = _below(target - before, inside[:, -1:])  # [N, 1], >= 0: before <= target
    j = torch.searchsorted(inside, rest, right=True).clamp_(max=width - 1)  # [N, 1]
    return (c * width + j).squeeze(1), total


def _below(x: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """x, kept strictly below limit despite rounding (u * total can round up to total)."""
    return torch.minimum(x, torch.nextafter(limit, torch.zeros_like(limit)))


def uniforms(
    shape: torch.Size | tuple[int, ...], generator: torch.Generator, device: torch.device
) -> torch.Tensor:
    """U(0, 1) float64 draws of `shape` on `device`, from `generator` wherever it lives: a CPU
    generator drives a GPU run with the same stream of numbers as a CPU run (so a seed means
    the same on both), at the cost of copying a few numbers, asynchronously."""
    u = torch.rand(shape, generator=generator, device=generator.device, dtype=torch.float64)
    return to_device(u, device)


def pick(logp: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(token) for each row.  logp [..., V], tokens [...] -> [...]."""
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


# Host <-> device. Two rules keep the host ahead of a CUDA device: host -> device copies are
# asynchronous and come from page-locked memory (a `non_blocking` copy from pageable memory may
# still wait: the driver stages it through a pinned buffer and can synchronize the stream to do
# so); device -> host reads are batched, since each waits for all the work queued before it.
# On the CPU and the meta device both are plain copies: `pin_memory` needs CUDA.


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """tensor on `device`, the host not waiting for it: itself when it is there already, else an
    asynchronous copy, from a page-locked copy of it when it goes from the host to CUDA (which
    may be dropped at once: PyTorch's pinned allocator keeps the block until the copy ran)."""
    device = torch.device(device)
    if tensor.device == device:
        return tensor
    if tensor.device.type == "cpu" and device.type == "cuda" and not tensor.is_pinned():
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def to_host(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors on the host, read back with at most one wait for the device: their bytes
    packed into one buffer, copied once and split again (bit-exact for every dtype). Those on
    the host already come back as they are; all the others must share one device."""
    away = [t for t in tensors if t.device.type != "cpu"]
    if not away:
        return tensors
    back = iter(unpack(pack(away).cpu(), away))  # the one wait
    return tuple(t if t.device.type == "cpu" else next(back) for t in tensors)


def pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors' bytes, one after another, as one flat uint8 tensor on their device."""
    return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def unpack(packed: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """`pack`'s bytes split again into tensors of like's dtypes and shapes."""
    out, start = [], 0
    for t in like:
        size = t.numel() * t.element_size()
        # a copy of its own: view(dtype) needs bytes aligned to the element size
        out.append(packed[start : start + size].clone().view(t.dtype).reshape(t.shape))
        start += size
    return out
