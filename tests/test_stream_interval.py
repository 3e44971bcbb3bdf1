"""vLLM's ``stream_interval``: a streamed request's outputs carry at least that many new tokens,
except its first output (sent at once, so time to first token does not move) and its last.

The exact chunking is checked on the OutputProcessor with the real tokenizer, the engine core on
the far side played by hand-written outputs (one token per step, as a real one sends them). Then
one AsyncLLM with the built-in model in a real engine-core process: each stream against the same
request run to completion (FINAL_ONLY) on the same engine, since the chunking must change nothing
but the chunk sizes (AsyncLLM merges outputs a slow consumer has not read, so only a lower bound
on chunk sizes holds there). The server's --stream-interval is checked in test_server_flags."""

from __future__ import annotations

import asyncio

import pytest

from sparrow import AsyncLLM, RequestOutputKind, SamplingParams
from sparrow.config import ConfigError, EngineConfig
from sparrow.core.request import FinishReason
from sparrow.engine.input_processor import InputProcessor
from sparrow.engine.messages import EngineCoreOutput
from sparrow.engine.output_processor import OutputProcessor
from sparrow.tiny.tokenizer import build_tokenizer, load_tokenizer

INTERVAL = 4
PROMPT = "Once upon a time"


async def collect(engine, params, request_id):
    return [output async for output in engine.generate(PROMPT, params, request_id)]


def check_chunks(sizes: list[int], total: int) -> None:
    """Every output but the first and the last has at least INTERVAL new tokens. (AsyncLLM may
    merge outputs a slow consumer has not read yet, so the first can be larger; never smaller.)"""
    assert sum(sizes) == total
    assert all(size >= INTERVAL for size in sizes[1:-1]), sizes
    assert len(sizes) <= 2 + (total - 1) // INTERVAL, sizes


# -- the OutputProcessor, step by step ----------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("stream_interval_tokenizer")
    build_tokenizer(path)
    return load_tokenizer(path)


def run_steps(tokenizer, interval: int, kind: RequestOutputKind, steps: int, n: int = 1, stop: list[str] | None = None,
              **extra):
    """Feed ``steps`` single-token steps (token ids 300, 301, ...) to every sample of one request;
    the last step finishes by length. Returns the RequestOutputs made after each step (None for a
    step that made none)."""
    inputs = InputProcessor(tokenizer, max_model_len=512, vocab_size=len(tokenizer), eos_token_ids=[2])
    outputs = OutputProcessor(tokenizer, stream_interval=interval)
    params = SamplingParams(max_tokens=steps, n=n, output_kind=kind, stop=stop, temperature=1.0 if n > 1 else 0.0,
                            **extra)
    text, request = inputs.process_inputs("r", "Once upon a time", params)
    children = outputs.add_request(request, text)
    made = []
    for step in range(steps):
        finish = FinishReason.LENGTH if step == steps - 1 else None
        batch = [EngineCoreOutput(child.request_id, [300 + step], finish_reason=finish) for child in children]
        produced = outputs.process_outputs(batch).request_outputs
        assert len(produced) <= 1
        made.append(produced[0] if produced else None)
        if produced and produced[0].finished:
            break
    return made


def test_delta_outputs_at_the_first_token_then_every_interval(tokenizer):
    made = run_steps(tokenizer, INTERVAL, RequestOutputKind.DELTA, steps=12)
    sizes = [len(output.outputs[0].token_ids) if output is not None else 0 for output in made]
    # 1, then 4 more tokens at steps 5 and 9, and the last 3 when the request finishes.
    assert sizes == [1, 0, 0, 0, 4, 0, 0, 0, 4, 0, 0, 3]
    sent = [t for output in made if output is not None for t in output.outputs[0].token_ids]
    assert sent == list(range(300, 312))
    assert "".join(output.outputs[0].text for output in made if output is not None) == \
        tokenizer.decode(list(range(300, 312)))
    # stream_interval=1 (the default): an output every step.
    assert all(output is not None for output in run_steps(tokenizer, 1, RequestOutputKind.DELTA, steps=6))


def test_a_requests_own_interval_raises_the_engines(tokenizer):
    def sizes(engine_interval, own):
        made = run_steps(tokenizer, engine_interval, RequestOutputKind.DELTA, steps=12, stream_interval=own)
        return [len(output.outputs[0].token_ids) if output is not None else 0 for output in made]

    assert sizes(2, 5) == [1, 0, 0, 0, 0, 5, 0, 0, 0, 0, 5, 1]
    assert sizes(4, 2) == sizes(4, None) == [1, 0, 0, 0, 4, 0, 0, 0, 4, 0, 0, 3]  # never below the engine's


def test_cumulative_outputs_every_interval_and_final_only_unchanged(tokenizer):
    made = run_steps(tokenizer, INTERVAL, RequestOutputKind.CUMULATIVE, steps=10)
    lengths = [len(output.outputs[0].token_ids) if output is not None else None for output in made]
    assert lengths == [1, None, None, None, 5, None, None, None, 9, 10]
    final = run_steps(tokenizer, INTERVAL, RequestOutputKind.FINAL_ONLY, steps=10)
    assert [output is not None for output in final] == [False] * 9 + [True]
    assert final[-1].outputs[0].token_ids == list(range(300, 310))


def test_a_stop_string_ends_the_stream_between_intervals(tokenizer):
    stop = tokenizer.decode([303])
    made = run_steps(tokenizer, INTERVAL, RequestOutputKind.DELTA, steps=12, stop=[stop])
    last = next(output for output in made if output is not None and output.finished)
    assert last.outputs[0].finish_reason == "stop" and made.index(last) <= 3


def test_each_sample_of_n_counts_its_own_tokens(tokenizer):
    made = run_steps(tokenizer, INTERVAL, RequestOutputKind.DELTA, steps=6, n=2)
    # Both samples get their first token at step 1 and 4 more at step 5 (merged per step), the last at 6.
    per_step = [sorted((c.index, len(c.token_ids)) for c in output.outputs) if output is not None else None
                for output in made]
    assert per_step == [[(0, 1), (1, 1)], None, None, None, [(0, 4), (1, 4)], [(0, 1), (1, 1)]]


# -- a real engine -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def streams():
    async def main():
        engine = AsyncLLM.from_engine_args(model=None, stream_interval=INTERVAL, max_model_len=256)
        try:
            greedy = dict(temperature=0, max_tokens=30, ignore_eos=True)
            delta = await collect(engine, SamplingParams(output_kind=RequestOutputKind.DELTA, **greedy), "delta")
            cumulative = await collect(engine, SamplingParams(output_kind=RequestOutputKind.CUMULATIVE, **greedy),
                                       "cumulative")
            final = await collect(engine, SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY, **greedy), "final")
            seeded = dict(temperature=1.0, seed=7, n=2, max_tokens=13, ignore_eos=True)
            children = await collect(engine, SamplingParams(output_kind=RequestOutputKind.DELTA, **seeded), "n2")
            children_final = await collect(engine, SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY, **seeded),
                                           "n2-final")
            return delta, cumulative, final, children, children_final
        finally:
            engine.shutdown()

    return asyncio.run(main())


def test_delta_outputs_come_in_chunks_of_the_interval(streams):
    delta, _, final, _, _ = streams
    whole = final[-1].outputs[0]
    sizes = [len(output.outputs[0].token_ids) for output in delta]
    check_chunks(sizes, 30)
    assert sizes[0] == 1 or len(delta) < 1 + 29 // INTERVAL  # the first token alone, unless merged
    assert [t for output in delta for t in output.outputs[0].token_ids] == whole.token_ids
    assert "".join(output.outputs[0].text for output in delta) == whole.text
    assert [output.finished for output in delta] == [False] * (len(delta) - 1) + [True]


def test_cumulative_outputs_grow_by_the_interval(streams):
    _, cumulative, final, _, _ = streams
    lengths = [len(output.outputs[0].token_ids) for output in cumulative]
    check_chunks([lengths[0]] + [b - a for a, b in zip(lengths, lengths[1:])], 30)
    assert cumulative[-1].outputs[0].token_ids == final[-1].outputs[0].token_ids
    assert cumulative[-1].outputs[0].text == final[-1].outputs[0].text


def test_each_sample_of_n_is_chunked_on_its_own(streams):
    _, _, _, children, children_final = streams
    by_index: dict[int, list] = {0: [], 1: []}
    for output in children:
        for completion in output.outputs:
            by_index[completion.index].append(completion)
    reference = {c.index: c for c in children_final[-1].outputs}
    for index, completions in by_index.items():
        check_chunks([len(c.token_ids) for c in completions], 13)
        assert [t for c in completions for t in c.token_ids] == reference[index].token_ids
        assert completions[-1].finish_reason == "length"


def test_stream_interval_must_be_positive():
    with pytest.raises(ConfigError, match="stream_interval"):
        EngineConfig.from_kwargs(stream_interval=0)
    assert EngineConfig.from_kwargs(stream_interval=8).scheduler.stream_interval == 8
