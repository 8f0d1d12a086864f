"""A feed's passes and its logits: how `LlamaModel.forward_ragged` cuts a long feed into passes of
at most `llama.PREFILL_CHUNK` tokens per sequence (the transformers backend does the same), and
puts each sequence's logits back together from them."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def chunks(
    counts: list[int], num_logits: list[int], size: int
) -> list[list[tuple[int, int, int, int]]]:
    """The passes of a feed of counts[b] tokens per sequence, at most `size` per sequence each:
    pass j holds (b, start, end, want) for each sequence b with tokens [start, end) in
    [j size, (j + 1) size), `want` the logits it keeps, those of its rows among the feed's
    last num_logits[b] (always the pass's last rows)."""
    passes = []
    for start in range(0, max(counts, default=0), size):
        chunk = []
        for b, n in enumerate(counts):
            end = min(n, start + size)
            if end > start:
                first_wanted = max(start, n - num_logits[b])
                chunk.append((b, start, end, max(0, end - first_wanted)))
        passes.append(chunk)
    return passes


def joined(pieces: list[torch.Tensor], vocab: int, device: torch.device) -> torch.Tensor:
    """One sequence's logits [n, V] from its passes' pieces (no copy for a single pass)."""
    if len(pieces) == 1:
        return pieces[0]
    if not pieces:  # no token left after its sink (or none given)
        return torch.zeros(0, vocab, device=device)
    return torch.cat(pieces)


def last_rows(counts: list[int], wants: list[int]) -> torch.Tensor:
    """Flat indices of the last wants[b] of each sequence's counts[b] new tokens."""
    ends = torch.tensor(counts).cumsum(0).tolist()
    return torch.cat([torch.arange(e - m, e) for e, m in zip(ends, wants, strict=True)])


def stack_padded(rows: list[torch.Tensor], num_logits: int) -> torch.Tensor:
    """Rows [n_b, V] with n_b <= num_logits as [B, num_logits, V], zeros in the missing
    leading positions."""
    return torch.stack([F.pad(r, (0, 0, num_logits - r.shape[0], 0)) for r in rows])
