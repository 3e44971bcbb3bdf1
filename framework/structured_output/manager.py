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

Compiling runs in child processes (``compile_process``), driven from a thread pool, with a cache
keyed by the grammar (``grammar.grammar_key``): the same schema sent twice compiles once, and two
requests sent together share one compile. The tokenizer and the first child are built on the first
structured request, in the pool too, so an engine that never sees one pays nothing.

Two bounds keep one request's grammar from costing the others (a short regex can take xgrammar
minutes to compile and then a large part of a second per token mask):

- ``compile_timeout``: a compile that runs longer fails its request, and its child is killed;
- ``mask_budget_ms``: a grammar whose first token mask takes longer fails its request at compile
  time, and one whose masks take longer on three steps of the step loop is failed then.

A failed grammar stays in the cache, so sending it again fails at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from sparrow.sampling_params import StructuredOutputsParams
from sparrow.structured_output.compile_process import CompileTimeout, CompileWorker
from sparrow.structured_output.grammar import CPP_PREFIX, build_grammar, grammar_key

logger = logging.getLogger(__name__)

_BITS_PER_WORD = 32
_SLOW_MASKS_ALLOWED = 2  # a grammar's masks may pass the budget twice (a loaded machine); the third fails it


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

    __slots__ = ("key", "_compiled", "_matcher", "_manager", "_prompt_token_ids", "_reasoning", "_slow_masks",
                 "_failure")

    def __init__(self, key: str, compiled: Future, manager: StructuredOutputManager | None = None,
                 prompt_token_ids: list[int] | None = None) -> None:
        self.key = key
        self._compiled = compiled
        self._matcher: Any = None
        self._manager = manager
        self._prompt_token_ids = prompt_token_ids  # read once, when the matcher is built
        self._reasoning = False  # True while the model reasons: no mask, nothing fed to the matcher
        self._slow_masks = 0  # steps whose mask took longer than the manager's budget
        self._failure: str | None = None  # set when the masks cost too much (see charge_mask_time)

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
        """Why the grammar failed: its compile, or its masks' cost on the step loop; None while
        compiling or while it works."""
        if self._failure is not None:
            return self._failure
        if not self._compiled.done():
            return None
        exc = self._compiled.exception()
        return None if exc is None else str(exc)

    def error_field(self) -> str:
        """The request field a failure of this grammar names: ``structured_outputs.KIND``."""
        return f"structured_outputs.{self.key.split(':', 1)[0]}"

    def charge_mask_time(self, seconds: float, budget_seconds: float) -> bool:
        """Count one step's mask time against the budget; True when the grammar has now failed
        (its masks passed the budget on more than ``_SLOW_MASKS_ALLOWED`` steps)."""
        if seconds <= budget_seconds or self._failure is not None:
            return False
        self._slow_masks += 1
        if self._slow_masks <= _SLOW_MASKS_ALLOWED:
            return False
        self._failure = (f"{self.error_field()}: the grammar is too expensive to apply: its token mask took "
                         f"{seconds * 1000:.0f} ms on {self._slow_masks} steps, over the budget of "
                         f"{budget_seconds * 1000:g} ms (structured_outputs_mask_budget_ms)")
        return True

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
    grammars apply from the first token); ``compile_timeout`` (seconds) and ``mask_budget_ms``:
    the bounds in the module's docstring; ``trust_remote_code`` and ``tokenizer_mode``: the engine
    arguments, so the tokenizer loads as the frontend's does.
    """

    def __init__(self, tokenizer_path: str, *, vocab_size: int, stop_token_ids: list[int],
                 any_whitespace: bool = False, max_workers: int = 2, cache_size: int = 256,
                 max_num_reqs: int = 256, reasoning_parser: str | None = None,
                 compile_timeout: float = 30.0, mask_budget_ms: float = 100.0,
                 trust_remote_code: bool = False, tokenizer_mode: str = "auto") -> None:
        self.tokenizer_path = tokenizer_path
        self.trust_remote_code = trust_remote_code
        self.tokenizer_mode = tokenizer_mode
        self.compile_timeout = compile_timeout
        self.mask_budget_seconds = mask_budget_ms / 1000
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
        self._compiler_lock = threading.Lock()  # the first compile loads the tokenizer under it
        self._tokenizer_info: Any = None  # xgrammar.TokenizerInfo, built once
        self._tokenizer_info_json = ""
        self._idle_workers: list[CompileWorker] = []  # child processes waiting for a compile
        self._workers: set[CompileWorker] = set()  # every live child, idle or compiling
        self._closed = False
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
        """Runs in the pool: parse here (fast), compile in a child process, check the mask cost."""
        import xgrammar

        grammar = build_grammar(params, any_whitespace=self.any_whitespace)
        worker = self._take_worker()  # a new child imports xgrammar while the tokenizer loads
        if not worker.started:
            try:  # its errors (a reasoning parser's, say) are not the grammar's: raised as they are
                self._load_tokenizer()
            except BaseException:
                self._give_back(worker)
                raise
        try:
            if not worker.started:
                worker.start(self._tokenizer_info_json, max_threads=self._max_workers)
            data, fill_seconds = worker.compile(grammar.serialize_json(), self.compile_timeout)
        except ValueError as exc:
            self._give_back(worker)
            raise ValueError(f"structured_outputs.{params.kind} could not be compiled: "
                             f"{CPP_PREFIX.sub('', str(exc)).strip()}") from None
        except CompileTimeout:
            self._forget(worker)  # killed
            logger.warning("a %s grammar did not compile within %g s; its compile process was killed",
                           params.kind, self.compile_timeout)
            raise ValueError(f"structured_outputs.{params.kind}: the grammar did not compile within "
                             f"{self.compile_timeout:g} s (structured_outputs_compile_timeout); simplify it") from None
        except BaseException:
            self._forget(worker)
            raise
        self._give_back(worker)
        if fill_seconds > self.mask_budget_seconds:
            raise ValueError(f"structured_outputs.{params.kind}: the grammar is too expensive to apply: its first "
                             f"token mask took {fill_seconds * 1000:.0f} ms, over the budget of "
                             f"{self.mask_budget_seconds * 1000:g} ms (structured_outputs_mask_budget_ms)")
        return xgrammar.CompiledGrammar.deserialize_json(data, self._tokenizer_info)

    def _load_tokenizer(self) -> None:
        """The tokenizer's xgrammar description (and the reasoning parser), built once."""
        with self._compiler_lock:
            if self._tokenizer_info is not None:
                return
            import xgrammar

            from sparrow.engine.setup import load_tokenizer

            tokenizer = load_tokenizer(self.tokenizer_path, self.trust_remote_code, self.tokenizer_mode)
            stop_token_ids = list(self.stop_token_ids)
            if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in stop_token_ids:
                stop_token_ids.insert(0, tokenizer.eos_token_id)
            try:
                info = xgrammar.TokenizerInfo.from_huggingface(
                    tokenizer, vocab_size=self.vocab_size, stop_token_ids=stop_token_ids or None)
            except ValueError as exc:  # a Python (slow) tokenizer that is neither sentencepiece nor tiktoken
                mode = " (tokenizer_mode 'slow'; 'auto' may load a fast one)" if self.tokenizer_mode == "slow" else ""
                raise ValueError(f"structured outputs need a tokenizer xgrammar can read (a fast one, sentencepiece "
                                 f"or tiktoken), not {type(tokenizer).__name__}{mode}: {exc}") from None
            if self.reasoning_parser is not None:
                self.reasoner = _build_reasoner(self.reasoning_parser, tokenizer)
            self._tokenizer_info_json = info.serialize_json()
            self._tokenizer_info = info

    def _take_worker(self) -> CompileWorker:
        with self._lock:
            if self._closed:
                raise RuntimeError("the engine is shutting down")
            while self._idle_workers:
                worker = self._idle_workers.pop()
                if worker.alive():
                    return worker
                self._workers.discard(worker)
        worker = CompileWorker()
        with self._lock:
            self._workers.add(worker)
            closed = self._closed
        if closed:
            self._forget(worker)
            raise RuntimeError("the engine is shutting down")
        return worker

    def _give_back(self, worker: CompileWorker) -> None:
        with self._lock:
            if not self._closed:
                self._idle_workers.append(worker)
                return
        self._forget(worker)

    def _forget(self, worker: CompileWorker) -> None:
        with self._lock:
            self._workers.discard(worker)
        worker.close()

    def worker_pids(self) -> list[int]:
        """The compile processes alive now (for tests and diagnostics)."""
        with self._lock:
            return [worker.pid for worker in self._workers if worker.alive()]

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
            started = time.perf_counter()
            if drafts and drafts[index]:
                grammar.fill_with_drafts(self._bitmask, row, drafts[index])
                rows = 1 + len(drafts[index])
            else:
                grammar.fill(self._bitmask, row)
                rows = 1
            grammar.charge_mask_time(time.perf_counter() - started, self.mask_budget_seconds * rows)
            row += rows
        return self._bitmask[:num_rows].numpy().tobytes()

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle_workers = self._idle_workers, []
            busy = [worker for worker in self._workers if worker not in idle]
        for worker in idle:
            worker.close()
        for worker in busy:  # killed; the pool thread reading from it fails its request and closes it
            worker.terminate()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _build_reasoner(name: str, tokenizer: Any) -> Any:
    """The registered reasoning parser ``name``, built with the engine core's tokenizer."""
    from sparrow.plugins import get_registry, resolve_parser

    return resolve_parser("reasoning_parser", name, get_registry().reasoning_parsers)(tokenizer)
