"""Offline batch inference with Sparrow's vLLM-compatible API.

    python examples/offline_inference.py                      # built-in sparrow-tiny, built locally
    python examples/offline_inference.py /path/to/hf-model    # any local Hugging Face directory
    python examples/offline_inference.py --device cpu_sdpa    # after pip install examples/sparrow_example_platform

The built-in model has random weights, so its text is gibberish; the point is the API, which is
vLLM's: ``LLM(model, **engine_args).generate(prompts, SamplingParams(...))``.
"""

from __future__ import annotations

import argparse

from sparrow import LLM, SamplingParams

PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "The future of AI is",
    "Sparrows are small birds that",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=None, help="local model directory (default: sparrow-tiny)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, or a plugin's platform")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    # Engine arguments are vLLM's names; the context manager shuts the engine down at the end.
    with LLM(args.model, device=args.device, max_model_len=1024) as llm:
        # Sampled: one SamplingParams for every prompt.
        sampled = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=args.max_tokens, seed=0)
        for output in llm.generate(PROMPTS, sampled):
            print(f"{output.prompt!r} -> {output.outputs[0].text!r}")

        # Greedy with log-probabilities, and a per-request list of parameters.
        greedy = [SamplingParams(temperature=0.0, max_tokens=8, logprobs=1) for _ in PROMPTS[:2]]
        for output in llm.generate(PROMPTS[:2], greedy, use_tqdm=False):
            completion = output.outputs[0]
            print(f"{output.prompt!r}: token ids {completion.token_ids}, "
                  f"cumulative logprob {completion.cumulative_logprob:.2f}, "
                  f"finish reason {completion.finish_reason}")

        # Chat, rendered with the tokenizer's chat template.
        reply = llm.chat([{"role": "user", "content": "Tell me about sparrows."}],
                         SamplingParams(max_tokens=args.max_tokens), use_tqdm=False)
        print("chat:", reply[0].outputs[0].text)


if __name__ == "__main__":
    main()
