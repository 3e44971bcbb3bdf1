"""Logprob containers (vLLM's ``vllm.logprobs``): ``Logprob``, and ``FlatLogprobs`` for
``SamplingParams(flat_logprobs=True)``.

By default a request's logprobs are a list with one ``{token_id: Logprob}`` dict per position:
a request asking for 20 logprobs over 1,000 tokens keeps 21,000 ``Logprob`` objects and 1,000
dicts alive, which the garbage collector walks again and again. ``FlatLogprobs`` keeps the same
figures in six flat lists (position starts and ends, token ids, logprobs, ranks, decoded texts)
and reads as the list of dicts it replaces: ``len``, iteration, ``[i]`` (a dict, built on
access), slices (a ``FlatLogprobs``) and ``+``. A position without logprobs (the first prompt
position, ``None`` in the list form) reads as an empty dict. It cannot be changed in place except
by appending.

The frontend fills either form from the engine core's per-position entries with
:func:`append_logprobs`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, overload

if TYPE_CHECKING:
    from sparrow.engine.detokenizer import TokenDecoder
    from sparrow.worker.outputs import TokenLogprobs

__all__ = ["FlatLogprobs", "Logprob", "PromptLogprobs", "SampleLogprobs", "append_logprobs", "convert_logprobs"]


@dataclass(slots=True)
class Logprob:
    """The log probability of one token at one position.

    ``rank`` is 1-based in the full distribution; ``decoded_token`` is the token decoded on its
    own (None when detokenization is off).
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class FlatLogprobs(Sequence[dict[int, Logprob]]):
    """Positions of ``{token_id: Logprob}`` kept as flat lists (see the module docstring)."""

    __slots__ = ("start_indices", "end_indices", "token_ids", "logprobs", "ranks", "decoded_tokens")

    def __init__(self, positions: Iterable[dict[int, Logprob] | None] = ()) -> None:
        self.start_indices: list[int] = []
        self.end_indices: list[int] = []
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.ranks: list[int | None] = []
        self.decoded_tokens: list[str | None] = []
        for position in positions:
            self.append(position)

    def append(self, position: dict[int, Logprob] | None) -> None:
        """Add one position given as the list form's dict (or None: no logprobs there)."""
        if not position:
            self.append_position((), (), (), ())
            return
        self.append_position(list(position), [entry.logprob for entry in position.values()],
                             [entry.rank for entry in position.values()],
                             [entry.decoded_token for entry in position.values()])

    def append_position(self, token_ids: Sequence[int], logprobs: Sequence[float], ranks: Sequence[int | None],
                        decoded_tokens: Sequence[str | None]) -> None:
        """Add one position from parallel sequences; a token id repeated within the position
        (the sampled token, also among the top-k) is kept once, at its first place."""
        self.start_indices.append(len(self.token_ids))
        seen: set[int] = set()
        for token_id, logprob, rank, decoded in zip(token_ids, logprobs, ranks, decoded_tokens):
            if token_id in seen:
                continue
            seen.add(token_id)
            self.token_ids.append(token_id)
            self.logprobs.append(logprob)
            self.ranks.append(rank)
            self.decoded_tokens.append(decoded)
        self.end_indices.append(len(self.token_ids))

    def extend(self, positions: Iterable[dict[int, Logprob] | None]) -> None:
        if isinstance(positions, FlatLogprobs):
            for index in range(len(positions)):
                start, end = positions.start_indices[index], positions.end_indices[index]
                self.append_position(positions.token_ids[start:end], positions.logprobs[start:end],
                                     positions.ranks[start:end], positions.decoded_tokens[start:end])
            return
        for position in positions:
            self.append(position)

    def __len__(self) -> int:
        return len(self.start_indices)

    @overload
    def __getitem__(self, index: int) -> dict[int, Logprob]: ...

    @overload
    def __getitem__(self, index: slice) -> FlatLogprobs: ...

    def __getitem__(self, index: int | slice) -> dict[int, Logprob] | FlatLogprobs:
        if isinstance(index, slice):
            part = FlatLogprobs()
            for position in range(*index.indices(len(self))):
                start, end = self.start_indices[position], self.end_indices[position]
                part.append_position(self.token_ids[start:end], self.logprobs[start:end], self.ranks[start:end],
                                     self.decoded_tokens[start:end])
            return part
        if not isinstance(index, int):
            raise TypeError(f"FlatLogprobs indices must be integers or slices, not {type(index).__name__}")
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError("FlatLogprobs index out of range")
        return {self.token_ids[i]: Logprob(self.logprobs[i], self.ranks[i], self.decoded_tokens[i])
                for i in range(self.start_indices[index], self.end_indices[index])}

    def __iter__(self) -> Iterator[dict[int, Logprob]]:
        for position in range(len(self)):
            yield self[position]

    def __add__(self, other: Any) -> FlatLogprobs:
        if not isinstance(other, (FlatLogprobs, list)):
            return NotImplemented
        joined = self[:]
        joined.extend(other)
        return joined

    def __radd__(self, other: Any) -> FlatLogprobs:
        if not isinstance(other, list):
            return NotImplemented
        joined = FlatLogprobs(other)
        joined.extend(self)
        return joined

    def __eq__(self, other: object) -> bool:
        """Equal to a FlatLogprobs or list form with the same positions (None and {} alike)."""
        if not isinstance(other, (FlatLogprobs, list)) or len(other) != len(self):
            return False
        return all(mine == (theirs or {}) for mine, theirs in zip(self, other))

    __hash__ = None  # type: ignore[assignment]  # mutable (appendable), as a list

    def __repr__(self) -> str:
        return f"FlatLogprobs({list(self)!r})"


# One dict per position: token id -> Logprob, the chosen (or prompt) token first, then the top-k;
# or the same positions in a FlatLogprobs (SamplingParams.flat_logprobs).
SampleLogprobs = list[dict[int, Logprob]] | FlatLogprobs
# Position 0 is None (an empty dict in a FlatLogprobs): the first prompt token has no context to
# be predicted from.
PromptLogprobs = list[dict[int, Logprob] | None] | FlatLogprobs


# -- the engine core's entries -> these containers (the frontend's output processor) ---------------
def convert_logprobs(entry: TokenLogprobs, decoder: TokenDecoder | None) -> dict[int, Logprob]:
    """One position's TokenLogprobs (chosen token first, then top-k) -> {token_id: Logprob}.

    The chosen token keeps the first slot: if it is also among the top-k, its entry is the same.
    """
    return {
        token_id: Logprob(logprob, rank, decoder.decode_token(token_id) if decoder is not None else None)
        for token_id, logprob, rank in zip(entry.token_ids, entry.logprobs, entry.ranks)
    }


def append_logprobs(positions: SampleLogprobs | PromptLogprobs | FlatLogprobs, entry: TokenLogprobs,
                    decoder: TokenDecoder | None) -> None:
    """One more position, into the list form or straight into a FlatLogprobs (no dict built)."""
    if isinstance(positions, FlatLogprobs):
        decoded = [decoder.decode_token(token_id) if decoder is not None else None for token_id in entry.token_ids]
        positions.append_position(entry.token_ids, entry.logprobs, entry.ranks, decoded)
    else:
        positions.append(convert_logprobs(entry, decoder))
