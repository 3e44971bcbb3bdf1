"""The official ``openai`` client against ``sparrow serve``.

    sparrow serve                          # terminal 1: built-in sparrow-tiny on 127.0.0.1:8000
    python examples/openai_client.py       # terminal 2
    python examples/openai_client.py --base-url http://127.0.0.1:8001/v1 --api-key KEY

Nothing here is Sparrow-specific: the same script works against vLLM's server.
"""

from __future__ import annotations

import argparse

from openai import OpenAI


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="EMPTY", help="the server's --api-key, if it set one")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = client.models.list().data[0].id  # the server serves one model
    print("model:", model)

    completion = client.completions.create(model=model, prompt="Once upon a time", max_tokens=args.max_tokens,
                                           temperature=0.8, seed=1)
    print("completion:", repr(completion.choices[0].text))
    print("usage:", completion.usage)

    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Tell me about sparrows."}],
        max_completion_tokens=args.max_tokens, temperature=0.0,
    )
    print("chat:", repr(chat.choices[0].message.content))

    # Streaming, with vLLM's extra sampling fields passed through extra_body.
    print("stream: ", end="", flush=True)
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Count to five."}],
        max_completion_tokens=args.max_tokens, stream=True, stream_options={"include_usage": True},
        extra_body={"top_k": 40, "ignore_eos": True},
    )
    for chunk in stream:
        for choice in chunk.choices:
            print(choice.delta.content or "", end="", flush=True)
        if chunk.usage is not None:
            print(f"\nusage: {chunk.usage}")


if __name__ == "__main__":
    main()
