"""Drive the engine one step at a time, with vLLM's engine classes (LLMEngine, EngineArgs).

    python examples/llm_engine.py                                 # built-in sparrow-tiny
    python examples/llm_engine.py --model /path/to/hf-model --max-model-len 2048
    python examples/llm_engine.py --json                          # each request's token ids, as JSON

Every engine argument is a flag (``EngineArgs.add_cli_args``, the flags of ``sparrow serve``).
Requests are added while the engine runs: one more each step until all are in, as a server adds
them; ``step()`` returns the outputs of the requests that advanced.
"""

from __future__ import annotations

import argparse
import json

from sparrow import EngineArgs, LLMEngine, SamplingParams, TokensPrompt

PROMPTS = ["Hello, my name is", "The capital of France is", "Sparrows are small birds that"]


def requests(max_tokens: int) -> list[tuple[str, object, SamplingParams]]:
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=max_tokens, ignore_eos=True)
    return [
        *((f"greedy-{i}", prompt, greedy) for i, prompt in enumerate(PROMPTS)),
        ("tokens", TokensPrompt(prompt_token_ids=[5, 6, 7, 8, 9]), greedy),
        ("sampled", PROMPTS[0], sampled),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    EngineArgs.add_cli_args(parser)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--json", action="store_true", help="print {request id: output token ids} at the end")
    args = parser.parse_args()
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    try:
        pending = requests(args.max_tokens)
        finished: dict[str, list[int]] = {}
        while pending or engine.has_unfinished_requests():
            if pending:
                request_id, prompt, params = pending.pop(0)
                engine.add_request(request_id, prompt, params)
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = list(output.outputs[0].token_ids)
                    if not args.json:
                        print(f"{output.request_id}: {output.prompt!r} -> {output.outputs[0].text!r}")
        if args.json:
            print(json.dumps(finished))
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
