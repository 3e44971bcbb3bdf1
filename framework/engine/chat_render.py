"""Chat messages rendered to a prompt's text with the tokenizer's (or a given) chat template, as
transformers' ``apply_chat_template`` does, every message and argument checked first: each
refusal is an ``InvalidArgumentError`` naming its field (``messages[i].content``,
``chat_template``, ``chat_template_kwargs``...). ``InputProcessor.apply_chat_template`` calls it.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

from sparrow.engine.chat_content import check_content_format, resolve_content_format, shape_messages
from sparrow.engine.text_checks import check_text
from sparrow.errors import InvalidArgumentError


def render_chat(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template: str | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    content_format: str = "auto",
    documents: Sequence[Mapping[str, str]] | None = None,
) -> str:
    """The prompt text for ``messages``: ``tools`` (JSON schemas) and every key of the messages
    (``tool_calls``, ``tool_call_id``, ``name``, ...) reach the template; ``chat_template_kwargs``
    become template variables; ``documents`` (retrieval-augmented templates) reach the template as
    its ``documents``. ``continue_final_message`` leaves the last message open for the
    model to continue. ``content_format``: vLLM's ``chat_template_content_format``
    (``sparrow.engine.chat_content``)."""
    check_content_format(content_format)
    if tokenizer is None:
        raise InvalidArgumentError("messages: chat prompts need a tokenizer, and this engine has none", "messages")
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise InvalidArgumentError("chat_template: the tokenizer has none; pass chat_template=...", "chat_template")
    if not messages:
        raise InvalidArgumentError("messages must hold at least one message", "messages")
    if add_generation_prompt and continue_final_message:
        raise InvalidArgumentError("continue_final_message cannot be combined with add_generation_prompt=True: "
                                   "the first continues the last message, the second opens a new one",
                                   "continue_final_message")
    for position, message in enumerate(messages):
        where = f"messages[{position}]"
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise InvalidArgumentError(f"{where} must be a mapping with a string 'role', got {message!r}", where)
        if "content" not in message and not message.get("tool_calls"):
            raise InvalidArgumentError(f"{where} has no 'content'", f"{where}.content")
        content = message.get("content")
        if not (content is None or isinstance(content, str)
                or (isinstance(content, Sequence) and all(isinstance(part, Mapping) for part in content))):
            raise InvalidArgumentError(f"{where}.content must be a string, a list of content parts (dicts) or "
                                       f"None, got {type(content).__name__}", f"{where}.content")
    check_text("messages", list(messages))
    check_text("chat_template", chat_template)
    check_text("tools", tools)
    check_text("chat_template_kwargs", chat_template_kwargs)
    check_text("documents", documents)
    kwargs = dict(chat_template_kwargs or {})
    reserved = sorted(set(kwargs) & reserved_template_names(tokenizer))
    if reserved:
        raise InvalidArgumentError(f"chat_template_kwargs: {', '.join(map(repr, reserved))} cannot be set here; "
                                   "they are the renderer's own arguments (use the request fields of those names)",
                                   "chat_template_kwargs")
    template = chat_template if chat_template is not None else tokenizer.chat_template
    if isinstance(template, Mapping):  # named templates: transformers renders "default"
        template = template.get("default")
    return tokenizer.apply_chat_template(
        shape_messages(messages, resolve_content_format(content_format, template)),
        tools=[dict(tool) for tool in tools] if tools else None,
        documents=[dict(document) for document in documents] if documents else None,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        chat_template=chat_template,
        tokenize=False,
        **kwargs,
    )


def reserved_template_names(tokenizer: Any) -> set[str]:
    """Names ``chat_template_kwargs`` may not use: the parameters of the tokenizer's
    ``apply_chat_template`` (tokenize, padding, ...) and the variables it sets itself."""
    parameters = inspect.signature(tokenizer.apply_chat_template).parameters
    names = {name for name, parameter in parameters.items() if parameter.kind is not parameter.VAR_KEYWORD}
    return names | {"messages", "conversation"}
