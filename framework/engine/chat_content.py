"""How a message's ``content`` reaches the chat template (vLLM's ``chat_template_content_format``).

OpenAI's messages carry content as a string or as a list of parts (``[{"type": "text", "text":
"..."}]``). Chat templates read one or the other: most (Qwen, Llama 3) print ``message.content``
as a string, and a list given to them would be printed as its Python repr; some iterate the parts.

* ``"string"``: a list of text parts becomes one string, the texts joined by newlines.
* ``"openai"``: a string becomes one text part, ``[{"type": "text", "text": content}]``.
* ``"auto"`` (the default): ``"openai"`` when the template iterates a message's content
  (``{% for part in message['content'] %}``, also through a ``{% set %}`` variable), found by
  walking the template's Jinja syntax tree; ``"string"`` otherwise.

Only text parts are taken: a model served by Sparrow reads text only.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

from sparrow.errors import InvalidArgumentError

CONTENT_FORMATS = ("auto", "string", "openai")
FIELD = "chat_template_content_format"


def check_content_format(value: Any) -> str:
    if value not in CONTENT_FORMATS:
        raise InvalidArgumentError(f"{FIELD} must be one of {', '.join(CONTENT_FORMATS)}, got {value!r}", FIELD)
    return value


@functools.lru_cache(maxsize=32)
def template_iterates_content(template: str) -> bool:
    """Whether ``template`` loops over a message's content (or a variable set from it)."""
    import jinja2
    from jinja2 import nodes

    try:
        tree = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError:
        return False  # rendering reports it

    def reads_content(node: Any, names: set[str]) -> bool:
        while isinstance(node, (nodes.Filter, nodes.Test)):  # message.content | list, ...
            node = node.node
        if isinstance(node, nodes.CondExpr):  # message.content if message.content is not none else ''
            return reads_content(node.expr1, names) or (node.expr2 is not None and reads_content(node.expr2, names))
        if isinstance(node, nodes.Getitem):
            return isinstance(node.arg, nodes.Const) and node.arg.value == "content"
        if isinstance(node, nodes.Getattr):
            return node.attr == "content"
        return isinstance(node, nodes.Name) and node.name in names

    content_names: set[str] = set()
    for assign in tree.find_all(nodes.Assign):
        if isinstance(assign.target, nodes.Name) and reads_content(assign.node, content_names):
            content_names.add(assign.target.name)
    return any(reads_content(loop.iter, content_names) for loop in tree.find_all(nodes.For))


def resolve_content_format(content_format: str, template: str | None) -> str:
    if content_format != "auto":
        return content_format
    return "openai" if template and template_iterates_content(template) else "string"


def shape_messages(messages: Sequence[Mapping[str, Any]], content_format: str) -> list[dict[str, Any]]:
    """Copies of ``messages`` whose content is in ``content_format`` ("string" or "openai")."""
    shaped = []
    for position, message in enumerate(messages):
        message = dict(message)
        content = message.get("content")
        if content_format == "string" and isinstance(content, Sequence) and not isinstance(content, str):
            message["content"] = "\n".join(content_texts(f"messages[{position}].content", content))
        elif content_format == "openai" and isinstance(content, str):
            message["content"] = [{"type": "text", "text": content}]
        elif isinstance(content, Sequence) and not isinstance(content, str):
            content_texts(f"messages[{position}].content", content)  # every part checked, as for "string"
        shaped.append(message)
    return shaped


def content_texts(path: str, parts: Sequence[Any]) -> list[str]:
    """The texts of a message's content parts (``path``: ``messages[i].content``)."""
    return [part_text(f"{path}[{index}]", part) for index, part in enumerate(parts)]


def part_text(where: str, part: Any) -> str:
    """The text of the content part ``where`` (``messages[i].content[j]``), or an error naming the
    part (or its ``text``) when it is not ``{"type": "text", "text": "..."}``. ``LLM.chat`` and the
    server (``request_checks.content_texts``, which also refuses the part's other keys) both check
    parts here, so that the two say the same."""
    if not isinstance(part, Mapping):
        raise InvalidArgumentError(f"{where}: a content part is an object {{'type': 'text', 'text': str}}, got "
                                   f"{type(part).__name__}", where)
    kind = part.get("type")
    if kind != "text":
        raise InvalidArgumentError(f"{where}: only text parts are supported (Sparrow serves text-only models), got "
                                   f"type {kind!r}", where, code="unsupported")
    text = part.get("text")
    if not isinstance(text, str):
        got = "it is missing" if "text" not in part else f"got {type(text).__name__}"
        raise InvalidArgumentError(f"{where}.text: a text part needs its text, a string ({got})", f"{where}.text")
    return text
