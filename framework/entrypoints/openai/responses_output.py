"""A response's output items, built as its text is generated, and the stream's events on the way.

One ``OutputBuilder`` per response is fed every engine output: each delta of a stream, or the whole
text of a full response at once. Both go through the same ``feed``, so a stream's deltas add up to
what the full response returns. With a reasoning parser (the engine's ``reasoning_parser``) the
text is split first, as the chat endpoint splits it:

    reasoning text  -> ReasoningItem  (output_index 0)    only when there is reasoning text
    the answer      -> OutputMessage  (output_index 0|1)  when there is answer text, or nothing at
                                                          all (an empty message)
    tool calls      -> FunctionCallItem, one per call, after them

Each item opens and closes with OpenAI's events, in this order:

    response.output_item.added     the item, in_progress, without content
    response.content_part.added    an empty output_text (reasoning_text) part
    response.output_text.delta     per piece of text (response.reasoning_text.delta)
    response.output_text.done      the whole text    (response.reasoning_text.done)
    response.content_part.done     the whole part
    response.output_item.done      the whole item

With tools (``tools``: the chat endpoint's ``ChoiceStream`` for the request's tool_choice) the
answer goes through its tool parser, as on the chat endpoint; a function call item's events are

    response.output_item.added               the item, in_progress, with empty arguments
    response.function_call_arguments.delta   per piece of its arguments
    response.function_call_arguments.done    the whole arguments
    response.output_item.done                the whole item

A reasoning parser yields all reasoning before the answer, and a tool parser all answer text
before the calls, which come one after another, so an item never reopens.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any

from sparrow.entrypoints.openai.protocol import DeltaToolCall
from sparrow.entrypoints.openai.protocol_responses import (
    FunctionCallItem,
    OutputMessage,
    OutputText,
    ReasoningItem,
    ReasoningText,
)
from sparrow.entrypoints.openai.serving_engine import logprob_entry
from sparrow.outputs import CompletionOutput

Event = dict[str, Any]  # an event without its sequence_number (EventSequence numbers it)
Item = ReasoningItem | OutputMessage | FunctionCallItem


def new_id(prefix: str) -> str:
    """OpenAI's id shape: ``resp_...``, ``msg_...``, ``rs_...``, ``fc_...``, ``call_...``."""
    return f"{prefix}_{uuid.uuid4().hex}"


class EventSequence:
    """Server-sent events with OpenAI's framing (``event:`` then ``data:``), numbered from 0."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def sse(self, event: Event) -> str:
        numbered = {"type": event["type"], "sequence_number": self.sequence_number,
                    **{key: value for key, value in event.items() if key != "type"}}
        self.sequence_number += 1
        return f"event: {event['type']}\ndata: {json.dumps(numbered)}\n\n"


class OutputBuilder:
    """``reasoner``: the reasoning parser, or None; ``top_logprobs``: with
    include ["message.output_text.logprobs"], how many alternatives each answer token lists (None:
    no logprobs); ``as_token_ids``: label tokens ``token_id:N`` (--return-tokens-as-token-ids);
    ``tools``: the chat endpoint's ``ChoiceStream`` that finds the tool calls in the answer, or None."""

    def __init__(self, prompt_token_ids: Sequence[int], *, reasoner: Any = None, tokenizer: Any = None,
                 top_logprobs: int | None = None, as_token_ids: bool = False, tools: Any = None) -> None:
        self._reasoner = reasoner
        self._tools = tools
        self.calls: list[FunctionCallItem] = []
        self._split = reasoner.new_stream(prompt_token_ids) if reasoner is not None else None
        self._tokenizer = tokenizer
        self._top_logprobs = top_logprobs
        self._as_token_ids = as_token_ids
        self.reasoning = ""
        self.answer = ""
        self.token_ids: list[int] = []
        self._reasoning_end: int | None = None  # index in token_ids of the token that ended the reasoning
        self._logprobs: list[dict[str, Any]] = []  # one entry per generated token
        self._released = 0  # entries of _logprobs already sent with a delta (or skipped as reasoning)
        self.reasoning_id = new_id("rs")
        self.message_id = new_id("msg")
        self._reasoning_status: str | None = None  # None: no reasoning item; else in_progress, completed...
        self._message_status: str | None = None  # None: no message item yet

    # -- feeding -------------------------------------------------------------------------------
    def feed(self, completion: CompletionOutput) -> list[Event]:
        """The events for the next piece of output (the whole of it, for a full response)."""
        start = len(self.token_ids)
        self.token_ids += completion.token_ids
        if self._reasoner is not None and self._reasoning_end is None:
            for offset, token_id in enumerate(completion.token_ids):
                if self._reasoner.ends_reasoning(token_id):
                    self._reasoning_end = start + offset
                    break
        if self._top_logprobs is not None and completion.logprobs is not None:
            self._logprobs += [logprob_entry(token_id, position, self._top_logprobs, self._tokenizer,
                                             self._as_token_ids)
                               for token_id, position in zip(completion.token_ids, completion.logprobs)]
        if self._split is None:
            return self._pieces("", completion.text)
        piece = self._split.feed(completion.text)
        return self._pieces(piece.reasoning, piece.content)

    def close(self, incomplete: bool) -> list[Event]:
        """The events that end the output (``incomplete``: the length limit ended it)."""
        piece = self._split.finish() if self._split is not None else None
        events = self._pieces(piece.reasoning if piece else "", piece.content if piece else "", final=True)
        status = "incomplete" if incomplete else "completed"
        if self._reasoning_status == "in_progress":
            events += self._close_reasoning(status)
        if self._message_status is None and self._reasoning_status is None and not self.calls:
            events += self._open_message()  # an empty answer is still a message
        if self._message_status == "in_progress":
            rest = self._release_logprobs()
            if rest:  # logprobs of tokens that added no text (the end-of-sequence token)
                events.append(self._delta("", rest))
            events += self._close_message(status)
        if self.calls and self.calls[-1].status == "in_progress":
            events += self._close_call(status)
        return events

    # -- the result ----------------------------------------------------------------------------
    def items(self) -> list[Item]:
        items: list[Item] = []
        if self._reasoning_status is not None:
            items.append(self._reasoning())
        if self._message_status is not None:
            items.append(self._message())
        return [*items, *self.calls]

    def turn(self) -> dict[str, Any]:
        """The reply as a chat message, for the stored conversation."""
        reply: dict[str, Any] = {"role": "assistant", "content": self.answer if self.answer or not self.calls else None}
        if self.reasoning:
            reply["reasoning_content"] = self.reasoning
        if self.calls:
            reply["tool_calls"] = [{"id": call.call_id, "type": "function",
                                    "function": {"name": call.name, "arguments": call.arguments}}
                                   for call in self.calls]
        return reply

    @property
    def reasoning_tokens(self) -> int:
        """The generated tokens that were reasoning: through the token that ended it."""
        if self._split is None or not self._split.saw_reasoning:
            return 0
        return len(self.token_ids) if self._reasoning_end is None else self._reasoning_end + 1

    # -- items ---------------------------------------------------------------------------------
    @property
    def _message_index(self) -> int:
        return 0 if self._reasoning_status is None else 1

    def _part(self) -> OutputText:
        # The logprobs sent with its deltas: not those of tool calls after it.
        logprobs = self._logprobs[self.reasoning_tokens:self._released] if self._top_logprobs is not None else None
        return OutputText(text=self.answer, logprobs=logprobs)

    def _message(self) -> OutputMessage:
        return OutputMessage(id=self.message_id, status=self._message_status or "in_progress", content=[self._part()])

    def _reasoning(self) -> ReasoningItem:
        return ReasoningItem(id=self.reasoning_id, content=[ReasoningText(text=self.reasoning)],
                             status=self._reasoning_status or "in_progress")

    # -- events --------------------------------------------------------------------------------
    def _pieces(self, reasoning: str, answer: str, final: bool = False) -> list[Event]:
        events: list[Event] = []
        calls: list[DeltaToolCall] = []
        if self._tools is not None and (answer or final):  # (a named call opens with the first answer text)
            delta = self._tools.feed(answer, final)
            answer, calls = (delta.content or "", delta.tool_calls or []) if delta is not None else ("", [])
        if reasoning and self._message_status is None and not self.calls:
            if self._reasoning_status is None:
                self._reasoning_status = "in_progress"
                events += [{"type": "response.output_item.added", "output_index": 0,
                            "item": ReasoningItem(id=self.reasoning_id, content=[],
                                                  status="in_progress").model_dump(mode="json")},
                           {"type": "response.content_part.added", "item_id": self.reasoning_id, "output_index": 0,
                            "content_index": 0, "part": ReasoningText(text="").model_dump(mode="json")}]
            self.reasoning += reasoning
            events.append({"type": "response.reasoning_text.delta", "item_id": self.reasoning_id, "output_index": 0,
                           "content_index": 0, "delta": reasoning})
        if answer and not self.calls:  # (a tool parser sends all answer text before the calls)
            if self._reasoning_status == "in_progress":
                events += self._close_reasoning("completed")
            if self._message_status is None:
                events += self._open_message()
            self.answer += answer
            events.append(self._delta(answer, self._release_logprobs()))
        for call in calls:
            events += self._call_piece(call)
        return events

    def _call_piece(self, call: DeltaToolCall) -> list[Event]:
        """A call's first piece (its name) opens its item; every piece may add arguments."""
        events: list[Event] = []
        function = call.function
        assert function is not None, "the chat endpoint's tool-call deltas always carry their function"
        if call.index >= len(self.calls):
            if self._reasoning_status == "in_progress":
                events += self._close_reasoning("completed")
            if self._message_status == "in_progress":
                events += self._close_message("completed")
            if self.calls and self.calls[-1].status == "in_progress":
                events += self._close_call("completed")
            item = FunctionCallItem(id=new_id("fc"), call_id=new_id("call"), name=function.name or "",
                                    arguments="", status="in_progress")
            self.calls.append(item)
            events.append({"type": "response.output_item.added", "output_index": self._call_index(item),
                           "item": item.model_dump(mode="json")})
        item = self.calls[call.index]
        if function.arguments:
            item.arguments += function.arguments
            events.append({"type": "response.function_call_arguments.delta", "item_id": item.id,
                           "output_index": self._call_index(item), "delta": function.arguments})
        return events

    def _call_index(self, item: FunctionCallItem) -> int:
        return (self._reasoning_status is not None) + (self._message_status is not None) + self.calls.index(item)

    def _close_call(self, status: str) -> list[Event]:
        item = self.calls[-1]
        item.status = status
        where = {"item_id": item.id, "output_index": self._call_index(item)}
        return [{"type": "response.function_call_arguments.done", **where, "arguments": item.arguments},
                {"type": "response.output_item.done", "output_index": where["output_index"],
                 "item": item.model_dump(mode="json")}]

    def _close_message(self, status: str) -> list[Event]:
        self._message_status = status
        part = self._part().model_dump(mode="json")
        where = {"item_id": self.message_id, "output_index": self._message_index, "content_index": 0}
        return [{"type": "response.output_text.done", **where, "text": self.answer, "logprobs": part["logprobs"] or []},
                {"type": "response.content_part.done", **where, "part": part},
                {"type": "response.output_item.done", "output_index": self._message_index,
                 "item": self._message().model_dump(mode="json")}]

    def _close_reasoning(self, status: str) -> list[Event]:
        self._reasoning_status = status
        part = ReasoningText(text=self.reasoning).model_dump(mode="json")
        where = {"item_id": self.reasoning_id, "output_index": 0, "content_index": 0}
        return [{"type": "response.reasoning_text.done", **where, "text": self.reasoning},
                {"type": "response.content_part.done", **where, "part": part},
                {"type": "response.output_item.done", "output_index": 0,
                 "item": self._reasoning().model_dump(mode="json")}]

    def _open_message(self) -> list[Event]:
        self._message_status = "in_progress"
        empty = OutputText(text="", logprobs=[]).model_dump(mode="json")
        return [{"type": "response.output_item.added", "output_index": self._message_index,
                 "item": OutputMessage(id=self.message_id, status="in_progress", content=[]).model_dump(mode="json")},
                {"type": "response.content_part.added", "item_id": self.message_id,
                 "output_index": self._message_index, "content_index": 0, "part": empty}]

    def _delta(self, text: str, logprobs: list[dict[str, Any]]) -> Event:
        return {"type": "response.output_text.delta", "item_id": self.message_id, "output_index": self._message_index,
                "content_index": 0, "delta": text, "logprobs": logprobs}

    def _release_logprobs(self) -> list[dict[str, Any]]:
        """The logprobs of the answer tokens generated since the last delta."""
        start = max(self._released, self.reasoning_tokens)
        self._released = max(start, len(self._logprobs))
        return self._logprobs[start:self._released]
