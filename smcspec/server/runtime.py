"""From HTTP requests to scheduler jobs: the server's runtime (no HTTP in here).

`Server.plan` checks a request body and turns each (prompt, sample) into a `Choice`: a checked
`engine.Request` (stop strings included) and, once submitted, its scheduler job, which streams
its text as it can no longer change. `finish` turns a job's result into the finish reason, token
count and diagnostics a response carries.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError
from dataclasses import dataclass, field
from typing import Any

from jinja2 import TemplateError

from smcspec.config import (
    SERVER_TEMPERATURE,
    HTTPLimits,
    SamplingConfig,
    SettingError,
)
from smcspec.engine import (
    LLM,
    GenerationResult,
    Request,
    configs_from_fields,
    lookahead,
    method_fields,
)
from smcspec.engine.job import Cancelled, Job
from smcspec.engine.scheduler import Scheduler
from smcspec.engine.text import check_stops
from smcspec.potentials import Potential
from smcspec.server import request_fields, schema, tools
from smcspec.server.api_error import SHUTTING_DOWN, ApiError, check_unicode
from smcspec.server.metrics import ServerMetrics
from smcspec.server.responses import Finished, ParticleText, SmcspecExtension

# No tokenizer we know packs more characters than this into a token, so a text longer than this
# many characters per position of the context cannot fit: it is refused before tokenizing.
MAX_CHARS_PER_TOKEN = 32


@dataclass(frozen=True)
class ServeDefaults:
    """Server-wide settings; each request may override the decoding ones. None: the engine's
    defaults (auto, or smc at auto's N and K for a request with a potential; each method's K).
    `http`: the HTTP server's limits (body size, timeouts); the engine's (requests at once,
    tokens a pass, the KV pool) are the LLM's, `llm.limits`.
    `api_key`: when set, every route but /health needs `Authorization: Bearer <api_key>`; it is
    kept out of the repr so that no log line can show it."""

    model_name: str
    method: str | None = None
    particles: int | None = None
    draft_tokens: int | None = None
    verify: str | None = None
    proposal: str | None = None
    lookup_ngram: int | None = None
    resample_threshold: float | None = None
    resampling: str | None = None
    approximate: bool | None = None
    temperature: float = SERVER_TEMPERATURE
    max_tokens: int = SamplingConfig.max_new_tokens
    http: HTTPLimits = field(default_factory=HTTPLimits)
    api_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        configs_from_fields(
            self.method_settings
            | {"temperature": self.temperature, "max_new_tokens": self.max_tokens}
        )
        if not isinstance(self.http, HTTPLimits):
            raise ValueError(f"http must be an HTTPLimits, got {type(self.http).__name__}")
        _check_api_key(self.api_key)

    @property
    def method_settings(self) -> dict[str, Any]:
        """The decoding settings a request falls back on, named as `configs_from_fields` reads
        them."""
        names = ("method", "approximate", *method_fields())  # None: a field it does not set
        return {name: getattr(self, name, None) for name in names}


def _check_api_key(key: str | None) -> None:
    """A key a client can send as a Bearer token (RFC 6750: visible ASCII, no spaces). The
    message never repeats the key."""
    if key is not None and not (key and key.isascii() and key.isprintable() and " " not in key):
        raise ValueError("api_key must be non-empty printable ASCII without spaces")


@dataclass
class Choice:
    """One sample being generated: its checked request and its job."""

    index: int
    plan: Request
    job: Job | None = None


class Server:
    """The runtime behind the app: the LLM, the scheduler, the metrics."""

    def __init__(self, llm: LLM, defaults: ServeDefaults) -> None:
        self.llm = llm
        self.defaults = defaults
        limits = llm.limits
        # auto's costs measured (if not cached) before the scheduler, whose thread alone may
        # run passes, and before /health says ready: any request may ask for auto
        llm.prepare()
        self.scheduler = Scheduler(
            (llm.target, llm.draft), limits.max_running, limits.max_batch_tokens
        )
        self.metrics = ServerMetrics(self.scheduler, defaults.model_name)
        llm.tuner.sharing = lambda: max(1, self.scheduler.running)
        self._limits = self._built_limits()
        self.context_length = llm.target.context_length
        self.created = int(time.time())
        self.draining = False  # set on shutdown: new requests get a 503
        self._jobs: set[Job] = set()
        self._lock = threading.Lock()

    def limits(self) -> dict[str, Any]:
        """What the server runs within, as /health reports it: the scheduler's limits, the KV
        pool as built (pages each model's pool holds, the smaller if they differ, and positions
        a page; None without a paged pool: the hf backend), the HTTP limits. Read once at start:
        none of them changes while the server runs, and /health must answer even when the
        scheduler has died."""
        return dict(self._limits)

    def _built_limits(self) -> dict[str, Any]:
        s, http = self.scheduler, self.defaults.http
        pools = [(s.capacity(i), s.page_size(i)) for i in range(len(s.models))]
        pages, size = min((p for p in pools if p[0] is not None), default=(None, None))
        return {
            "max_running": s.max_running,
            "max_batch_tokens": s.max_batch_tokens,
            "kv_pages": pages,
            "page_size": size,
            "max_body_bytes": http.max_body_bytes,
            "shutdown_timeout": http.shutdown_timeout,
            "read_timeout": http.read_timeout,
            "write_timeout": http.write_timeout,
        }

    # -- requests -> plans ------------------------------------------------------------------

    def check_model(self, model: str) -> None:
        if model != self.defaults.model_name:
            raise ApiError(
                f"unknown model {model!r}: this server serves {self.defaults.model_name!r}",
                "model",
                code="model_not_found",
            )

    def completion_prompts(self, body: schema.CompletionRequest) -> list[list[int]]:
        prompt = body.prompt
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            vocab = self.llm.target.vocab_size
            if any(not 0 <= t < vocab for t in prompt):
                raise ApiError(f"prompt token ids must lie in [0, {vocab})", "prompt")
            return [list(prompt)]
        texts = [prompt] if isinstance(prompt, str) else prompt
        request_fields.check_choices(len(texts), body.n)
        for i, text in enumerate(texts):
            param = "prompt" if isinstance(prompt, str) else f"prompt.{i}"
            check_unicode(text, param)
            self._check_fits(len(text), "prompt")
        try:
            return [self.llm.encode(t, chat=False) for t in texts]
        except ValueError as err:
            raise ApiError(str(err), "prompt") from err

    def chat_prompt(self, body: schema.ChatRequest) -> list[list[int]]:
        messages = tools.template_messages(request_fields.message_dicts(body.messages))
        self._check_fits(sum(len(m["content"] or "") for m in messages), "messages")
        shown = None
        if body.tools and body.tool_choice_value != "none":
            shown = [t.model_dump(exclude_none=True) for t in body.tools]
        try:
            return [self.llm.encode_messages(messages, tools=shown)]
        except (ValueError, TemplateError) as err:
            raise ApiError(str(err), "messages") from err

    def tool_grammar(self, body: schema.GenerationFields) -> str | None:
        """The grammar a chat request's tool_choice puts on the reply (None: none)."""
        if not isinstance(body, schema.ChatRequest) or not body.tools:
            return None
        tokenizer = self.llm.tokenizer
        special = tokenizer is not None and tools.OPEN in tokenizer.get_added_vocab()
        listed = [t.model_dump(exclude_none=True) for t in body.tools]
        parallel = body.parallel_tool_calls is not False
        return tools.grammar(listed, body.tool_choice_value, parallel, special)

    def plan(
        self, body: schema.GenerationFields, prompts: list[list[int]], param: str
    ) -> list[Choice]:
        """One checked `Request` per (prompt, sample), with its own seed."""
        for i, stop in enumerate(body.stops):
            check_unicode(stop, "stop" if isinstance(body.stop, str) else f"stop.{i}")
        try:
            stops = check_stops(body.stops)
        except ValueError as err:
            raise ApiError(str(err), "stop") from err
        potential = self._potential(body)
        # the request's own settings; the server's defaults fill in what its method reads
        fallback = self.defaults.method_settings
        fields = {name: getattr(body, name, None) for name in fallback}
        fields |= request_fields.sampling(body, self.defaults.temperature)
        try:  # every setting checked once here; per choice only the seed and length change
            decoding, sampling = configs_from_fields(fields, fallback)
        except SettingError as err:
            raise ApiError(str(err), err.field) from err
        drafts = lookahead(decoding)
        choices = []
        for p, ids in enumerate(prompts):
            limit = self._token_limit(body, len(ids), drafts, param)
            for j in range(body.n):
                seed = None if body.seed is None else body.seed + p * body.n + j
                own = dataclasses.replace(sampling, max_new_tokens=limit, seed=seed)
                try:
                    plan = self.llm.plan(ids, decoding, own, potential, stop=stops, chat=False)
                except ValueError as err:
                    raise ApiError(str(err), getattr(err, "field", None)) from err
                choices.append(Choice(len(choices), plan))
        return choices

    def _potential(self, body: schema.GenerationFields) -> Potential | None:
        """The request's potential, built once: every choice shares it (each particle gets its
        own state). A constraint's own errors name its field; the model's do not."""
        json_schema, grammar = request_fields.response_schema(body), self.tool_grammar(body)
        field = "tools" if grammar is not None else "response_format"
        try:
            if json_schema is not None or grammar is not None:
                self.llm.guidance_tokenizer()
        except ValueError as err:
            raise ApiError(str(err)) from err
        try:
            return self.llm.build_potential(
                body.power_alpha, json_schema=json_schema, grammar=grammar
            )
        except ValueError as err:
            raise ApiError(str(err), field if json_schema or grammar else None) from err

    # -- vLLM's tokenizer routes ---------------------------------------------------------------

    def tokenize(
        self, body: schema.TokenizeCompletionRequest | schema.TokenizeChatRequest
    ) -> dict[str, Any]:
        """POST /tokenize: the ids of a text, or of messages through the chat template, with the
        context length to compare them to (null when the model states none)."""
        tokenizer = self._tokenizer(body.model)
        if isinstance(body, schema.TokenizeChatRequest):
            self._check_fits(sum(len(m.text) for m in body.messages), "messages")
            text = self._templated(tokenizer, body.messages, body.add_generation_prompt)
        else:
            check_unicode(body.prompt, "prompt")
            self._check_fits(len(body.prompt), "prompt")
            text = body.prompt
        ids = tokenizer.encode(text, add_special_tokens=body.add_special_tokens)
        return {"count": len(ids), "max_model_len": self.context_length, "tokens": ids}

    def detokenize(self, body: schema.DetokenizeRequest) -> dict[str, str]:
        """POST /detokenize. Special tokens are kept, as vLLM keeps them, so that a chat
        template's markers show."""
        tokenizer = self._tokenizer(body.model)
        vocab = self.llm.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise ApiError(f"token ids must lie in [0, {vocab})", "tokens")
        return {"prompt": tokenizer.decode(body.tokens)}

    def _tokenizer(self, model: str | None) -> Any:
        if model is not None:
            self.check_model(model)
        if self.llm.tokenizer is None:
            raise ApiError("this model has no tokenizer: its prompts are token ids")
        return self.llm.tokenizer

    def _templated(
        self, tokenizer: Any, messages: list[schema.ChatMessage], add_generation: bool
    ) -> str:
        if not getattr(tokenizer, "chat_template", None):
            raise ApiError("this model has no chat template: tokenize a prompt", "messages")
        try:
            return tokenizer.apply_chat_template(
                tools.template_messages(request_fields.message_dicts(messages)),
                add_generation_prompt=add_generation,
                tokenize=False,
            )
        except (ValueError, TemplateError) as err:
            raise ApiError(str(err), "messages") from err

    def _check_fits(self, chars: int, param: str) -> None:
        """Refuse, before tokenizing it, text far longer than the context could hold."""
        ctx = self.context_length
        if ctx is not None and chars > MAX_CHARS_PER_TOKEN * ctx:
            raise ApiError(
                f"{param} has {chars} characters: more than {MAX_CHARS_PER_TOKEN} per token of "
                f"the model's context of {ctx} tokens, so it cannot fit",
                param,
            )

    def _token_limit(
        self, body: schema.GenerationFields, prompt_len: int, lookahead: int, param: str
    ):
        """max_tokens as asked, or the server default cut to the room the context leaves."""
        limit = body.token_limit
        ctx = self.context_length
        if ctx is None:
            return limit or self.defaults.max_tokens
        room = ctx - prompt_len - lookahead
        if lookahead >= ctx:  # no prompt fits: the draft tokens are what is too many
            raise ApiError(
                f"draft_tokens: {lookahead} draft tokens of lookahead fill the model's context "
                f"of {ctx}",
                "draft_tokens",
            )
        if room < 1:
            raise ApiError(
                f"the prompt has {prompt_len} tokens and the model's context holds {ctx}", param
            )
        if limit is None:
            return min(self.defaults.max_tokens, room)
        if limit > room:
            raise ApiError(
                f"max_tokens {limit} plus the prompt's {prompt_len} tokens (and {lookahead} "
                f"draft tokens of lookahead) exceed the model's context of {ctx}",
                "max_tokens",
            )
        return limit

    # -- running ----------------------------------------------------------------------------

    def submit(self, choice: Choice, on_text: Callable[[int, str], None] | None = None) -> Job:
        """Queue the choice's job; `on_text(index, delta)` gets its text as it is fixed, all of
        it before the job's future resolves."""
        emit = None if on_text is None else (lambda delta: on_text(choice.index, delta))
        if self.draining:
            raise SHUTTING_DOWN
        try:
            job = self.scheduler.submit(self.llm.job(choice.plan, on_text=emit))
        except ValueError as err:
            raise ApiError(str(err)) from err
        with self._lock:
            self._jobs.add(job)
        job.future.add_done_callback(lambda _: self._forget(job))
        choice.job = job
        return job

    def _forget(self, job: Job) -> None:
        with self._lock:
            self._jobs.discard(job)

    def cancel_all(self) -> None:
        """Cancel every job still running or queued (the end of a shutdown's grace period):
        non-streaming requests answer 503, streams end with an error event."""
        self.draining = True
        with self._lock:
            jobs = list(self._jobs)
        for job in jobs:
            job.cancel()

    def failure(self, err: BaseException) -> ApiError | None:
        """The error a client gets for a job that did not finish, if it is the server's doing."""
        if isinstance(err, Cancelled | CancelledError) and self.draining:
            return SHUTTING_DOWN
        return None

    def finish(self, result: GenerationResult, particles: bool) -> Finished:
        """The finish reason, the token count and the smcspec field of a finished choice."""
        used = len(result.token_ids)
        rounds = result.diagnostics["rounds"]
        self.metrics.record_choice(result.method, used, result.finish_reason, rounds, result.stats)
        shown = None
        if particles and result.particle_texts is not None:
            weights = result.diagnostics.get("weights", [])
            shown = [
                ParticleText(text=t, weight=finite(w))
                for t, w in zip(result.particle_texts, weights, strict=True)
            ]
        diagnostics = finite(result.diagnostics)
        extra = SmcspecExtension(method=result.method, diagnostics=diagnostics, particles=shown)
        return Finished(result.finish_reason, used, extra)

    def shutdown(self) -> None:
        self.scheduler.shutdown()


def finite(value: Any) -> Any:
    """JSON has no NaN or infinity: those become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value
