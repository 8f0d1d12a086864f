"""The user-facing entry point: a draft/target pair, a tokenizer, and `generate`.

from smcspec import LLM
llm = LLM()                                   # built-in default pair
out = llm.generate("Write a prime test.", method="smc", particles=8, draft_tokens=4)
print(out.text, out.diagnostics["tokens_per_second"])
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from smcspec.config import DecodingConfig, EngineLimits, SamplingConfig, SettingError
from smcspec.decoding import Decoder, DecodeResult, methods
from smcspec.decoding.base import Watch
from smcspec.decoding.logprobs import score_prompt
from smcspec.engine import pools, probes, timing
from smcspec.engine.job import Job
from smcspec.engine.loading import load_pair
from smcspec.engine.request import POTENTIAL_KEYWORDS, Request, build_potential
from smcspec.engine.result import GenerationResult
from smcspec.engine.scheduler import Scheduler
from smcspec.engine.text import TextStream, check_stops
from smcspec.engine.tuning import Tuner
from smcspec.grammars import llguidance_tokenizer
from smcspec.models.base import CausalLM
from smcspec.models.shared_vocab import shared
from smcspec.potentials import Potential


class LLM:
    """A target model p, a draft model q that shares its tokenizer, and the decoders over them:
    ar, sd, msd, smc, and auto, which chooses among them as it goes.

    `target` / `draft` are a hub id, a local folder, a .gguf path, or None for the built-in
    default pair; use `LLM.from_models` to plug in any `CausalLM` objects. `limits` (None:
    `EngineLimits()`, kept as `llm.limits`): the requests `generate_batch` and a server decode at
    once and the tokens of a pass on every backend; on the native engine also the KV pool's
    size (kv_pages or kv_memory, page_size). The hf backend has no paged pool: its caches grow
    with each request, and a pool size given for it is refused.
    """

    def __init__(
        self,
        target: str | None = None,
        draft: str | None = None,
        *,
        dtype: str = "auto",
        device: str = "auto",
        cache_dir: str | None = None,
        backend: str = "auto",
        enforce_eager: bool = False,
        limits: EngineLimits | None = None,
    ) -> None:
        self.limits = EngineLimits() if limits is None else limits
        pair = load_pair(
            target,
            draft,
            dtype=dtype,
            device=device,
            cache_dir=cache_dir,
            backend=backend,
            enforce_eager=enforce_eager,
            limits=self.limits,
        )
        self._setup(pair.target, pair.draft, pair.tokenizer)
        self.names, self.backend, self.dtype = pair.names, pair.backend, pair.dtype
        # auto's costs: profiled on its first choice, once per machine and pair (then cached)
        self.tuner = Tuner(lambda: probes.profile(self, cache_dir=cache_dir))

    @classmethod
    def from_models(
        cls,
        target: CausalLM,
        draft: CausalLM,
        tokenizer: Any = None,
        limits: EngineLimits | None = None,
    ) -> LLM:
        """Wrap already-built models. Without a tokenizer, prompts must be token-id lists.
        Their KV pools are built already: `limits` sets what runs at once, never a pool size."""
        limits = EngineLimits() if limits is None else limits
        if limits.kv_pages is not None or limits.kv_memory is not None:
            raise ValueError(
                "kv_pages and kv_memory size the KV pool at load; models built elsewhere bring "
                "their own pools"
            )
        llm = cls.__new__(cls)
        llm.limits = limits
        llm._setup(target, draft, tokenizer)
        llm.names = (type(target).__name__, type(draft).__name__)
        llm.backend, llm.dtype = "custom", "custom"
        # models built elsewhere have no name to cache their costs under: measured, not cached
        llm.tuner = Tuner(
            lambda: probes.measure_rounds(
                target, draft, timing.measure(target, draft), probes.profile_prompt(llm, 32)
            )
        )
        return llm

    def _setup(self, target: CausalLM, draft: CausalLM, tokenizer: Any) -> None:
        # tables padded differently over one tokenizer: both cut to the ids they share
        tokens = len(tokenizer) if hasattr(tokenizer, "__len__") else None
        target, draft = shared(target, draft, tokens)
        self.target, self.draft, self.tokenizer = target, draft, tokenizer
        self._guidance: Any = None  # llguidance's view of the tokenizer, made on first use

    def encode(self, prompt: str | list[int], chat: bool = True) -> list[int]:
        if isinstance(prompt, list):
            ids = [int(t) for t in prompt]
        elif not isinstance(prompt, str):
            raise ValueError(
                f"prompt must be a string or a list of token ids, got {type(prompt).__name__}"
            )
        elif not prompt.strip():
            raise ValueError("prompt is empty")
        elif self.tokenizer is None:
            raise ValueError("this LLM has no tokenizer: give the prompt as a list of token ids")
        elif chat and getattr(self.tokenizer, "chat_template", None):
            messages = [{"role": "user", "content": prompt}]
            ids = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
            ids = self.tokenizer.encode(ids, add_special_tokens=False)
        else:
            ids = self.tokenizer.encode(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        return ids

    def encode_messages(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Token ids of a chat (role/content dicts) through the tokenizer's chat template, ready
        for the assistant's reply; `tools` (OpenAI's function descriptions) are rendered by the
        template, as it describes them to the model."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template: use completions with a prompt")
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False
        )
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise ValueError("messages are empty")
        return ids

    def decode_text(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return " ".join(str(t) for t in ids)
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self.target.vocab_size

    def guidance_tokenizer(self) -> Any:
        """llguidance's view of the tokenizer, built once (a second for a 152k vocabulary)."""
        if self._guidance is None:
            try:
                self._guidance = llguidance_tokenizer(self.tokenizer, self.vocab_size)
            except Exception as err:  # llguidance reads byte-level (BPE) tokenizers only
                raise ValueError(
                    f"constraints need a tokenizer llguidance can read; this one fails: {err}"
                ) from err
        return self._guidance

    def generate(
        self,
        prompt: str | list[int],
        method: str | None = None,
        *,
        watch: Watch | None = None,
        **settings: Any,
    ) -> GenerationResult:
        """Generate from the target p, or from p(x) phi(x) / Z where phi is the product of the
        potentials given: `power_alpha` (p^alpha over whole sequences), `regex` / `json_schema` /
        `grammar` (Lark) constraints, `reward(text) -> float` as exp(reward_beta * r) (every
        `reward_every` tokens as a twist, else at the end), and any `potential` object. smc
        samples that target; ar applies power and constraints locally (the naive, biased way);
        sd supports none of them. The settings are those of `request`; `watch`
        sees the tokens fixed so far after every round (see `decoding.base.Watch`).

        A constraint is met or the call raises: one that
        llguidance gives up on at its first tokens (or in a JSON schema's `pattern`) is a
        ValueError before decoding; a decode all of whose sequences reach a dead end
        (llguidance gives up mid-way, or the sampling settings leave none of the tokens it
        allows) raises `potentials.ConstraintError`, a ValueError. Only a decode cut short
        returns text that does not complete it: at max_new_tokens (finish_reason "length", a
        prefix of a valid text) or at a stop string."""
        return self.run(self.request(prompt, method, **settings), watch=watch)

    def generate_batch(
        self,
        prompts: Sequence[str | list[int]],
        method: str | None = None,
        *,
        max_running: int | None = None,
        max_batch_tokens: int | None = None,
        **settings: Any,
    ) -> list[GenerationResult]:
        """`generate` for every prompt at once: the requests share batched forward passes
        (continuous batching, see `engine.scheduler`), each with the law it has alone (the
        same tokens but where a batched pass rounds differently from a lone one), and the same
        tokens from run to run (the jobs start together: `Scheduler.submit_all`).
        Results come in prompt order; with a `seed`, prompt i uses seed + i. Every request is
        checked before any runs. `max_running` / `max_batch_tokens` override `llm.limits`'s for
        this call."""
        given = {"max_running": max_running, "max_batch_tokens": max_batch_tokens}
        limits = replace(self.limits, **{k: v for k, v in given.items() if v is not None})
        seed = settings.pop("seed", None)
        requests = [
            self.request(p, method, seed=None if seed is None else seed + i, **settings)
            for i, p in enumerate(prompts)
        ]
        scheduler = Scheduler(
            (self.target, self.draft), limits.max_running, limits.max_batch_tokens
        )
        try:
            jobs = scheduler.submit_all([self.job(r) for r in requests])
            return [job.future.result() for job in jobs]
        finally:
            scheduler.shutdown()

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        method: str | None = None,
        **settings: Any,
    ) -> GenerationResult | list[GenerationResult]:
        """`generate` on a chat (OpenAI-style role/content dicts) through the chat template, as
        vLLM's `LLM.chat`; a list of chats goes through `generate_batch` and gives a list."""
        if messages and isinstance(messages[0], list):
            chats = [self.encode_messages(m) for m in messages]
            return self.generate_batch(chats, method, **settings)
        return self.generate(self.encode_messages(messages), method, **settings)

    def plan(
        self,
        prompt: str | list[int],
        decoding: DecodingConfig | None = None,
        sampling: SamplingConfig | None = None,
        potential: Potential | None = None,
        *,
        stop: str | Sequence[str] | None = None,
        chat: bool = True,
    ) -> Request:
        """Check the request and encode the prompt, loading nothing and running nothing: a
        `Request` that `run` executes. The decoding config's type picks the method
        (`ARConfig`, `SDConfig`, `MSDConfig`, `SMCConfig`, `AutoConfig`; None: `AutoConfig()`);
        None sampling takes `SamplingConfig()`'s defaults. `stop`: a string or a list of
        strings (none empty); the text ends just before the first one and decoding stops once
        it is certain. A request longer than the target's context (the prompt, the new tokens
        and a round of drafts past them, as the server counts it) is refused here, not at the
        pass that would cross it.
        auto's settings are cut to what the KV pools hold (`pools.fit_auto`: fewer particles or
        drafts, ar at the least); a request that no setting of its method fits is refused
        here, naming the pool. Bad settings raise ValueError naming the field."""
        stops = check_stops(stop)
        if decoding is None:
            decoding = methods.resolve(None).config()
        row = methods.row_of(decoding)
        if potential is not None and not row.potentials:
            raise ValueError(
                f"{row.name} targets p exactly and cannot take potentials; use "
                + " or ".join(r.name for r in methods.TABLE.values() if r.potentials)
            )
        sampling = SamplingConfig() if sampling is None else sampling
        if sampling.logit_bias and sampling.logit_bias[-1][0] >= self.vocab_size:
            raise SettingError(
                f"logit_bias: token {sampling.logit_bias[-1][0]} is outside the vocabulary "
                f"({self.vocab_size} tokens)",
                "logit_bias",
            )
        ids = self.encode(prompt, chat)
        models = (self.target, self.draft)
        has_potential = potential is not None
        decoding = pools.fit_auto(
            decoding, models, len(ids), sampling.max_new_tokens, has_potential
        )
        seed = secrets.randbits(63) if sampling.seed is None else sampling.seed
        request = Request(ids, decoding, sampling, potential, seed, stops)
        request.check_context(self.target.context_length)
        reason = pools.oversized(models, request.kv_rows(), request.max_length())
        if reason is not None:
            raise ValueError(reason)
        return request

    def request(
        self,
        prompt: str | list[int],
        method: str | None = None,
        *,
        stop: str | Sequence[str] | None = None,
        chat: bool = True,
        **settings: Any,
    ) -> Request:
        """`plan` from `generate`'s keywords: the potentials (`POTENTIAL_KEYWORDS`, which
        `build_potential` reads: `power_alpha`, `regex`, `json_schema`, `grammar`, `reward`
        with `reward_beta` and `reward_every`, `potential`) and the settings that
        `decoding.methods.configs_from_fields` reads: each method's (particles, draft_tokens,
        resample_threshold, resampling, allow_large) and every `SamplingConfig` field
        (temperature, draft_temperature, top_k, top_p, max_new_tokens, stop_at_eos, seed, ...).
        `method` None: auto (`approximate=True` lets it pick smc); `particles` / `draft_tokens`
        None: each method's own default (`smcspec.config`: sd K=4; smc N=2, K=8; msd N=2,
        K=4). More than 64 particles need `allow_large=True`."""
        check_stops(stop)  # the cheap checks first, before a constraint compiles
        asked = {k: settings.pop(k) for k in POTENTIAL_KEYWORDS if k in settings}
        potential = self.build_potential(**asked)
        try:
            decoding, sampling = methods.configs_from_fields({"method": method} | settings)
        except TypeError as err:  # an unknown keyword, named as Python names one
            name = str(err).removeprefix("unknown setting ")
            raise TypeError(f"generate() got an unexpected keyword argument {name}") from None
        return self.plan(prompt, decoding, sampling, potential, stop=stop, chat=chat)

    def run(
        self,
        request: Request,
        models: tuple[CausalLM, CausalLM] | None = None,
        watch: Watch | None = None,
        on_text: Callable[[str], None] | None = None,
    ) -> GenerationResult:
        """Decode `request`. `models` replaces (target, draft), e.g. by views that batch their
        forward passes with other requests' (see `engine.scheduler`). `on_text` gets the text
        as it can no longer change, in pieces that add up to the result's text."""
        target, draft = models if models is not None else (self.target, self.draft)
        if methods.row_of(request.decoding).chooses:
            self.prepare()
        decoder = make_decoder(request.decoding, target, draft, request.potential, self.tuner)
        text = TextStream(self.decode_text, request.stops)

        def watch_text(tokens: list[int]) -> bool:
            delta = text.update(tokens)
            if delta and on_text is not None:
                on_text(delta)
            wanted = watch is not None and watch(tokens)
            return text.stopped or wanted

        generator = torch.Generator().manual_seed(request.seed)
        result = decoder.decode(request.prompt_ids, request.sampling, generator, watch_text)
        rest = text.finish(result.tokens)
        if rest and on_text is not None:
            on_text(rest)
        out = self._package(result, request, text)
        top = request.sampling.prompt_logprobs
        if top is not None:
            # After the decoder let go of its caches: one row of the prompt's length, within the
            # pages a scheduler reserved for the job, fed in blocks no larger than its passes.
            out.prompt_logprobs = score_prompt(target, request.prompt_ids, request.sampling, top)
        return out

    def prepare(self) -> None:
        """auto's one-time work, done now rather than inside a request's time: its step costs,
        measured once per machine and pair (minutes; it says so, and how long it took) or read
        from their cache. `run` calls it before a request's clock starts, a server before it
        reports ready, so that no tokens/s counts it."""
        _ = self.tuner.costs

    def job(
        self,
        request: Request,
        watch: Watch | None = None,
        on_text: Callable[[str], None] | None = None,
    ) -> Job:
        """`request` as a scheduler job: `run` against the scheduler's batching model views. An
        auto request's costs are profiled here, before the job joins the scheduler, whose
        thread alone may run passes once it does."""
        if methods.row_of(request.decoding).chooses:
            self.prepare()
        return Job(
            lambda views: self.run(request, views, watch, on_text),
            request.kv_rows(),
            request.max_length(),
        )

    # `request.build_potential(llm, ...)` as a method: the product of the potentials asked for
    build_potential = build_potential

    def _package(
        self, result: DecodeResult, request: Request, text: TextStream
    ) -> GenerationResult:
        diagnostics: dict[str, Any] = {
            "tokens_per_second": result.tokens_per_second,
            "new_tokens": len(result.tokens),
            "prompt_tokens": len(request.prompt_ids),
            "seconds": result.seconds,
            "time_split": result.stage_seconds,
            "rounds": result.rounds,
            "seed": request.seed,
        }
        diagnostics.update(result.stats.to_dict())
        texts = None
        if result.particles is not None:
            texts = [self.decode_text(p) for p in result.particles]
        reason = self._finish_reason(result.tokens, request.sampling, text.stopped)
        tokens = result.tokens[: text.tokens_used]
        logprobs = None if result.logprobs is None else result.logprobs.cut(len(tokens))
        return GenerationResult(
            text.sent, tokens, request.method, reason, diagnostics, texts, result.stats, logprobs
        )

    def _finish_reason(self, tokens: list[int], sampling: SamplingConfig, stopped: bool) -> str:
        """OpenAI's finish reason: "stop" at EOS, a stop string or a watch's stop; "length" at
        the max_new_tokens limit."""
        ended = sampling.stop_at_eos and bool(tokens) and tokens[-1] in self.target.eos_token_ids
        if stopped or ended or len(tokens) < sampling.max_new_tokens:
            return "stop"
        return "length"


def make_decoder(
    decoding: DecodingConfig,
    target: CausalLM,
    draft: CausalLM,
    potential: Potential | None,
    tuner: Tuner | None = None,
) -> Decoder:
    """The decoder a config's type names (its row of `decoding.methods`); auto's chooses with
    `tuner`."""
    return methods.row_of(decoding).decoder(target, draft, decoding, potential, tuner)
