"""Decoders: autoregressive (ar), speculative (sd), SMC speculative (smc) and multi-draft
speculative (msd), one interface."""

from smcspec.decoding.autoregressive import AutoregressiveDecoder
from smcspec.decoding.base import ARStats, Decoder, DecodeResult, MSDStats, SDStats, SMCStats
from smcspec.decoding.msd import MultiDraftDecoder
from smcspec.decoding.smc import SMCDecoder
from smcspec.decoding.speculative import SpeculativeDecoder

__all__ = [
    "ARStats",
    "AutoregressiveDecoder",
    "DecodeResult",
    "Decoder",
    "MSDStats",
    "MultiDraftDecoder",
    "SDStats",
    "SMCDecoder",
    "SMCStats",
    "SpeculativeDecoder",
]
