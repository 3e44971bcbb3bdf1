"""Incremental detokenization and stop strings, in the frontend (P0).

A byte-level tokenizer may put the bytes of one character in several tokens, so decoding token by
token would show broken characters. The detokenizer keeps two offsets into its token strings:

    tokens:  [ ... | prefix_offset ........ | read_offset ........ ]
                     already emitted,         not yet emitted
                     kept as context

Each step it decodes ``tokens[prefix_offset:]`` and ``tokens[prefix_offset:read_offset]``; the
difference is the new text. If the new text ends in U+FFFD (a character still missing bytes) it
waits for the next token. Only this short window is decoded, so a step costs O(1) in the length
of the output, never a decode of the whole output.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from sparrow.sampling_params import SamplingParams

# Prompt tokens kept as context for the first output token: decoders that drop a leading space
# (SentencePiece's Metaspace) must see the first output token in the middle of text, as in a decode
# of the whole sequence.
NUM_PROMPT_CONTEXT_TOKENS = 5
# Emitted tokens that stay in the window as context; older ones are dropped to bound memory.
MAX_RETAINED_TOKENS = 32
REPLACEMENT_CHAR = "\ufffd"


@dataclass(slots=True)
class TokenDecoder:
    """What every detokenizer of one tokenizer shares: built once, it reads the tokenizer's
    special and added tokens and caches single-token texts (for logprobs)."""

    tokenizer: Any
    # Ids that skip_special_tokens drops.
    special_ids: frozenset[int]
    # Ids of added tokens (special or not): decoded verbatim. A slow (Python) tokenizer separates
    # them from their neighbours by a space under spaces_between_special_tokens; a fast one (and
    # vLLM V1's detokenizer for it) never does, so the option applies to slow tokenizers only.
    added_ids: frozenset[int]
    # token strings -> text. For a fast tokenizer, its Rust decoder called directly: this runs
    # twice per token per request, and the transformers wrapper costs more than the decode.
    _tokens_to_string: Callable[[list[str]], str]
    # token id -> the token decoded on its own; filled on demand, bounded by the vocabulary.
    _single_token_texts: dict[int, str] = field(default_factory=dict)
    # Whether spaces_between_special_tokens can apply (a slow tokenizer).
    spaces_between_added: bool = False

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> TokenDecoder:
        added_tokens = tokenizer.added_tokens_decoder  # id -> AddedToken
        added_ids = frozenset(int(token_id) for token_id in added_tokens)
        # all_special_ids lists only the named ones (eos, pad, ...); reserved ids are special too.
        flagged = {int(token_id) for token_id, token in added_tokens.items() if getattr(token, "special", False)}
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and backend.decoder is not None:
            tokens_to_string = backend.decoder.decode
        else:
            tokens_to_string = tokenizer.convert_tokens_to_string
        return cls(tokenizer, frozenset(tokenizer.all_special_ids) | flagged, added_ids, tokens_to_string,
                   spaces_between_added=not getattr(tokenizer, "is_fast", False))

    def id_to_token(self, token_id: int) -> str:
        token = self.tokenizer.convert_ids_to_tokens(token_id)
        # Models often have more embedding rows than the tokenizer has ids; those decode to "".
        return token if token is not None else ""

    def tokens_to_text(self, tokens: list[str]) -> str:
        return self._tokens_to_string(tokens) if tokens else ""

    def decode_token(self, token_id: int) -> str:
        """The text of one token decoded on its own (may be U+FFFD for a partial character)."""
        text = self._single_token_texts.get(token_id)
        if text is None:
            text = self.tokens_to_text([self.id_to_token(token_id)])
            self._single_token_texts[token_id] = text
        return text


def find_stop_string(
    text: str, num_new_chars: int, stop: list[str], include_stop_str_in_output: bool
) -> tuple[str, int] | None:
    """The earliest stop string that ends within the last ``num_new_chars`` characters of
    ``text``, and the length to truncate ``text`` to; None when there is none.

    Only the tail ``num_new_chars + len(stop_str) - 1`` can hold a new match: one that ended
    earlier would have been found by an earlier call.
    """
    best: tuple[str, int] | None = None
    for stop_str in stop:
        start = max(0, len(text) - num_new_chars - len(stop_str) + 1)
        index = text.find(stop_str, start)
        if index != -1 and (best is None or index < best[1]):
            best = (stop_str, index)
    if best is None:
        return None
    stop_str, index = best
    return stop_str, index + len(stop_str) if include_stop_str_in_output else index


class IncrementalDetokenizer:
    """Turns one request's output token ids into text, a few tokens at a time.

    Called by the output processor for every ``EngineCoreOutput`` of the request: ``update``
    appends the new tokens and reports a stop string if one appeared; ``get_next_output_text``
    gives the text to show the user.
    """

    __slots__ = (
        "_decoder", "_skip_special_tokens", "_spaces_between_special_tokens", "_stop",
        "_include_stop_str_in_output", "_min_tokens", "_stop_buffer_length", "_tokens",
        "_token_is_added", "_prefix_offset", "_read_offset", "output_text", "num_output_tokens",
        "stop_string", "_num_sent_chars",
    )

    def __init__(
        self,
        decoder: TokenDecoder,
        *,
        prompt_token_ids: list[int] | None = None,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self._decoder = decoder
        self._skip_special_tokens = skip_special_tokens
        self._spaces_between_special_tokens = spaces_between_special_tokens and decoder.spaces_between_added
        self._stop = list(stop or [])
        self._include_stop_str_in_output = include_stop_str_in_output
        self._min_tokens = min_tokens
        # While streaming, the last (longest stop - 1) characters are held back: they may be the
        # start of a stop string that the user must never see.
        self._stop_buffer_length = (
            max(len(s) for s in self._stop) - 1 if self._stop and not include_stop_str_in_output else 0
        )
        # Parallel lists: token strings of the window, and whether each is an added token.
        self._tokens: list[str] = []
        self._token_is_added: list[bool] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self.output_text = ""
        self.num_output_tokens = 0
        self.stop_string: str | None = None
        # Characters of output_text already handed out in DELTA mode.
        self._num_sent_chars = 0
        self._seed_context(prompt_token_ids or [])

    @classmethod
    def from_sampling_params(
        cls, decoder: TokenDecoder, params: SamplingParams, prompt_token_ids: list[int] | None = None
    ) -> IncrementalDetokenizer:
        return cls(
            decoder,
            prompt_token_ids=prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
            stop=params.stop,  # type: ignore[arg-type]  # a list after SamplingParams.__post_init__
            include_stop_str_in_output=params.include_stop_str_in_output,
            min_tokens=params.min_tokens,
        )

    def _seed_context(self, prompt_token_ids: list[int]) -> None:
        # Context stops at the prompt's last added token: text after a chat template's
        # "<|im_start|>" must not gain the separator space that belongs to the prompt.
        context: list[str] = []
        for token_id in reversed(prompt_token_ids[-NUM_PROMPT_CONTEXT_TOKENS:]):
            if token_id in self._decoder.added_ids:
                break
            context.append(self._decoder.id_to_token(token_id))
        context.reverse()
        self._tokens.extend(context)
        self._token_is_added.extend([False] * len(context))
        self._read_offset = len(context)

    # -- decoding ---------------------------------------------------------------------------
    def _window_text(self, start: int, end: int) -> str:
        flags = self._token_is_added[start:end]
        if not any(flags):
            return self._decoder.tokens_to_text(self._tokens[start:end])
        # Added tokens are kept verbatim; the runs of ordinary tokens between them are decoded.
        pieces: list[str] = []
        run: list[str] = []
        for token, is_added in zip(self._tokens[start:end], flags):
            if not is_added:
                run.append(token)
                continue
            if run:
                pieces.append(self._decoder.tokens_to_text(run))
                run = []
            pieces.append(token)
        if run:
            pieces.append(self._decoder.tokens_to_text(run))
        return (" " if self._spaces_between_special_tokens else "").join(pieces)

    def _emit_ready_text(self, flush: bool) -> None:
        if self._read_offset == len(self._tokens):
            return
        prefix_text = self._window_text(self._prefix_offset, self._read_offset)
        window_text = self._window_text(self._prefix_offset, len(self._tokens))
        if not flush and (len(window_text) <= len(prefix_text) or window_text.endswith(REPLACEMENT_CHAR)):
            return  # a character is still missing bytes (or the new tokens decode to nothing yet)
        self.output_text += window_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        if self._prefix_offset > MAX_RETAINED_TOKENS:
            del self._tokens[: self._prefix_offset]
            del self._token_is_added[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0

    def update(self, new_token_ids: list[int], *, finished: bool = False, stop_terminated: bool = False) -> str | None:
        """Append output tokens; return the stop string they completed, or None.

        ``stop_terminated``: the engine core stopped the request on the last of these tokens (EOS
        or a stop token id); that token is not shown unless include_stop_str_in_output.
        ``finished``: no more tokens will come, so text waiting for missing bytes is released.
        After a stop string, later calls do nothing.
        """
        if self.stop_string is not None:
            return None
        self.num_output_tokens += len(new_token_ids)
        if stop_terminated and new_token_ids and not self._include_stop_str_in_output:
            new_token_ids = new_token_ids[:-1]
        text_length_before = len(self.output_text)
        decoder = self._decoder
        for token_id in new_token_ids:
            if self._skip_special_tokens and token_id in decoder.special_ids:
                continue
            self._tokens.append(decoder.id_to_token(token_id))
            self._token_is_added.append(token_id in decoder.added_ids)
            self._emit_ready_text(flush=False)
        if finished or stop_terminated:
            self._emit_ready_text(flush=True)

        num_new_chars = len(self.output_text) - text_length_before
        # Like EOS, stop strings only count once min_tokens tokens have been generated.
        if not self._stop or num_new_chars == 0 or self.num_output_tokens <= self._min_tokens:
            return None
        match = find_stop_string(self.output_text, num_new_chars, self._stop, self._include_stop_str_in_output)
        if match is None:
            return None
        self.stop_string, truncate_to = match
        self.output_text = self.output_text[:truncate_to]
        return self.stop_string

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to show: all of it, or (``delta``) what was not shown before.

        Until the request finishes, the stop-string buffer at the end is held back.
        """
        finished = finished or self.stop_string is not None
        length = len(self.output_text) if finished else max(0, len(self.output_text) - self._stop_buffer_length)
        if not delta:
            return self.output_text[:length]
        if length <= self._num_sent_chars:
            return ""
        text = self.output_text[self._num_sent_chars:length]
        self._num_sent_chars = length
        return text
