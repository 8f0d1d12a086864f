"""smcspec: Sequential Monte Carlo speculative decoding (SMC-SD), with exact SD and AR baselines."""

from smcspec.config import ARConfig, AutoConfig, MSDConfig, SamplingConfig, SDConfig, SMCConfig
from smcspec.engine import LLM, GenerationResult

__all__ = [
    "LLM",
    "ARConfig",
    "AutoConfig",
    "GenerationResult",
    "MSDConfig",
    "SDConfig",
    "SMCConfig",
    "SamplingConfig",
]
__version__ = "0.1.0"
