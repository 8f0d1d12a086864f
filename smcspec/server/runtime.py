"""From HTTP requests to scheduler jobs: the server's runtime (no HTTP in here).

`Server.plan` checks a request body and turns each (prompt, sample) into a `Choice`: a checked
`engine.Request` (stop strings included) and, once submitted, its scheduler job, which streams
its text as it can no longer change. `finish` turns a job's result into the finish reason, token
count and diagnostics a response carries.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from smcspec.config import (
    SamplingConfig,
    check_method,
    lookahead,
    method_configs,
    resolve_method,
)
from smcspec.engine import LLM, GenerationResult, Request
from smcspec.engine.scheduler import Job, Scheduler
from smcspec.engine.text import check_stops
from smcspec.server.metrics import ServerMetrics
from smcspec.server.schema import ChatRequest, CompletionRequest, GenerationFields


class ApiError(Exception):
    """An error the client gets as an OpenAI-style JSON body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code=None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


@dataclass(frozen=True)
class ServeDefaults:
    """Server-wide settings; each request may override the decoding ones. None: the engine's
    defaults (`smcspec.config`: sd, or smc for a request with a potential; each method's K)."""

    model_name: str
    method: str | None = None
    particles: int | None = None
    draft_tokens: int | None = None
    resample_threshold: float = 0.5
    resampling: str = "systematic"
    temperature: float = 1.0
    max_tokens: int = 128
    max_running: int = 64
    max_batch_tokens: int = 256

    def __post_init__(self) -> None:
        if self.method is not None:
            check_method(self.method)
        method_configs(self.particles, self.draft_tokens, self.resample_threshold, self.resampling)
        SamplingConfig(temperature=self.temperature, max_new_tokens=self.max_tokens)
        for name in ("max_running", "max_batch_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


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
        self.scheduler = Scheduler(
            (llm.target, llm.draft), defaults.max_running, defaults.max_batch_tokens
        )
        self.metrics = ServerMetrics(self.scheduler, defaults.model_name)
        self.context_length = getattr(llm.target, "context_length", None)
        self.created = int(time.time())

    # -- requests -> plans ------------------------------------------------------------------

    def check_model(self, model: str) -> None:
        if model != self.defaults.model_name:
            raise ApiError(
                f"unknown model {model!r}: this server serves {self.defaults.model_name!r}",
                "model",
                code="model_not_found",
            )

    def completion_prompts(self, body: CompletionRequest) -> list[list[int]]:
        prompt = body.prompt
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            vocab = self.llm.target.vocab_size
            if any(not 0 <= t < vocab for t in prompt):
                raise ApiError(f"prompt token ids must lie in [0, {vocab})", "prompt")
            return [list(prompt)]
        texts = [prompt] if isinstance(prompt, str) else prompt
        try:
            return [self.llm.encode(t, chat=False) for t in texts]
        except ValueError as err:
            raise ApiError(str(err), "prompt") from err

    def chat_prompt(self, body: ChatRequest) -> list[list[int]]:
        messages = [{"role": m.role, "content": m.text} for m in body.messages]
        try:
            return [self.llm.encode_messages(messages)]
        except ValueError as err:
            raise ApiError(str(err), "messages") from err

    def plan(self, body: GenerationFields, prompts: list[list[int]], param: str) -> list[Choice]:
        """One checked `Request` per (prompt, sample), with its own seed."""
        d = self.defaults
        particles = body.particles or d.particles
        k = body.draft_tokens or d.draft_tokens
        try:
            stops = check_stops(body.stops)
        except ValueError as err:
            raise ApiError(str(err), "stop") from err
        try:  # built once: every choice shares it (each particle gets its own state)
            potential = self.llm.build_potential(body.power_alpha, json_schema=_schema(body))
        except ValueError as err:
            raise ApiError(str(err)) from err
        method = resolve_method(body.method or d.method, potential is not None)
        drafts = lookahead(method, *method_configs(particles, k))
        choices = []
        for p, ids in enumerate(prompts):
            limit = self._token_limit(body, len(ids), drafts, param)
            for j in range(body.n):
                seed = None if body.seed is None else body.seed + p * body.n + j
                try:
                    plan = self.llm.plan(
                        ids,
                        method,
                        particles=particles,
                        draft_tokens=k,
                        resample_threshold=_given(body.resample_threshold, d.resample_threshold),
                        resampling=body.resampling or d.resampling,
                        temperature=_given(body.temperature, d.temperature),
                        draft_temperature=body.draft_temperature,
                        top_k=body.top_k or 0,
                        top_p=_given(body.top_p, 1.0),
                        max_new_tokens=limit,
                        stop_at_eos=not body.ignore_eos,
                        stop=stops,
                        seed=seed,
                        chat=False,
                        potential=potential,
                    )
                except ValueError as err:
                    raise ApiError(str(err)) from err
                choices.append(Choice(len(choices), plan))
        return choices

    def _token_limit(self, body: GenerationFields, prompt_len: int, lookahead: int, param: str):
        """max_tokens as asked, or the server default cut to the room the context leaves."""
        limit = body.token_limit
        ctx = self.context_length
        if ctx is None:
            return limit or self.defaults.max_tokens
        room = ctx - prompt_len - lookahead
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
        try:
            choice.job = self.scheduler.submit(self.llm.job(choice.plan, on_text=emit))
        except ValueError as err:
            raise ApiError(str(err)) from err
        return choice.job

    def finish(self, result: GenerationResult, particles: bool) -> dict:
        """The finish reason, the token count and the diagnostics of a finished choice."""
        used = len(result.token_ids)
        self.metrics.record_choice(result.method, used, result.finish_reason, result.diagnostics)
        extra: dict[str, Any] = {"method": result.method, "diagnostics": result.diagnostics}
        if particles and result.particle_texts is not None:
            weights = result.diagnostics.get("weights", [])
            extra["particles"] = [
                {"text": t, "weight": w}
                for t, w in zip(result.particle_texts, weights, strict=True)
            ]
        return {"reason": result.finish_reason, "tokens": used, "smcspec": finite(extra)}

    def shutdown(self) -> None:
        self.scheduler.shutdown()


def result_of(future) -> GenerationResult:
    """The result of a finished job's future (asyncio or concurrent), bad input as ApiError."""
    err = future.exception()
    if err is None:
        return future.result()
    if isinstance(err, ValueError):
        raise ApiError(str(err)) from err
    raise err


def _given(value, default):
    return default if value is None else value


def _schema(body: GenerationFields) -> str | None:
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return json.dumps({"type": "object"})
    return json.dumps(fmt.json_schema.schema_)


def finite(value: Any) -> Any:
    """JSON has no NaN or infinity: those become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value
