"""The stored responses of ``/v1/responses`` (``store: true``, the default), their input items as
``GET /v1/responses/{id}/input_items`` lists them, and that route's query parameters.

``ResponseStore`` keeps, in memory, gone with the server:

    finished responses    the last ``MAX_STORED_RESPONSES`` to finish, the oldest dropped first
    background responses  while queued or in progress: never dropped (their task would lose its
                          response); at most ``MAX_RUNNING_BACKGROUND`` at once, another is a 429.
                          Once finished they count among the finished ones, as the newest.

so it holds at most ``MAX_STORED_RESPONSES + MAX_RUNNING_BACKGROUND`` responses. Each holds its
conversation's text, which fit the model's context: about ``max_model_len`` tokens of text, a few
times over (the response, its conversation, its input items, a background stream's events).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from sparrow.entrypoints.openai.protocol_responses import ResponsesRequest
from sparrow.entrypoints.openai.responses_output import new_id
from sparrow.entrypoints.openai.serving_engine import APIError

MAX_STORED_RESPONSES = 256
MAX_RUNNING_BACKGROUND = 256
RUNNING = ("queued", "in_progress")
# input_items' limit: OpenAI's bounds and default.
MIN_LIMIT, MAX_LIMIT, DEFAULT_LIMIT = 1, 100, 20
# The id prefix of an input item the client sent without one.
ITEM_ID_PREFIXES = {"message": "msg", "reasoning": "rs", "function_call": "fc", "function_call_output": "fco"}
_INTEGER = re.compile(r"-?\d{1,19}")
_BOOLEANS = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}


@dataclass(slots=True)
class StoredResponse:
    body: dict[str, Any]  # the response as it was served, or a background one as it is now
    # Its conversation as chat messages, without instructions, its reply (with its tool calls)
    # last; None while there is no reply to continue from (running, failed, cancelled).
    turns: list[dict[str, Any]] | None
    input_items: list[dict[str, Any]] = field(default_factory=list)  # as input_items lists them
    run: Any = None  # a background response's responses_background.BackgroundRun

    @property
    def running(self) -> bool:
        return self.body["status"] in RUNNING


class ResponseStore:
    """Stored responses by id (see the module's docstring). The event loop is its only user: no lock."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES) -> None:
        self.capacity = capacity
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def get(self, response_id: str) -> StoredResponse | None:
        return self._responses.get(response_id)

    def put(self, response_id: str, stored: StoredResponse) -> None:
        """Store (or, for a background response that just finished, store again) as the newest."""
        self._responses[response_id] = stored
        self._responses.move_to_end(response_id)
        finished = [key for key, entry in self._responses.items() if not entry.running]
        for key in finished[:max(0, len(finished) - self.capacity)]:
            del self._responses[key]

    def delete(self, response_id: str) -> bool:
        return self._responses.pop(response_id, None) is not None


def not_found(response_id: str) -> APIError:
    return APIError(404, f"No response found with id {response_id!r} (the server keeps the last "
                    f"{MAX_STORED_RESPONSES} responses created with store true, until it restarts)", "NotFoundError",
                    param="response_id", code="response_not_found")


def bad_param(name: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, f"{name}: {message}", "BadRequestError", param=name, code=code)


# -- input items ----------------------------------------------------------------------------
def input_items_of(request: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's ``input`` as OpenAI lists it: one item per input item, each with an ``id``
    (the client's, else a new one) and a ``status``; a message's content as a list of parts."""
    if isinstance(request.input, str):
        return [{"id": new_id("msg"), "type": "message", "role": "user", "status": "completed",
                 "content": [{"type": "input_text", "text": request.input}]}]
    items: list[dict[str, Any]] = []
    seen: set[str] = set()
    for item in request.input:
        kind = item.type or "message"
        body = item.model_dump(mode="json", exclude_none=True)
        item_id = item.id if item.id and item.id not in seen else new_id(ITEM_ID_PREFIXES[kind])
        seen.add(item_id)
        body.update(id=item_id, type=kind, status=item.status or "completed")
        if kind == "message":
            text_type = "output_text" if item.role == "assistant" else "input_text"
            parts = [{"type": text_type, "text": item.content}] if isinstance(item.content, str) else item.content
            body["content"] = [{"annotations": [], **part} if part.get("type") == "output_text" else part
                               for part in parts or []]
        elif kind == "reasoning":
            body.setdefault("summary", [])
        items.append(body)
    return items


def list_input_items(items: list[dict[str, Any]], *, limit: str | None, order: str | None, after: str | None,
                     include: list[str]) -> dict[str, Any]:
    """OpenAI's list object for one page of ``items`` (query parameters as the client sent them)."""
    count = query_int("limit", limit, DEFAULT_LIMIT)
    if not MIN_LIMIT <= count <= MAX_LIMIT:
        raise bad_param("limit", f"from {MIN_LIMIT} to {MAX_LIMIT}, got {count}")
    if order not in (None, "asc", "desc"):
        raise bad_param("order", f'"asc" or "desc", got {order!r}')
    if include:
        raise bad_param("include", f"{include[0]!r} is not supported: input items are listed whole, with every "
                                   "field this server keeps", code="unsupported")
    ordered = items if order == "asc" else items[::-1]  # OpenAI's default: desc, the newest first
    start = 0
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise bad_param("after", f"no input item of this response has id {after!r}")
        start = ids.index(after) + 1
    page = ordered[start:start + count]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": start + count < len(ordered)}


# -- query parameters, parsed here so that a bad one is a 400 naming it -------------------------
def query_int(name: str, value: str | None, default: int) -> int:
    if value is None:
        return default
    if not _INTEGER.fullmatch(value.strip()):
        raise bad_param(name, f"an integer, got {value!r}")
    return int(value)


def query_bool(name: str, value: str | None) -> bool:
    if value is None:
        return False
    if value.strip().lower() not in _BOOLEANS:
        raise bad_param(name, f"true or false, got {value!r}")
    return _BOOLEANS[value.strip().lower()]
