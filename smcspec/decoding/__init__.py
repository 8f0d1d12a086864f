"""Decoders: autoregressive (ar), speculative (sd) and SMC speculative (smc), one interface."""

from smcspec.decoding.autoregressive import AutoregressiveDecoder
from smcspec.decoding.base import Decoder, DecodeResult
from smcspec.decoding.smc import SMCDecoder
from smcspec.decoding.speculative import SpeculativeDecoder

__all__ = ["AutoregressiveDecoder", "DecodeResult", "Decoder", "SMCDecoder", "SpeculativeDecoder"]
