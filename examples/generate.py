"""Generate text for a few prompts, with every engine argument on the command line.

    python examples/generate.py                                   # the built-in tiny model
    python examples/generate.py --model DIR --max_tokens 32 --temperature 0.8
    python examples/generate.py --config engine.yaml --max-tokens 16

This is the shape of vLLM's basic example: ``FlexibleArgumentParser`` with
``EngineArgs.add_cli_args`` gives every engine argument as a flag, spelled with dashes or
underscores, JSON flags key by key (``--hf-overrides.rope_theta 10000``), and ``--config
FILE.yaml`` for flags kept in a file (the command line wins). The sampling flags change the
model's own defaults (``LLM.get_default_sampling_params()``, from its generation config).
"""

from __future__ import annotations

from sparrow import LLM, EngineArgs
from sparrow.utils import FlexibleArgumentParser

PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "The future of AI is",
]
SAMPLING_FLAGS = ("max_tokens", "temperature", "top_p", "top_k")


def build_parser() -> FlexibleArgumentParser:
    parser = FlexibleArgumentParser(description=__doc__.split("\n\n")[0])
    engine = parser.add_argument_group("engine arguments")
    EngineArgs.add_cli_args(engine)
    engine.set_defaults(model="sparrow-tiny")
    sampling = parser.add_argument_group("sampling (default: the model's generation config)")
    sampling.add_argument("--max-tokens", type=int, help="tokens to generate per prompt")
    sampling.add_argument("--temperature", type=float, help="0 is greedy")
    sampling.add_argument("--top-p", type=float, help="nucleus sampling: the probability mass kept")
    sampling.add_argument("--top-k", type=int, help="keep the k most likely tokens (0: all)")
    return parser


def main(args: dict) -> None:
    sampling = {name: args.pop(name) for name in SAMPLING_FLAGS}
    llm = LLM(**args)
    params = llm.get_default_sampling_params()
    for name, value in sampling.items():
        if value is not None:
            setattr(params, name, value)
    for output in llm.generate(PROMPTS, params, use_tqdm=False):
        print(f"Prompt: {output.prompt!r}, Generated text: {output.outputs[0].text!r}")
    llm.shutdown()


if __name__ == "__main__":
    main(vars(build_parser().parse_args()))
