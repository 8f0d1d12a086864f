"""Request bodies, decoded with their work bounded before it starts.

`json.loads` and pydantic's validation hold the GIL, and so the event loop, for as long as they
run: 4 MiB of numbers took 0.2 s to decode on a 2-core CPU, and a million wrong items seconds to
validate. So, before anything is decoded, the JSON values of a body are counted and a body
with more than `max_values` is refused (a prompt of token ids may fill the context; nothing else
in a request comes near); Python's own limits (nesting, digits in a number) are 400s; and the
large collections of the schema stop at their first bad item. What is left holds the GIL for a
few milliseconds a body (4 MB of text: ~5 ms to decode).
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from smcspec.server.api_error import ApiError

MAX_DEPTH = 64  # levels of arrays and objects; OpenAI's strict schemas nest 10 objects at most
SPARE_VALUES = 2**15  # values a request holds besides its prompt's token ids, at the most
UNKNOWN_CONTEXT = 2**17  # the token ids allowed when the model states no context length
_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"', re.DOTALL)
_MARKS = (b",", b"[", b"{")
NUMPY_BYTES = 2**16


class BodyReader:
    """Decodes and validates the bodies of one server's requests (called in worker threads)."""

    def __init__(self, context_length: int | None) -> None:
        self.max_values = (context_length or UNKNOWN_CONTEXT) + SPARE_VALUES

    def parse(self, raw: bytes, model: type[BaseModel] | Callable[[Any], type[BaseModel]]) -> Any:
        """The body validated as `model`, or as the model `model(data)` picks for its JSON."""
        data = self.load(raw)
        return validate(model if isinstance(model, type) else model(data), data)

    def load(self, raw: bytes) -> Any:
        """The JSON body. Bytes that are not UTF-8 become lone surrogates, which the runtime
        refuses naming the field they are in."""
        if count_values(raw, self.max_values) > self.max_values:
            raise ApiError(
                f"the request body holds more than {self.max_values} JSON values: a prompt of "
                "token ids may fill the model's context, and nothing else needs as many"
            )
        try:
            data = json.loads(raw.decode("utf-8", "surrogateescape"))
        except json.JSONDecodeError as err:
            error = {"type": "json_invalid", "loc": ("body", err.pos), "ctx": {"error": err.msg}}
            raise RequestValidationError([{**error, "msg": "JSON decode error"}]) from err
        except RecursionError as err:
            raise _too_deep(None) from err
        except ValueError as err:  # an integer past Python's limit on digits
            digits = sys.get_int_max_str_digits()
            raise ApiError(f"malformed JSON body: a number has more than {digits} digits") from err
        fields = data.items() if isinstance(data, dict) else [(None, data)]
        for name, value in fields:
            if nests_past(value, MAX_DEPTH - (name is not None)):
                raise _too_deep(name)
        return data


def validate(model: type[BaseModel], data: Any) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise RequestValidationError(err.errors(include_url=False)) from err


def count_values(raw: bytes, limit: int) -> int:
    """An upper bound on the values in the JSON text `raw`, exact to within its containers (one
    more for each): every value after a container's first follows a comma and every container
    opens with a bracket. Brackets and commas inside strings count too, so when that passes
    `limit` the strings are skipped one by one (a regex each, the GIL free between them) until
    the count passes `limit` for sure."""
    count = 1 + _marks(raw, 0, len(raw))
    if count <= limit:
        return count
    count, start = 1, 0
    for string in _STRING.finditer(raw):
        count += _marks(raw, start, string.start())
        if count > limit:
            return count
        start = string.end()
    return count + _marks(raw, start, len(raw))


def _marks(raw: bytes, start: int, end: int) -> int:
    """Commas and opening brackets in raw[start:end]. bytes.count holds the GIL (10 ms for 4 MB
    on a busy 2-core CPU), numpy lets go of it but costs microseconds a call: numpy for long
    spans, bytes.count for the short ones between strings."""
    if end - start < NUMPY_BYTES:
        return sum(raw.count(mark, start, end) for mark in _MARKS)
    window = np.frombuffer(raw, np.uint8, end - start, start)
    hits = window == _MARKS[0][0]
    for mark in _MARKS[1:]:
        hits |= window == mark[0]
    return int(np.count_nonzero(hits))


def nests_past(value: Any, limit: int) -> bool:
    """Whether arrays and objects in `value` nest more than `limit` levels deep (a container is
    one level). Level by level, without recursion."""
    level, frontier = 0, [value]
    while frontier:
        containers = [v for v in frontier if isinstance(v, list | dict)]
        if not containers:
            return False
        level += 1
        if level > limit:
            return True
        frontier = [x for c in containers for x in (c.values() if isinstance(c, dict) else c)]
    return False


def _too_deep(field: str | None) -> ApiError:
    where = "the JSON body" if field is None else field
    return ApiError(f"{where} nests arrays and objects deeper than {MAX_DEPTH} levels", field)
