"""User settings as frozen dataclasses. Each validates itself and names the bad field."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields

RESAMPLING_SCHEMES: tuple[str, ...] = ("systematic", "multinomial", "stratified", "residual")

# The defaults are the fastest settings measured on the default pair (README, "Speed on this
# machine": sd K=4 1.44x ar; smc's best, N=2 K=8, 1.29x). Every entry point takes them from here.
SD_DRAFT_TOKENS = 4
# sd's verification rules: token by token, or the block jointly (decoding/speculative.py)
VERIFY_RULES: tuple[str, ...] = ("token", "block")
SD_VERIFY = "token"
# where sd's drafts come from: the draft model; the text itself (prompt lookup, no draft model
# step); the lookup where it finds a match, else the draft model
PROPOSALS: tuple[str, ...] = ("draft", "lookup", "lookup+draft")
SMC_PARTICLES = 2
SMC_DRAFT_TOKENS = 8
# msd is not measured yet (issue 28's sweep is): a round of msd at N = 1 is sd's, so its K is
# sd's best; N = 2 is the fewest drafts that make a tree, and smc's best N on this machine, where
# every row costs a row in each of the K draft steps and in the target pass.
MSD_PARTICLES = 2
MSD_DRAFT_TOKENS = SD_DRAFT_TOKENS
# auto's grid: the settings it weighs go up to these (a request keeps this many rows of each
# cache, the most any setting it may pick needs), and it re-chooses every this many rounds.
AUTO_MAX_PARTICLES = 4
AUTO_MAX_DRAFT_TOKENS = 8
AUTO_REDECIDE_EVERY = 4
# auto with smc (exact=False): smc only while chi^2 / N stays at or below this, where chi^2 is
# the chi-square divergence of a round's target from its proposal, estimated from the rounds'
# mean ESS / N = 1 / (1 + chi^2). The answer's bias (total variation to the exact law) grows
# as chi^2 / N: measured on toy models at 1-3 x chi^2 / N, about 2 x below 0.04
# (benchmarks/cpu/ess-floor), so 0.03 keeps it near 0.06 or under; ESS / N must then stay
# >= 0.94 at N = 2, 0.89 at N = 4.
AUTO_MAX_DIVERGENCE = 0.03
# More particles than this is more often a typo (`-n` read as tokens or choices elsewhere) than
# a plan; `allow_large` lifts the bound.
MAX_PARTICLES = 64
# OpenAI's default temperature, which its clients assume when a request gives none.
SERVER_TEMPERATURE = 1.0


class SettingError(ValueError):
    """A bad setting; `field` names it as the settings classes spell it (None: several), so
    that a front end can point at its own spelling of it (an HTTP 400's `param`)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def _require(ok: bool, message: str, field: str | None = None) -> None:
    if not ok:
        raise SettingError(message, field)


def _require_count(config: object, field: str, label: str | None = None) -> None:
    """`config.field` is an integer >= 1 (a count: tokens, particles, requests, bytes)."""
    value = getattr(config, field)
    _require(
        _is_int(value) and value >= 1,
        f"{label or field} must be an integer >= 1, got {value!r}",
        field,
    )


def _require_choice(config: object, field: str, choices: tuple[str, ...]) -> None:
    """`config.field` is one of `choices`."""
    value = getattr(config, field)
    _require(value in choices, f"{field} must be one of {', '.join(choices)}, got {value!r}", field)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI allows


@dataclass(frozen=True)
class SamplingConfig:
    """What distribution to sample: the target's next-token law after logit bias, penalties,
    temperature, top-k, top-p and min-p, in that order (see `sampling`).

    Every default here is the one `generate`, the CLI and the bench use (they read it from this
    class); the server starts from OpenAI's temperature instead (`SERVER_TEMPERATURE`).
    temperature 0 means greedy. top_k 0, top_p 1 and min_p 0 disable truncation.
    draft_temperature None means "same as temperature"; it only changes the proposal, never the
    target law. The penalties read each sequence's own tokens: repetition_penalty (Hugging
    Face's: prompt and text) divides a positive logit of a token seen and multiplies a negative
    one; presence_penalty and frequency_penalty (OpenAI's: the generated text only) subtract
    from a token's logit once if it occurs and once per occurrence. logit_bias maps token ids to
    numbers added to their logits (a dict is kept as sorted (id, bias) pairs). The draft's
    logits get the same, so sd stays exact and smc targets the adjusted law. logprobs: report
    each returned token's log-probability under that law and the top `logprobs` alternatives
    (None: none; see `decoding.logprobs`); prompt_logprobs: the same for the prompt's tokens
    (one more target pass over the prompt). Neither changes what is sampled.
    """

    temperature: float = 0.7
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 128
    stop_at_eos: bool = True
    seed: int | None = None
    draft_temperature: float | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        self._check_adjustments()
        for name in ("temperature", "draft_temperature"):  # draft_temperature may be None
            value = getattr(self, name)
            _require(
                (value is None and name != "temperature") or (_is_number(value) and value >= 0),
                f"{name} must be a finite number >= 0, got {value!r}",
                name,
            )
        _require(
            _is_int(self.top_k) and self.top_k >= 0,
            f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}",
            "top_k",
        )
        _require(
            isinstance(self.top_p, int | float) and 0 < self.top_p <= 1,
            f"top_p must be in (0, 1], got {self.top_p!r}",
            "top_p",
        )
        _require_count(self, "max_new_tokens")
        _require(
            self.seed is None or (_is_int(self.seed) and self.seed >= 0),
            f"seed must be a non-negative integer, got {self.seed!r}",
            "seed",
        )

    def _check_adjustments(self) -> None:
        _require(
            _is_number(self.min_p) and 0 <= self.min_p <= 1,
            f"min_p must be in [0, 1], got {self.min_p!r}",
            "min_p",
        )
        _require(
            _is_number(self.repetition_penalty) and self.repetition_penalty > 0,
            f"repetition_penalty must be a number > 0 (1 disables it), "
            f"got {self.repetition_penalty!r}",
            "repetition_penalty",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(
                _is_number(value) and -2 <= value <= 2,
                f"{name} must be in [-2, 2], got {value!r}",
                name,
            )
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _require(
                value is None or (_is_int(value) and 0 <= value <= MAX_LOGPROBS),
                f"{name} must be an integer in [0, {MAX_LOGPROBS}] (the top alternatives "
                f"reported beside each token's own), got {value!r}",
                name,
            )

    @property
    def proposal_temperature(self) -> float:
        """Temperature of the draft's proposal distribution q."""
        return self.temperature if self.draft_temperature is None else self.draft_temperature

    @property
    def adjusts_logits(self) -> bool:
        """Whether a logit bias or a penalty is set (they need each sequence's tokens)."""
        return bool(self.logit_bias) or (
            self.repetition_penalty != 1
            or self.presence_penalty != 0
            or self.frequency_penalty != 0
        )


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


# A token id has at most this many digits: no vocabulary comes near a billion tokens, and a key
# of thousands of digits would otherwise cost int() its time (or pass Python's digit limit).
MAX_TOKEN_ID_DIGITS = 9


def _bias_pairs(bias: object) -> tuple[tuple[int, float], ...]:
    """logit_bias as sorted (token id, bias) pairs, from a mapping (ids may be strings of ASCII
    digits, as in JSON) or pairs; each bias in [-100, 100] as in OpenAI's API. An id given twice
    (5 and "05") is refused rather than one of its biases dropped."""
    items = bias.items() if isinstance(bias, Mapping) else bias
    pairs: dict[int, float] = {}
    try:
        for key, value in items:  # type: ignore[union-attr]
            token = _token_id(key)
            _require(token not in pairs, f"logit_bias: token {token} is given twice", "logit_bias")
            _require(
                _is_number(value) and -100 <= value <= 100,
                f"logit_bias: the bias of token {token} must be in [-100, 100], got {value!r}",
                "logit_bias",
            )
            pairs[token] = float(value)
    except TypeError as err:
        raise SettingError(
            f"logit_bias must map token ids to numbers, got {bias!r}", "logit_bias"
        ) from err
    return tuple(sorted(pairs.items()))


def _token_id(key: object) -> int:
    """A logit_bias key as a token id: an integer >= 0, or a string of at most
    MAX_TOKEN_ID_DIGITS ASCII digits and nothing else (str.isdigit alone takes "²", and int()
    takes " 5" and "+5")."""
    if isinstance(key, str):
        digits = key.isascii() and key.isdigit() and len(key) <= MAX_TOKEN_ID_DIGITS
        shown = key if len(key) <= 20 else f"{key[:20]}... ({len(key)} characters)"
        _require(
            digits,
            f"logit_bias: {shown!r} is not a token id (at most {MAX_TOKEN_ID_DIGITS} ASCII digits)",
            "logit_bias",
        )
        return int(key)
    _require(_is_int(key) and key >= 0, f"logit_bias: {key!r} is not a token id", "logit_bias")
    return key  # type: ignore[return-value]


# Each front end (generate's keywords, the CLI, the server) passes these by name, so a new field
# of SamplingConfig needs no edit there.
SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingConfig))

# The KV pool of each native model when no size is given: 65,536 positions of 16-position pages.
DEFAULT_KV_PAGES = 4096


@dataclass(frozen=True)
class EngineLimits:
    """How much one `LLM` runs at once and the KV memory it holds.

    max_running: requests decoded at once (the rest wait in a queue); max_batch_tokens: tokens
    (rows x positions) one forward pass carries at most (a longer prompt is fed in pieces).
    The KV pool (native engine only; each of the target and the draft has one): `kv_pages` pages
    each, or `kv_memory`, a share in (0, 1] of the memory free on the models' device once their
    weights are loaded (as vLLM's gpu_memory_utilization; on a CPU, of the available RAM), split
    so that both pools get as many pages; neither: DEFAULT_KV_PAGES. page_size: positions per
    page. A size set here is refused at load when the pool cannot hold one sequence as long as
    the model's context.
    """

    max_running: int = 64
    max_batch_tokens: int = 256
    kv_pages: int | None = None
    kv_memory: float | None = None
    page_size: int = 16

    def __post_init__(self) -> None:
        for name in ("max_running", "max_batch_tokens", "page_size"):
            _require_count(self, name)
        _require(
            self.kv_pages is None or (_is_int(self.kv_pages) and self.kv_pages >= 1),
            f"kv_pages must be an integer >= 1, got {self.kv_pages!r}",
            "kv_pages",
        )
        _require(
            self.kv_memory is None or (_is_number(self.kv_memory) and 0 < self.kv_memory <= 1),
            f"kv_memory must be a share of the free memory in (0, 1], got {self.kv_memory!r}",
            "kv_memory",
        )
        _require(
            self.kv_pages is None or self.kv_memory is None,
            "kv_pages and kv_memory both size the KV pool: give one of them",
        )


@dataclass(frozen=True)
class HTTPLimits:
    """The HTTP server's limits. max_body_bytes: the largest request body (a 413 above it);
    shutdown_timeout: seconds running requests get to finish once a shutdown starts;
    read_timeout: seconds a client has to send a request; write_timeout: seconds a client may
    leave a response unread (once the socket buffers are full) before it is dropped."""

    max_body_bytes: int = 4 * 2**20
    shutdown_timeout: float = 5.0
    read_timeout: float = 10.0
    write_timeout: float = 60.0

    def __post_init__(self) -> None:
        _require_count(self, "max_body_bytes")
        _require(
            _is_number(self.shutdown_timeout) and self.shutdown_timeout >= 0,
            f"shutdown_timeout must be >= 0 seconds, got {self.shutdown_timeout}",
            "shutdown_timeout",
        )
        for name in ("read_timeout", "write_timeout"):
            value = getattr(self, name)
            _require(
                _is_number(value) and value > 0, f"{name} must be > 0 seconds, got {value}", name
            )


@dataclass(frozen=True)
class SDConfig:
    """Speculative decoding: K draft tokens per round, verified by rejection sampling. verify:
    "token" tests the drafts one by one (Leviathan et al.); "block" tests the block jointly
    (Sun et al., block verification), which keeps at least as many tokens in expectation.
    proposal: "draft" (the draft model), "lookup" (the tokens that followed the text's last
    n-gram, n <= lookup_ngram, where it occurred before: `decoding.lookup`), "lookup+draft"
    (the lookup where it finds one, else the draft model)."""

    draft_tokens: int = SD_DRAFT_TOKENS
    verify: str = SD_VERIFY
    proposal: str = "draft"
    lookup_ngram: int = 3

    def __post_init__(self) -> None:
        _require_count(self, "draft_tokens", "draft_tokens (K)")
        _require_choice(self, "proposal", PROPOSALS)
        _require_count(self, "lookup_ngram")
        _require_choice(self, "verify", VERIFY_RULES)


@dataclass(frozen=True)
class SMCConfig:
    """SMC speculative decoding: N particles, K draft tokens per round, resampling when
    ESS < resample_threshold x N. ESS >= 1, so at N = 2 only a threshold above 0.5 resamples."""

    particles: int = SMC_PARTICLES
    draft_tokens: int = SMC_DRAFT_TOKENS
    resample_threshold: float = 0.5
    resampling: str = "systematic"

    def __post_init__(self) -> None:
        _require_count(self, "particles", "particles (N)")
        _require_count(self, "draft_tokens", "draft_tokens (K)")
        _require(
            isinstance(self.resample_threshold, int | float) and 0 <= self.resample_threshold <= 1,
            f"resample_threshold must be in [0, 1], got {self.resample_threshold!r}",
            "resample_threshold",
        )
        _require_choice(self, "resampling", RESAMPLING_SCHEMES)


@dataclass(frozen=True)
class MSDConfig:
    """Exact multi-draft speculative decoding: N independent drafts of K tokens per round,
    verified as a token tree (SpecInfer's multi-round speculative sampling). N = 1 is sd.
    verify: "token" walks the tree token by token; "block" block-verifies one draft at a time
    and tests the others where it stops (`decoding.msd_block`). proposal: "draft" (every draft
    from the draft model); "lookup+draft" or "lookup" (alike here: the first draft is the
    text's own continuation where prompt lookup finds one, n <= lookup_ngram, tested first as a
    point mass, the others the draft model's; such a round walks token by token whatever
    `verify` says: `msd_lookup`)."""

    particles: int = MSD_PARTICLES
    draft_tokens: int = MSD_DRAFT_TOKENS
    verify: str = SD_VERIFY
    proposal: str = "draft"
    lookup_ngram: int = 3

    def __post_init__(self) -> None:
        _require_count(self, "particles", "particles (N)")
        _require_count(self, "draft_tokens", "draft_tokens (K)")
        _require_choice(self, "verify", VERIFY_RULES)
        _require_choice(self, "proposal", PROPOSALS)
        _require_count(self, "lookup_ngram")


@dataclass(frozen=True)
class ARConfig:
    """Autoregressive decoding: one target step per token, the reference the others match. It
    has no settings; its type is what picks it."""


@dataclass(frozen=True)
class AutoConfig:
    """The fastest setting, chosen per request from the machine's measured step costs and the
    draft's agreement with the target, and chosen again every `redecide_every` rounds as the
    agreement is measured (`decoding.auto`). exact: among ar, sd and msd, so the output's law is
    the target's; False: smc too, while its rounds' mean ESS / N stays >= `ess_floor(N)`. With a
    potential, smc at the N and K that decode fastest (the conditional needs smc).

    `particles` / `draft_tokens` (None: auto picks them) narrow the choice to the settings that
    have that N / K: particles to msd (and smc, where smc may run), draft_tokens to sd and msd
    (and smc); a setting a user gives is never dropped for a method that does not read it."""

    exact: bool = True
    max_particles: int = AUTO_MAX_PARTICLES
    max_draft_tokens: int = AUTO_MAX_DRAFT_TOKENS
    redecide_every: int = AUTO_REDECIDE_EVERY
    max_divergence: float = AUTO_MAX_DIVERGENCE
    particles: int | None = None
    draft_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.particles is not None:
            _require_count(self, "particles", "particles (N)")
        if self.draft_tokens is not None:
            _require_count(self, "draft_tokens", "draft_tokens (K)")
        _require(
            isinstance(self.exact, bool),
            f"exact must be true or false, got {self.exact!r}",
            "exact",
        )
        _require_count(self, "max_particles")
        _require_count(self, "max_draft_tokens")
        _require_count(self, "redecide_every")
        bound = self.max_divergence
        _require(
            isinstance(bound, int | float) and not isinstance(bound, bool) and bound >= 0,
            f"max_divergence must be a number >= 0, got {bound!r}",
            "max_divergence",
        )

    def ess_floor(self, particles: int) -> float:
        """The mean ESS / N smc's rounds must keep at N particles: chi^2 / N <= max_divergence
        with ESS / N = 1 / (1 + chi^2)."""
        return 1 / (1 + self.max_divergence * particles)

    def divergence(self, ess_fraction: float, particles: int) -> float:
        """chi^2 / N estimated from a mean ESS / N (the inverse of `ess_floor`)."""
        return (1 / ess_fraction - 1) / particles

    @property
    def most_particles(self) -> int:
        """The most rows a setting it may pick keeps: N where given, else `max_particles`."""
        return self.max_particles if self.particles is None else self.particles

    @property
    def most_draft_tokens(self) -> int:
        """The most drafts a round of a setting it may pick writes: K where given, else
        `max_draft_tokens`."""
        return self.max_draft_tokens if self.draft_tokens is None else self.draft_tokens


DecodingConfig = ARConfig | SDConfig | SMCConfig | MSDConfig | AutoConfig
