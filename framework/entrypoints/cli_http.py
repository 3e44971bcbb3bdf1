"""The HTTP side of ``sparrow chat`` and ``sparrow complete`` (``sparrow.entrypoints.cli_clients``):
the few requests they make to an OpenAI-compatible server, the server-sent events of a streamed
answer, and each failure as one ``CommandFailed`` line (the server's own ``error.message`` where
it sends one). Standard library only; its modules are imported when a request is made."""

from __future__ import annotations

from typing import Any, Iterator

DEFAULT_URL = "http://localhost:8000/v1"
# Seconds to wait for the server's answer to GET /models and for any byte of a streamed answer
# (a long prompt's prefill on a CPU may take minutes before the first token).
MODELS_TIMEOUT_S = 60.0
STREAM_TIMEOUT_S = 600.0


def _fail(message: str) -> Exception:
    from sparrow.entrypoints.cli_errors import CommandFailed

    return CommandFailed(message)


class Client:
    """The few requests ``chat`` and ``complete`` make, each failure one CommandFailed line."""

    def __init__(self, url: str, api_key: str | None) -> None:
        self.url = url.rstrip("/")
        self.api_key = api_key

    def _open(self, method: str, path: str, body: dict[str, Any] | None, timeout: float) -> Any:
        import http.client
        import json
        import urllib.error
        import urllib.request

        from sparrow import __version__

        headers = {"User-Agent": f"sparrow/{__version__}"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        address = self.url + path
        try:
            request = urllib.request.Request(address, data=data, headers=headers, method=method)
            return urllib.request.urlopen(request, timeout=timeout)  # noqa: S310 - the scheme is checked by --url
        except urllib.error.HTTPError as exc:
            message = _error_message(exc)
            if exc.code == 404 and message == "Not Found":  # no such route, not an OpenAI error
                message += f" (is --url the API's base URL, such as {DEFAULT_URL}?)"
            raise _fail(f"the server answered {exc.code} to {method} {address}: {message}") from None
        except urllib.error.URLError as exc:
            reason = getattr(exc.reason, "strerror", None) or exc.reason
            raise _fail(f"cannot reach the server at {self.url}: {reason}") from None
        except (OSError, ValueError, http.client.HTTPException) as exc:  # a timeout, a reset connection
            raise _fail(f"cannot reach the server at {self.url}: {exc}") from None

    def first_model(self) -> str:
        import json

        with self._open("GET", "/models", None, MODELS_TIMEOUT_S) as response:
            try:
                listing = json.loads(response.read())
                models = [entry["id"] for entry in listing["data"]]
            except (ValueError, KeyError, TypeError, OSError):
                raise _fail(f"{self.url}/models is not an OpenAI model list (is --url the API's base URL, "
                            f"such as {DEFAULT_URL}?)") from None
        if not models:
            raise _fail(f"the server at {self.url} serves no model")
        return str(models[0])

    def stream(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The JSON chunks of a streamed answer (``data: {...}`` events up to ``data: [DONE]``); a
        server that answers with one JSON object instead yields that object."""
        import http.client
        import json

        response = self._open("POST", path, {**body, "stream": True}, STREAM_TIMEOUT_S)
        with response:
            try:
                if "text/event-stream" not in (response.headers.get("Content-Type") or ""):
                    yield _whole_as_chunk(json.loads(response.read()))
                    return
                for data in sse_events(response):
                    if data == "[DONE]":
                        return
                    try:
                        chunk = json.loads(data)
                    except ValueError:
                        raise _fail(f"the server sent an event that is not JSON: {data[:200]!r}") from None
                    if isinstance(chunk, dict) and chunk.get("error"):
                        raise _fail(f"the server failed during the answer: {_message_of(chunk)}")
                    if isinstance(chunk, dict):
                        yield chunk
            except (OSError, http.client.HTTPException) as exc:
                raise _fail(f"the connection to {self.url} broke during the answer: {exc!r}") from None
            except ValueError as exc:
                raise _fail(f"the server's answer is not JSON: {exc}") from None


def sse_events(lines: Any) -> Iterator[str]:
    """The data of each server-sent event in ``lines`` (bytes lines, as an HTTP response gives
    them): ``data:`` lines, several of one event joined with newlines; comments (``:``) and the
    other fields (``event:``, ``id:``, ``retry:``) are skipped."""
    data: list[str] = []
    for raw in lines:
        line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
        if not line:
            if data:
                yield "\n".join(data)
                data = []
            continue
        field, _, value = line.partition(":")
        if field == "data":
            data.append(value[1:] if value.startswith(" ") else value)
    if data:
        yield "\n".join(data)


def _whole_as_chunk(answer: Any) -> dict[str, Any]:
    """A whole (not streamed) answer in the shape of one stream chunk."""
    if not isinstance(answer, dict):
        raise _fail(f"the server's answer is not a JSON object: {str(answer)[:200]!r}")
    choices = []
    for choice in answer.get("choices") or []:
        if isinstance(choice, dict) and "message" in choice:
            choice = {**choice, "delta": choice.get("message") or {}}
        choices.append(choice)
    return {**answer, "choices": choices}


def _message_of(body: Any) -> str:
    """The message of an error body: OpenAI's ``{"error": {"message": ...}}``, FastAPI's
    ``{"detail": ...}`` or a bare ``{"message": ...}``."""
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return one_line(str(error["message"]))
        if isinstance(error, str) and error:
            return one_line(error)
        for key in ("message", "detail"):
            if body.get(key):
                return one_line(str(body[key]))
    return one_line(str(body))


def _error_message(exc: Any) -> str:
    import http.client
    import json

    try:
        text = exc.read().decode("utf-8", errors="replace")
    except (OSError, http.client.HTTPException):
        text = ""
    try:
        return _message_of(json.loads(text))
    except ValueError:
        return one_line(text)[:500] or str(exc.reason)


def one_line(text: str) -> str:
    return " ".join(text.split()) or "(no message)"
