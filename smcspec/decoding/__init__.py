"""Decoders: autoregressive (ar), speculative (sd) and SMC speculative (smc), one interface."""

from smcspec.decoding.autoregressive import AutoregressiveDecoder
from smcspec.decoding.base import ARStats, Decoder, DecodeResult, SDStats, SMCStats
from smcspec.decoding.smc import SMCDecoder
from smcspec.decoding.speculative import SpeculativeDecoder

__all__ = [
    "ARStats",
    "AutoregressiveDecoder",
    "DecodeResult",
    "Decoder",
    "SDStats",
    "SMCDecoder",
    "SMCStats",
    "SpeculativeDecoder",
]
