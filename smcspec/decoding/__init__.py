"""Decoders: autoregressive (ar), speculative (sd), SMC speculative (smc), multi-draft
speculative (msd), and auto, which chooses among them round by round; one interface."""

from smcspec.decoding.auto import AutoDecoder, AutoStats
from smcspec.decoding.autoregressive import AutoregressiveDecoder
from smcspec.decoding.base import ARStats, Decoder, DecodeResult, MSDStats, SDStats, SMCStats
from smcspec.decoding.msd import MultiDraftDecoder
from smcspec.decoding.smc import SMCDecoder
from smcspec.decoding.speculative import SpeculativeDecoder

__all__ = [
    "ARStats",
    "AutoDecoder",
    "AutoStats",
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
