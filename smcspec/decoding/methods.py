"""The decoding methods, one row each: the only place a method's facts are written.

A row names the method, its settings class (a frozen dataclass of `smcspec.config`; a config's
type is what picks its method), the decoder that runs it, the KV rows one request keeps in the
target's and the draft's caches, the draft tokens a round can write past the last committed one
(the room a request reserves beyond its new tokens), the tokens a round commits in expectation
at sd's acceptance probability a (what `engine.costs` prices a round by), whether it takes
potentials (samples p(x) phi(x) / Z, or applies them locally as ar does), and the settings auto
weighs for it (`candidates` over a `Grid`). The engine, the
command line, the server's schema and the benchmarks all read these rows, so a new method is one
row here plus its decoder.

`configs_from_fields` is the one converter from loose settings (a mapping of field names, as
`generate`'s keywords, the CLI's flags and an HTTP body spell them) to the typed
(`DecodingConfig`, `SamplingConfig`) pair a `Request` carries.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from smcspec.config import (
    MAX_PARTICLES,
    SAMPLING_FIELDS,
    ARConfig,
    AutoConfig,
    DecodingConfig,
    MSDConfig,
    SamplingConfig,
    SDConfig,
    SettingError,
    SMCConfig,
)
from smcspec.decoding.auto import AutoDecoder
from smcspec.decoding.auto_contract import Tuner
from smcspec.decoding.autoregressive import AutoregressiveDecoder
from smcspec.decoding.base import Decoder
from smcspec.decoding.msd import MultiDraftDecoder
from smcspec.decoding.round_tokens import msd_tokens_per_round, sd_tokens_per_round
from smcspec.decoding.smc import SMCDecoder
from smcspec.decoding.speculative import SpeculativeDecoder
from smcspec.models.base import CausalLM
from smcspec.potentials import Potential

# (target, draft, settings, potential, tuner) -> the decoder of one request; the tuner (the
# engine's `engine.tuning.Tuner`) is what auto chooses with, None where no auto runs
MakeDecoder = Callable[[CausalLM, CausalLM, Any, Potential | None, Tuner | None], Decoder]


@dataclass(frozen=True)
class Grid:
    """The values auto weighs: every K in `draft_tokens`, N in `msd_particles` for msd and in
    `smc_particles` for smc; ar and sd only where `ar` / `sd` (a request that gives K leaves ar
    out, one that gives N ar and sd too); sd also with each proposal of `lookup`. Each row's
    `grid` reads the fields it needs."""

    draft_tokens: tuple[int, ...] = tuple(range(1, 9))
    msd_particles: tuple[int, ...] = (2, 4, 8)
    smc_particles: tuple[int, ...] = (2, 4, 8)
    ar: bool = True
    sd: bool = True
    lookup: tuple[str, ...] = ()  # sd's proposals that read the text, at every K, beside sd's


def _by_n_and_k(config: type, ns: tuple[int, ...], ks: tuple[int, ...]) -> list[Any]:
    """A particle method's settings at every N of `ns` and K of `ks`, N outermost."""
    return [config(particles=n, draft_tokens=k) for n in ns for k in ks]


@dataclass(frozen=True)
class Method:
    """One decoding method. `kv_rows(config)`: the sequences a request keeps in the target's and
    the draft's KV cache; `lookahead(config)`: draft tokens a round writes past the last committed
    token; `tokens_per_round(config, a)`: the tokens a round commits in expectation at acceptance
    probability a (see `round_tokens`; None for auto, which is no one setting); `potentials`:
    whether a potential may be given (sd samples p exactly by rejection and cannot take one);
    `exact`: whether the output's law is the target's (auto's by default, `AutoConfig.exact`);
    `chooses`: whether it picks other rows' settings with the engine's tuner (auto);
    `tokens_exact`: whether `tokens_per_round` is the expectation itself (msd's is a model:
    the engine calibrates it on measured rounds); `grid(g)`: its settings auto weighs over a
    `Grid` (None: auto itself, which weighs the others); `conditional`: whether it samples
    p(x) phi(x) / Z with a potential, so that auto may run it when one is given (ar takes a
    potential but applies it token by token, a different law)."""

    name: str
    config: type
    decoder: MakeDecoder
    kv_rows: Callable[[Any], tuple[int, int]]
    lookahead: Callable[[Any], int]
    tokens_per_round: Callable[[Any, float], float] | None
    potentials: bool
    summary: str
    exact: bool
    chooses: bool = False
    tokens_exact: bool = True
    grid: Callable[[Grid], list[Any]] | None = None
    conditional: bool = False

    @property
    def settings(self) -> tuple[str, ...]:
        """The names of the method's own settings (its config's fields)."""
        return tuple(f.name for f in fields(self.config))


TABLE: dict[str, Method] = {
    row.name: row
    for row in (
        Method(
            "ar",
            ARConfig,
            lambda target, draft, config, potential, tuner: AutoregressiveDecoder(
                target, potential
            ),
            kv_rows=lambda config: (1, 0),
            lookahead=lambda config: 0,
            tokens_per_round=lambda config, a: 1.0,
            potentials=True,
            summary="autoregressive: one target step per token, the reference",
            exact=True,
            grid=lambda g: [ARConfig()] if g.ar else [],
        ),
        Method(
            "sd",
            SDConfig,
            lambda target, draft, config, potential, tuner: SpeculativeDecoder(
                target, draft, config
            ),
            kv_rows=lambda config: (1, 1),
            lookahead=lambda config: config.draft_tokens,
            tokens_per_round=lambda config, a: sd_tokens_per_round(a, config.draft_tokens),
            potentials=False,
            summary="speculative decoding: K draft tokens a round, exact by rejection sampling",
            exact=True,
            grid=lambda g: (
                [
                    SDConfig(draft_tokens=k, proposal=p)
                    for p in ("draft", *g.lookup)
                    for k in g.draft_tokens
                ]
                if g.sd
                else []
            ),
        ),
        Method(
            "smc",
            SMCConfig,
            lambda target, draft, config, potential, tuner: SMCDecoder(
                target, draft, config, potential
            ),
            kv_rows=lambda config: (config.particles, config.particles),
            lookahead=lambda config: config.draft_tokens,
            tokens_per_round=lambda config, a: config.draft_tokens + 1.0,
            potentials=True,
            summary="SMC speculative decoding: N particles of K draft tokens, weighted, resampled",
            exact=False,
            grid=lambda g: _by_n_and_k(SMCConfig, g.smc_particles, g.draft_tokens),
            conditional=True,
        ),
        Method(
            "msd",
            MSDConfig,
            lambda target, draft, config, potential, tuner: MultiDraftDecoder(
                target, draft, config
            ),
            kv_rows=lambda config: (config.particles, config.particles),
            lookahead=lambda config: config.draft_tokens,
            tokens_per_round=lambda config, a: msd_tokens_per_round(
                a, config.particles, config.draft_tokens
            ),
            potentials=False,
            summary="multi-draft speculative decoding: N drafts of K tokens a round, exact",
            exact=True,
            tokens_exact=False,
            grid=lambda g: _by_n_and_k(MSDConfig, g.msd_particles, g.draft_tokens),
        ),
        Method(
            "auto",
            AutoConfig,
            lambda target, draft, config, potential, tuner: AutoDecoder(
                target,
                draft,
                config,
                potential,
                _need(tuner),
                lambda chosen, phi: row_of(chosen).decoder(target, draft, chosen, phi, None),
            ),
            # the most any setting it may pick keeps and drafts
            kv_rows=lambda config: (config.most_particles, config.most_particles),
            lookahead=lambda config: config.most_draft_tokens,
            tokens_per_round=None,
            potentials=True,
            summary="the fastest of ar, sd and msd for this request (smc too with approximate), "
            "from measured costs, chosen again as it runs",
            exact=True,
            chooses=True,
        ),
    )
}
# None as the method: auto, which picks the fastest setting (smc's N and K with a potential).
DEFAULT = "auto"
# Settings that belong to no method's config but to how the converter reads them:
# `approximate` is `exact`'s opposite, as the CLI (--approximate) and HTTP bodies spell it.
CONVERTER_FIELDS = ("method", "allow_large", "approximate")


def _need(tuner: Tuner | None) -> Tuner:
    if tuner is None:
        raise ValueError("auto needs a tuner (the engine's, `LLM.tuner`) to choose with")
    return tuner


def method_names() -> tuple[str, ...]:
    return tuple(TABLE)


def method_row(name: str) -> Method:
    """The row of a method name; a SettingError naming the known ones otherwise."""
    if name not in TABLE:
        raise SettingError(f"method must be one of {', '.join(TABLE)}, got {name!r}", "method")
    return TABLE[name]


def row_of(decoding: DecodingConfig) -> Method:
    """The row whose settings class a config is."""
    for row in TABLE.values():
        if type(decoding) is row.config:
            return row
    known = ", ".join(row.config.__name__ for row in TABLE.values())
    raise ValueError(f"decoding must be one of {known}, got {type(decoding).__name__}")


def method_of(decoding: DecodingConfig) -> str:
    return row_of(decoding).name


def lookahead(decoding: DecodingConfig) -> int:
    return row_of(decoding).lookahead(decoding)


def kv_rows(decoding: DecodingConfig) -> tuple[int, int]:
    return row_of(decoding).kv_rows(decoding)


def resolve(method: str | None) -> Method:
    """The row of `method`; None: the default (auto, with or without a potential)."""
    return method_row(DEFAULT if method is None else method)


def candidates(
    grid: Grid = Grid(), exact: bool = True, has_potential: bool = False
) -> list[tuple[str, DecodingConfig]]:
    """auto's settings over `grid`: with a potential, the rows that sample the conditional;
    otherwise the exact rows, and where not `exact` the approximate ones too. Exact rows first,
    then table order, so that a tie goes to the simpler setting."""
    rows = [row for row in TABLE.values() if row.grid is not None]
    if has_potential:
        rows = [row for row in rows if row.conditional]
    elif exact:
        rows = [row for row in rows if row.exact]
    rows.sort(key=lambda row: not row.exact)
    return [(row.name, config) for row in rows for config in row.grid(grid)]


def method_fields() -> tuple[str, ...]:
    """Every setting a method's config has, each once, in table order."""
    names = [name for row in TABLE.values() for name in row.settings]
    return tuple(dict.fromkeys(names))


def configs_from_fields(
    given: Mapping[str, Any],
    fallback: Mapping[str, Any] | None = None,
) -> tuple[DecodingConfig, SamplingConfig]:
    """The typed settings of a mapping of fields: `method` (None: `resolve`'s default),
    `allow_large` (lifts MAX_PARTICLES), any method's settings (particles, draft_tokens,
    resample_threshold, resampling) and any `SamplingConfig` field. A None value means "not
    given": the field's own default, so one unset K is each method's own. Every method's
    settings are checked, whichever runs, so a bad value never waits for the method that reads
    it, and none is dropped: a method's setting given for a method that does not read it is a
    `SettingError` naming it and the methods that do (`_check_read`; auto reads N and K, and
    narrows its choice to them). An unknown name is a TypeError; a bad value a `SettingError`
    naming its field. `fallback` (a server's defaults, checked when it started) fills in the
    method where `given` names none, and any other setting the chosen method reads that `given`
    leaves unset; the ones it does not read are not the request's and are passed over."""
    known = set(CONVERTER_FIELDS) | set(method_fields()) | set(SAMPLING_FIELDS)
    unknown = sorted(set(given) - known)
    if unknown:
        raise TypeError(f"unknown setting {unknown[0]!r}")
    fallback = fallback or {}
    method = given.get("method")
    chosen = resolve(fallback.get("method") if method is None else method)
    _check_read(given, chosen)
    given = _with_fallback(given, fallback, chosen)
    given = _exact_of(given)
    sampling = SamplingConfig(
        **{k: v for k, v in given.items() if k in SAMPLING_FIELDS and v is not None}
    )
    configs = {
        row.name: row.config(**{k: given[k] for k in row.settings if given.get(k) is not None})
        for row in TABLE.values()
    }
    for config in configs.values():
        _check_particles(config, bool(given.get("allow_large")))
    return configs[chosen.name], sampling


def _check_read(given: Mapping[str, Any], chosen: Method) -> None:
    """Every method setting given (not None) is one the chosen method reads."""
    for name, value in given.items():
        if value is None or name in SAMPLING_FIELDS or name in ("method", "allow_large"):
            continue
        own = _own_name(name)
        if own in chosen.settings:
            continue
        readers = [row.name for row in TABLE.values() if own in row.settings]
        raise SettingError(
            f"{name} is a setting of {_listed(readers, 'and')}, not of {chosen.name}: give "
            f"method {_listed([repr(r) for r in readers], 'or')}, or leave {name} out",
            name,
        )


def _own_name(name: str) -> str:
    """A setting's name in the configs: `approximate` is auto's `exact` under its other name."""
    return "exact" if name == "approximate" else name


def _listed(words: list[str], last: str) -> str:
    """ "a", "a and b", "a, b and c"."""
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} {last} {words[-1]}"


def _with_fallback(
    given: Mapping[str, Any], fallback: Mapping[str, Any], chosen: Method
) -> dict[str, Any]:
    """given, its unset settings taken from `fallback` where the chosen method reads them."""
    out = dict(given) | {"method": chosen.name}
    for name, value in fallback.items():
        own = _own_name(name)
        if out.get(name) is None and (own in chosen.settings or own in SAMPLING_FIELDS):
            out[name] = value
    return out


def _exact_of(given: Mapping[str, Any]) -> dict[str, Any]:
    """given with `approximate` turned into `exact` (its opposite)."""
    out = dict(given)
    approximate = out.pop("approximate", None)
    if approximate is None:
        return out
    if not isinstance(approximate, bool):
        raise SettingError(f"approximate must be true or false, got {approximate!r}", "approximate")
    if out.get("exact") is not None and out["exact"] == approximate:
        raise SettingError(
            f"exact={out['exact']} and approximate={approximate} contradict each other",
            "approximate",
        )
    out["exact"] = not approximate
    return out


def _check_particles(config: Any, allow_large: bool) -> None:
    particles = getattr(config, "particles", None) or 1
    if particles > MAX_PARTICLES and not allow_large:
        raise SettingError(
            f"particles (N) must be <= {MAX_PARTICLES} unless allow_large is set "
            f"(generate --allow-large), got {particles}",
            "particles",
        )
