"""`sampling.dense_bias`, a memo, field by field: the bias pairs, the vocabulary size, the dtype
and the device each give another vector; the same arguments give the kept one back."""

import pytest
import torch

from smcspec import sampling

PAIRS = ((1, 2.0), (3, -1.0))
ARGS = {"pairs": PAIRS, "vocab": 5, "dtype": torch.float32, "device": torch.device("cpu")}
CHANGES = {
    "pairs": {"pairs": ((1, 2.0), (3, -1.5))},
    "another token": {"pairs": ((1, 2.0), (4, -1.0))},
    "vocab": {"vocab": 6},
    "dtype": {"dtype": torch.float64},
    "device": {"device": torch.device("meta")},
}


def _written_out(pairs, vocab, dtype):
    return torch.tensor([dict(pairs).get(i, 0.0) for i in range(vocab)], dtype=dtype)


@pytest.mark.parametrize("change", list(CHANGES))
def test_the_dense_bias_memo_is_keyed_by_each_argument(change):
    kept = sampling.dense_bias(**ARGS)
    assert sampling.dense_bias(**ARGS) is kept  # the memo's hit: nothing else changes it
    assert torch.equal(kept, _written_out(PAIRS, 5, torch.float32))
    args = {**ARGS, **CHANGES[change]}
    other = sampling.dense_bias(**args)
    assert other is not kept
    assert (other.shape, other.dtype, other.device) == (
        (args["vocab"],),
        args["dtype"],
        args["device"],
    )
    if other.device.type == "cpu":
        assert torch.equal(other, _written_out(args["pairs"], args["vocab"], args["dtype"]))
