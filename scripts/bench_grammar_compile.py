"""Grammar compile times of the engine core's StructuredOutputManager (docs/benchmarks.md,
"Structured outputs"): the first request (tokenizer + compile process start), cold and cached
compiles of common grammars, and the two bounds (mask budget, compile timeout) on grammars xgrammar
finds expensive. Usage: python scripts/bench_grammar_compile.py [MODEL_DIR]"""

from __future__ import annotations

import sys
import time

from sparrow.sampling_params import StructuredOutputsParams as P
from sparrow.structured_output.manager import StructuredOutputManager
from sparrow.tiny.model import get_builtin_model_path

SMALL = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
         "required": ["name", "age"]}
NESTED = {"type": "object", "properties": {
    "user": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "id": {"type": "integer"}},
             "required": ["name", "id"]},
    "ok": {"type": "boolean"}}, "required": ["user", "ok"]}


def seconds_to_compile(manager: StructuredOutputManager, params: P) -> tuple[float, str | None]:
    started = time.perf_counter()
    request = manager.new_request(params)
    while not request.done():
        time.sleep(0.0005)
    return time.perf_counter() - started, request.error()


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else str(get_builtin_model_path())
    from sparrow.model_loader import get_hf_config

    vocab_size = int(get_hf_config(model).vocab_size)
    manager = StructuredOutputManager(model, vocab_size=vocab_size, stop_token_ids=[])
    first, _ = seconds_to_compile(manager, P(choice=["a", "b"]))
    print(f"first request (tokenizer + compile process + compile): {first:.2f} s")
    for name, params in [("small schema", P(json=SMALL)), ("nested schema", P(json=NESTED)),
                         ("json_object", P(json_object=True)), ("regex", P(regex=r"[a-z]{1,8}@(foo|bar)\.(com|org)"))]:
        cold, _ = seconds_to_compile(manager, params)
        cached, _ = seconds_to_compile(manager, params)
        print(f"{name}: cold {cold * 1000:.1f} ms, cached {cached * 1000:.3f} ms")
    elapsed, error = seconds_to_compile(manager, P(regex="(a|b)*" * 400))
    print(f"(a|b)* x 400: {elapsed:.2f} s: {error}")
    manager.shutdown()
    bounded = StructuredOutputManager(model, vocab_size=vocab_size, stop_token_ids=[], compile_timeout=2.0)
    seconds_to_compile(bounded, P(choice=["a"]))  # start the compile process first
    elapsed, error = seconds_to_compile(bounded, P(regex="(a|b)*" * 2000))
    print(f"(a|b)* x 2000, timeout 2 s: {elapsed:.2f} s: {error}")
    bounded.shutdown()


if __name__ == "__main__":
    main()
