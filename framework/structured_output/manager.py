"""The engine core's side of structured outputs: compile grammars off the step loop, keep one
matcher per request, and fill the step's token bitmask.

Shape of one step (``EngineCore.step``)::

    schedule()                      requests still compiling (WAITING_FOR_GRAMMAR) are skipped
    fill_bitmask(scheduled rows)    one pass: one int32 row per constrained request that samples,
                                    plus one per draft it verifies (speculative decoding)
    execute_model(...)              the sampler masks those rows (sparrow.sample.sampler), the
                                    verification the draft positions (sparrow.spec_decode.worker)
    update_from_output(...)         the scheduler feeds each accepted token to the matcher, then
                                    keeps of the new drafts the prefix the grammar accepts

Compiling runs in a thread pool (xgrammar releases the GIL while it compiles), with a cache keyed
by the grammar (``grammar.grammar_key``): the same schema sent twice compiles once, and two
requests sent together share one compile. The tokenizer and the compiler are built on the first
structured request, in the pool too, so an engine that never sees one pays nothing.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from sparrow.sampling_params import StructuredOutputsParams
from sparrow.structured_output.grammar import build_grammar, grammar_key

logger = logging.getLogger(__name__)

_BITS_PER_WORD = 32


class StructuredOutputRequest:
    """One request's grammar: its compile (a shared future) and, once compiled, its own matcher.

    The scheduler sees it as ``request.structured_output`` and calls only :meth:`is_ready`,
    :meth:`accept_tokens`, :meth:`is_terminated` and, for drafts, :meth:`validate_tokens`. A
    resumed request (preempted and recomputed) keeps its matcher: recomputing rebuilds KV for
    tokens the matcher has already accepted, and no token is sampled twice, so nothing rolls
    back (drafts are looked ahead over and undone at once, never left in the matcher).

    With a reasoning parser the grammar constrains the answer only: until the token that ends
    the reasoning is sampled (or from the start, when the prompt already ended it), every token
    is allowed and none is fed to the matcher. That state lives here too, so it survives
    preemption like the matcher's.
    """

    __slots__ = ("key", "_compiled", "_matcher", "_manager", "_prompt_token_ids", "_reasoning")

    def __init__(self, key: str, compiled: Future, manager: StructuredOutputManager | None = None,
                 prompt_token_ids: list[int] | None = None) -> None:
        self.key = key
        self._compiled = compiled
        self._matcher: Any = None
        self._manager = manager
        self._prompt_token_ids = prompt_token_ids  # read once, when the matcher is built
        self._reasoning = False  # True while the model reasons: no mask, nothing fed to the matcher

    def is_ready(self) -> bool:
        """True once the grammar compiled (the matcher is then built); False while compiling or
        when compiling failed (the engine core fails the request, see :meth:`error`)."""
        if self._matcher is not None:
            return True
        if not self._compiled.done() or self._compiled.exception() is not None:
            return False
        import xgrammar

        self._matcher = xgrammar.GrammarMatcher(self._compiled.result())
        # The compile loaded the tokenizer, so the reasoning parser exists by now.
        reasoner = self._manager.reasoner if self._manager is not None else None
        if reasoner is not None:
            self._reasoning = not reasoner.reasoning_ended(self._prompt_token_ids or [])
        self._prompt_token_ids = None
        return True

    def done(self) -> bool:
        return self._compiled.done()

    def error(self) -> str | None:
        """Why compiling failed, once it has; None while compiling or after a success."""
        if not self._compiled.done():
            return None
        exc = self._compiled.exception()
        return None if exc is None else str(exc)

    @property
    def reasoning(self) -> bool:
        """Whether the model is still reasoning (the grammar does not apply yet)."""
        return self._reasoning

    def accept_tokens(self, request_id: str, token_ids: list[int]) -> bool:
        return all(self._feed(token_id) is not None for token_id in token_ids)

    def _feed(self, token_id: int) -> int | None:
        """Advance over one token: 1 when the matcher took it, 0 when the reasoning did (nothing
        to roll back), None when the grammar rejects it (the state is then unchanged)."""
        if self._reasoning:
            # The end token itself is the reasoning's; the grammar starts with the next one.
            self._reasoning = not self._manager.reasoner.ends_reasoning(token_id)
            return 0
        return 1 if self._matcher.accept_token(token_id) else None

    # -- speculative decoding: look ahead over drafts, then put the state back ---------------
    # xgrammar's matcher rolls back any number of accepted tokens (0.2: unlimited history), so
    # the drafts are walked on the request's own matcher and undone; the reasoning flag, which
    # lives here, is saved and restored around the walk.
    def validate_tokens(self, token_ids: list[int]) -> list[int]:
        """The longest prefix of ``token_ids`` (drafts) the grammar accepts from its current
        state. A draft after one that ends the grammar is never accepted. State unchanged."""
        reasoning, fed, kept = self._reasoning, 0, 0
        try:
            for token_id in token_ids:
                step = self._feed(token_id)
                if step is None:
                    break
                fed += step
                kept += 1
        finally:
            self._undo(reasoning, fed)
        return token_ids[:kept]

    def fill_with_drafts(self, bitmask: Any, row: int, drafts: list[int]) -> None:
        """Rows ``row .. row + len(drafts)`` of ``bitmask``: the mask of the token after the
        request's tokens, then of the token after each draft in turn, as if the drafts before
        it had been accepted (verification samples position j only when drafts 1..j were).
        Past a draft the grammar rejects (the scheduler keeps only ``validate_tokens``' prefix,
        so this is a safeguard) or one that ends the grammar, the rows allow every token: the
        previous row's mask forbids that draft, or the request ends there, so verification never
        uses them. State unchanged."""
        self.fill(bitmask, row)
        reasoning, fed, usable = self._reasoning, 0, True
        try:
            for offset, token_id in enumerate(drafts, start=1):
                step = self._feed(token_id) if usable else None
                if step is None or (not self._reasoning and self._matcher.is_terminated()):
                    usable = False
                    bitmask[row + offset].fill_(-1)
                    fed += step or 0
                    continue
                fed += step
                self.fill(bitmask, row + offset)
        finally:
            self._undo(reasoning, fed)

    def _undo(self, reasoning: bool, fed: int) -> None:
        if fed:
            self._matcher.rollback(fed)
        self._reasoning = reasoning

    def is_terminated(self) -> bool:
        return not self._reasoning and self._matcher.is_terminated()

    def fill(self, bitmask: Any, row: int) -> None:
        if self._reasoning:
            bitmask[row].fill_(-1)  # every bit set: any token
        else:
            self._matcher.fill_next_token_bitmask(bitmask, row)


class StructuredOutputManager:
    """Owned by the engine core: the compile pool, the compiled-grammar cache and the bitmask.

    ``tokenizer_path``: loaded on first use; ``vocab_size``: the logits' width (the model's, which
    may exceed the tokenizer's: the extra ids are never allowed); ``stop_token_ids``: the ids a
    grammar may end with (EOS and the generation config's); ``any_whitespace``: let JSON grammars
    put any whitespace between tokens (off: compact JSON only); ``reasoning_parser``: the name
    of a registered reasoning parser, whose end-of-reasoning token starts each grammar (None:
    grammars apply from the first token).
    """

    def __init__(self, tokenizer_path: str, *, vocab_size: int, stop_token_ids: list[int],
                 any_whitespace: bool = False, max_workers: int = 2, cache_size: int = 256,
                 max_num_reqs: int = 256, reasoning_parser: str | None = None) -> None:
        self.tokenizer_path = tokenizer_path
        self.reasoning_parser = reasoning_parser
        self.reasoner: Any = None  # the reasoning parser, built with the compiler
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self.any_whitespace = any_whitespace
        self.cache_size = cache_size
        self.max_num_reqs = max_num_reqs
        self.num_words = -(-vocab_size // _BITS_PER_WORD)
        self._pool: ThreadPoolExecutor | None = None
        self._max_workers = max_workers
        self._lock = threading.Lock()  # guards the cache; never held while compiling
        self._compiler_lock = threading.Lock()  # the first compile builds the compiler under it
        self._compiler: Any = None
        self._cache: OrderedDict[str, Future] = OrderedDict()  # grammar key -> compiled grammar
        self._bitmask: Any = None  # int32 [max_num_reqs, num_words], reused every step

    # -- compiling --------------------------------------------------------------------------
    def new_request(self, params: StructuredOutputsParams,
                    prompt_token_ids: list[int] | None = None) -> StructuredOutputRequest:
        """Start compiling ``params``' grammar (or reuse the cached compile); never blocks.
        ``prompt_token_ids`` tell a reasoning parser whether the prompt already ended the reasoning."""
        key = grammar_key(params)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is None:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self._max_workers, thread_name_prefix="GrammarCompile")
                compiled = self._pool.submit(self._compile, params)
                self._cache[key] = compiled
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
        return StructuredOutputRequest(key, compiled, self, prompt_token_ids)

    def _compile(self, params: StructuredOutputsParams) -> Any:
        grammar = build_grammar(params, any_whitespace=self.any_whitespace)
        return self._get_compiler().compile_grammar(grammar)

    def _get_compiler(self) -> Any:
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar

                from sparrow.engine.setup import load_tokenizer

                tokenizer = load_tokenizer(self.tokenizer_path)
                stop_token_ids = list(self.stop_token_ids)
                if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in stop_token_ids:
                    stop_token_ids.insert(0, tokenizer.eos_token_id)
                info = xgrammar.TokenizerInfo.from_huggingface(
                    tokenizer, vocab_size=self.vocab_size, stop_token_ids=stop_token_ids or None)
                if self.reasoning_parser is not None:
                    self.reasoner = _build_reasoner(self.reasoning_parser, tokenizer)
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=self._max_workers)
            return self._compiler

    # -- every step -------------------------------------------------------------------------
    def fill_bitmask(self, grammars: list[StructuredOutputRequest],
                     drafts: list[list[int]] | None = None) -> bytes:
        """The allowed-token bitmask of ``grammars`` (ready ones), in this order, as the bytes
        ``SchedulerOutput.grammar_bitmask`` carries: one int32 row per grammar, or with
        ``drafts`` (each grammar's scheduled draft tokens) ``1 + len(drafts[i])`` rows for
        grammar i, one per position the step verifies (``fill_with_drafts``)."""
        import xgrammar

        num_rows = len(grammars) + (sum(map(len, drafts)) if drafts else 0)
        if self._bitmask is None or self._bitmask.shape[0] < num_rows:
            self._bitmask = xgrammar.allocate_token_bitmask(max(self.max_num_reqs, num_rows), self.vocab_size)
        row = 0
        for index, grammar in enumerate(grammars):
            if drafts and drafts[index]:
                grammar.fill_with_drafts(self._bitmask, row, drafts[index])
                row += 1 + len(drafts[index])
            else:
                grammar.fill(self._bitmask, row)
                row += 1
        return self._bitmask[:num_rows].numpy().tobytes()

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _build_reasoner(name: str, tokenizer: Any) -> Any:
    """The registered reasoning parser ``name``, built with the engine core's tokenizer."""
    from sparrow.plugins import get_registry, resolve_parser

    return resolve_parser("reasoning_parser", name, get_registry().reasoning_parsers)(tokenizer)
