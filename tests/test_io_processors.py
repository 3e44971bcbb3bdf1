"""InputProcessor and OutputProcessor with the real sparrow-tiny tokenizer; the engine core on the
far side is played by hand-written EngineCoreOutputs."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from sparrow.core.request import FinishReason
from sparrow.engine.input_processor import InputProcessor
from sparrow.engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from sparrow.engine.output_processor import OutputProcessor
from sparrow.engine.parallel_sampling import fan_out, make_child_requests
from sparrow.outputs import CompletionOutput, Logprob, RequestOutput
from sparrow.sampling_params import RequestOutputKind, SamplingParams
from sparrow.tiny.tokenizer import ENDOFTEXT, IM_END, build_tokenizer, load_tokenizer
from sparrow.worker.outputs import TokenLogprobs

MAX_MODEL_LEN = 64
EOS = 2  # <|im_end|>
ENDOFTEXT_ID = 0


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    path: Path = tmp_path_factory.mktemp("io_tokenizer")
    build_tokenizer(path)
    return load_tokenizer(path)


@pytest.fixture
def inputs(tokenizer) -> InputProcessor:
    return InputProcessor(tokenizer, max_model_len=MAX_MODEL_LEN, vocab_size=len(tokenizer),
                          eos_token_ids=[EOS, ENDOFTEXT_ID])


@pytest.fixture
def outputs(tokenizer) -> OutputProcessor:
    return OutputProcessor(tokenizer)


def core_output(request_id: str, token_ids: list[int], **fields) -> EngineCoreOutput:
    # Through msgpack and back, as it would come from the engine core process.
    message = EngineCoreOutputs(outputs=[EngineCoreOutput(request_id, token_ids, **fields)])
    return msgspec.msgpack.decode(msgspec.msgpack.encode(message), type=EngineCoreOutputs).outputs[0]


def submit(inputs, outputs, request_id: str, prompt, **params) -> list[EngineCoreRequest]:
    text, request = inputs.process_inputs(request_id, prompt, SamplingParams(**params))
    return outputs.add_request(request, text)


# -- InputProcessor ----------------------------------------------------------------------------
def test_prompt_forms(inputs, tokenizer) -> None:
    ids = tokenizer.encode("The sparrow 🐦")
    for prompt in ("The sparrow 🐦", {"prompt": "The sparrow 🐦"}):
        text, request = inputs.process_inputs("r", prompt, SamplingParams())
        assert text == "The sparrow 🐦" and request.prompt_token_ids == ids
    text, request = inputs.process_inputs("r", {"prompt_token_ids": ids}, SamplingParams())
    assert text is None and request.prompt_token_ids == ids
    assert request.eos_token_id == EOS and request.request_id == "r" and request.arrival_time > 0


def test_chat_messages_use_the_chat_template(inputs, tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    rendered = inputs.apply_chat_template(messages)
    assert rendered == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                        "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n")
    text, request = inputs.process_inputs("chat", messages, SamplingParams())
    assert text == rendered
    assert request.prompt_token_ids == tokenizer.encode(rendered, add_special_tokens=False)
    with pytest.raises(ValueError, match=r"messages\[1\]"):
        inputs.apply_chat_template([{"role": "user", "content": "a"}, {"content": "no role"}])


def test_max_tokens_and_stop_ids_are_resolved_on_a_copy(inputs) -> None:
    params = SamplingParams(max_tokens=None, stop_token_ids=[7])
    _, request = inputs.process_inputs("r", {"prompt_token_ids": [5] * 10}, params)
    assert request.max_tokens == request.sampling_params.max_tokens == MAX_MODEL_LEN - 10
    # The tokenizer's eos is the request's; the generation config's other eos is a stop token.
    assert request.sampling_params.stop_token_ids == [7, ENDOFTEXT_ID]
    assert request.sampling_params.all_stop_token_ids == [EOS, 7, ENDOFTEXT_ID]
    assert params.max_tokens is None and params.all_stop_token_ids is None  # caller's untouched

    _, ignoring = inputs.process_inputs("r", {"prompt_token_ids": [5]},
                                        SamplingParams(ignore_eos=True, stop_token_ids=[7]))
    assert ignoring.sampling_params.all_stop_token_ids == [7]
    assert ignoring.max_tokens == 16


@pytest.mark.parametrize(
    ("prompt", "params", "match"),
    [
        ("", {}, r"prompt of request 'bad' \(''\) is empty"),
        ({"prompt_token_ids": []}, {}, r"prompt of request 'bad'.* is empty"),
        ({"prompt_token_ids": [1, 4096]}, {}, r"token id 4096 at position 1 is outside the vocabulary \[0, 4096\)"),
        ({"prompt_token_ids": [-1]}, {}, r"token id -1 at position 0"),
        ({"prompt_token_ids": [1, "2"]}, {}, r"position 1 holds '2', not an int"),
        ({"prompt_token_ids": [5] * MAX_MODEL_LEN}, {}, r"64 tokens long, which leaves no room .* max_model_len=64"),
        ("word " * 100, {}, r"prompt of request 'bad' \('word word word.*\.\.\.'\) is \d+ tokens long"),
        ({"prompt_token_ids": [5] * 60}, {"max_tokens": 5}, r"max_tokens=5 is too large .* at most 4"),
        ({"prompt_token_ids": [5] * 60}, {"max_tokens": None, "min_tokens": 5}, r"min_tokens=5"),
        ("hi", {"logprobs": 21}, r"logprobs=21 exceeds the maximum of 20"),
        ("hi", {"prompt_logprobs": 50}, r"prompt_logprobs=50"),
        ("hi", {"stop": ["x"], "detokenize": False}, r"stop strings \['x'\] need detokenize=True"),
        ("hi", {"stop_token_ids": [5000]}, r"stop_token_ids: 5000"),
        (12, {}, r"must be a str, .* got int"),
        ({"text": "hi"}, {}, r"key 'text' is not supported"),  # refused, never dropped
        ({"prompt": "hi", "multi_modal_data": {"image": 1}}, {}, r"key 'multi_modal_data' is not supported"),
    ],
)
def test_invalid_requests_are_rejected_naming_the_prompt_or_field(inputs, prompt, params, match) -> None:
    with pytest.raises(ValueError, match=match):
        inputs.process_inputs("bad", prompt, SamplingParams(**params))


def test_text_prompt_without_tokenizer_is_rejected() -> None:
    processor = InputProcessor(None, max_model_len=MAX_MODEL_LEN, vocab_size=100, eos_token_ids=3)
    _, request = processor.process_inputs("r", {"prompt_token_ids": [1, 2]}, SamplingParams())
    assert request.eos_token_id == 3
    with pytest.raises(ValueError, match="need a tokenizer"):
        processor.process_inputs("r", "text", SamplingParams())


def test_fan_out_child_ids_and_seeds(inputs) -> None:
    assert fan_out("req", 3) == ["0_req", "1_req", "2_req"]
    _, request = inputs.process_inputs("req", "hi", SamplingParams(n=3, seed=10))
    children = make_child_requests(request)
    assert [child.request_id for child in children] == ["0_req", "1_req", "2_req"]
    assert [child.sampling_params.seed for child in children] == [10, 11, 12]
    assert all(child.sampling_params.n == 1 for child in children)
    assert make_child_requests(inputs.process_inputs("one", "hi", SamplingParams())[1])[0].request_id == "one"


# -- OutputProcessor: single requests --------------------------------------------------------------
def test_cumulative_outputs(inputs, outputs, tokenizer) -> None:
    ids = tokenizer.encode("Hello 🐦 world")
    submit(inputs, outputs, "a", "Hi", max_tokens=len(ids))
    texts = []
    for position, token_id in enumerate(ids):
        last = position == len(ids) - 1
        fields = {"finish_reason": FinishReason.LENGTH} if last else {}
        processed = outputs.process_outputs([core_output("a", [token_id], **fields)])
        (output,) = processed.request_outputs
        assert output.request_id == "a" and output.prompt == "Hi" and processed.reqs_to_abort == []
        assert output.outputs[0].token_ids == ids[: position + 1]
        texts.append(output.outputs[0].text)
    assert texts[-1] == "Hello 🐦 world" and all(t == texts[-1][: len(t)] for t in texts)
    assert output.finished and output.outputs[0].finish_reason == "length" and output.outputs[0].stop_reason is None
    assert not outputs.has_unfinished_requests()


def test_delta_outputs_add_up(inputs, outputs, tokenizer) -> None:
    ids = tokenizer.encode("早上七点，城市慢慢醒来。")
    submit(inputs, outputs, "d", "Hi", output_kind=RequestOutputKind.DELTA)
    deltas, token_ids = [], []
    for start in range(0, len(ids), 2):
        last = start + 2 >= len(ids)
        fields = {"finish_reason": FinishReason.LENGTH} if last else {}
        (output,) = outputs.process_outputs([core_output("d", ids[start:start + 2], **fields)]).request_outputs
        deltas.append(output.outputs[0].text)
        token_ids.extend(output.outputs[0].token_ids)
    assert "".join(deltas) == "早上七点，城市慢慢醒来。" and token_ids == ids and output.finished


def test_final_only_gives_one_output(inputs, outputs, tokenizer) -> None:
    ids = tokenizer.encode("one two three")
    submit(inputs, outputs, "f", "Hi", output_kind=RequestOutputKind.FINAL_ONLY)
    assert outputs.process_outputs([core_output("f", ids[:1])]).request_outputs == []
    (output,) = outputs.process_outputs(
        [core_output("f", ids[1:] + [EOS], finish_reason=FinishReason.STOP)]).request_outputs
    completion = output.outputs[0]
    assert completion.text == "one two three" and completion.token_ids == ids + [EOS]
    assert completion.finish_reason == "stop" and completion.stop_reason is None and completion.finished()


def test_stop_string_finishes_and_asks_the_core_to_abort(inputs, outputs, tokenizer) -> None:
    submit(inputs, outputs, "s", "Hi", stop=["sings at"])
    processed = outputs.process_outputs([core_output("s", tokenizer.encode("The sparrow sings at dawn"))])
    assert processed.reqs_to_abort == ["s"]
    completion = processed.request_outputs[0].outputs[0]
    assert completion.text == "The sparrow " and completion.finish_reason == "stop"
    assert completion.stop_reason == "sings at"
    assert processed.request_outputs[0].finished and not outputs.has_unfinished_requests()
    # Outputs still in flight for the stopped request are ignored.
    assert outputs.process_outputs([core_output("s", [5])]).request_outputs == []


def test_stop_token_id_from_the_core(inputs, outputs, tokenizer) -> None:
    period = tokenizer.encode(".")[0]
    submit(inputs, outputs, "t", "Hi", stop_token_ids=[period])
    ids = tokenizer.encode("The end") + [period]
    (output,) = outputs.process_outputs(
        [core_output("t", ids, finish_reason=FinishReason.STOP, stop_reason=period)]).request_outputs
    assert output.outputs[0].text == "The end" and output.outputs[0].stop_reason == period


def test_logprobs_are_converted(inputs, outputs, tokenizer) -> None:
    prompt_ids = tokenizer.encode("a sparrow")
    submit(inputs, outputs, "l", {"prompt_token_ids": prompt_ids}, logprobs=1, prompt_logprobs=1,
           output_kind=RequestOutputKind.DELTA)
    sparrow_id = prompt_ids[1]
    prompt_entry = TokenLogprobs(token_ids=[sparrow_id, 7], logprobs=[-2.5, -0.5], ranks=[3, 1])
    first = TokenLogprobs(token_ids=[42, 42], logprobs=[-0.25, -0.25], ranks=[1, 1])  # chosen == top-1
    second = TokenLogprobs(token_ids=[43, 42], logprobs=[-1.0, -0.5], ranks=[2, 1])
    (output,) = outputs.process_outputs(
        [core_output("l", [42], new_logprobs=[first], new_prompt_logprobs=[prompt_entry])]
    ).request_outputs
    assert output.prompt is None and output.prompt_token_ids == prompt_ids
    assert output.prompt_logprobs == [
        None,
        {sparrow_id: Logprob(-2.5, 3, tokenizer.decode([sparrow_id])), 7: Logprob(-0.5, 1, tokenizer.decode([7]))},
    ]
    assert output.outputs[0].logprobs == [{42: Logprob(-0.25, 1, tokenizer.decode([42]))}]
    (output,) = outputs.process_outputs(
        [core_output("l", [43], new_logprobs=[second], finish_reason=FinishReason.LENGTH)]
    ).request_outputs
    (entry,) = output.outputs[0].logprobs
    assert list(entry) == [43, 42] and entry[43].rank == 2 and entry[42].decoded_token == tokenizer.decode([42])
    assert output.outputs[0].cumulative_logprob == pytest.approx(-1.25)
    assert output.prompt_logprobs == []  # DELTA: prompt logprobs came once, with the first output


def test_no_logprobs_requested_means_none(inputs, outputs) -> None:
    submit(inputs, outputs, "n", "Hi")
    (output,) = outputs.process_outputs([core_output("n", [42], finish_reason=FinishReason.LENGTH)]).request_outputs
    assert output.prompt_logprobs is None
    assert output.outputs[0].logprobs is None and output.outputs[0].cumulative_logprob is None


def test_metrics_record_token_times(inputs, outputs) -> None:
    _, request = inputs.process_inputs("m", "Hi", SamplingParams(), arrival_time=100.0)
    outputs.add_request(request, "Hi")
    outputs.process_outputs([core_output("m", [42])], timestamp=100.5)
    outputs.process_outputs([core_output("m", [43])], timestamp=100.7)
    (output,) = outputs.process_outputs([core_output("m", [44], finish_reason=FinishReason.LENGTH)],
                                        timestamp=100.9).request_outputs
    metrics = output.metrics
    assert metrics.time_to_first_token == pytest.approx(0.5)
    assert metrics.mean_inter_token_latency == pytest.approx(0.2)
    assert metrics.e2e_latency == pytest.approx(0.9) and metrics.num_generation_tokens == 3


def test_duplicate_request_id_is_rejected(inputs, outputs) -> None:
    submit(inputs, outputs, "dup", "Hi")
    with pytest.raises(ValueError, match="request_id 'dup' is already in use"):
        submit(inputs, outputs, "dup", "Hi")


# -- parallel sampling (n > 1) -------------------------------------------------------------------
def test_final_only_fan_in_sorts_outputs_by_index(inputs, outputs, tokenizer) -> None:
    children = submit(inputs, outputs, "p", "Hi", n=3, output_kind=RequestOutputKind.FINAL_ONLY)
    assert [child.request_id for child in children] == ["0_p", "1_p", "2_p"]
    words = {"0_p": " zero", "1_p": " one", "2_p": " two"}
    finished = [core_output(child_id, tokenizer.encode(words[child_id]), finish_reason=FinishReason.LENGTH)
                for child_id in ("2_p", "0_p")]
    assert outputs.process_outputs(finished).request_outputs == []
    (output,) = outputs.process_outputs(
        [core_output("1_p", tokenizer.encode(" one"), finish_reason=FinishReason.LENGTH)]
    ).request_outputs
    assert output.request_id == "p" and output.finished
    assert [(c.index, c.text) for c in output.outputs] == [(0, " zero"), (1, " one"), (2, " two")]
    assert not outputs.has_unfinished_requests()


def test_cumulative_fan_in_keeps_every_child(inputs, outputs, tokenizer) -> None:
    submit(inputs, outputs, "c", "Hi", n=2)
    (output,) = outputs.process_outputs([core_output("1_c", tokenizer.encode(" b"))]).request_outputs
    assert [c.index for c in output.outputs] == [1] and not output.finished
    (output,) = outputs.process_outputs(
        [core_output("0_c", tokenizer.encode(" a"), finish_reason=FinishReason.LENGTH),
         core_output("1_c", tokenizer.encode(" c"), finish_reason=FinishReason.LENGTH)]
    ).request_outputs
    assert [(c.index, c.text, c.finish_reason) for c in output.outputs] == [(0, " a", "length"), (1, " b c", "length")]
    assert output.finished


def test_delta_fan_in_merges_one_batch(inputs, outputs, tokenizer) -> None:
    submit(inputs, outputs, "dd", "Hi", n=2, output_kind=RequestOutputKind.DELTA)
    (output,) = outputs.process_outputs(
        [core_output("1_dd", tokenizer.encode(" y")), core_output("0_dd", tokenizer.encode(" x"))]
    ).request_outputs
    assert [(c.index, c.text) for c in output.outputs] == [(0, " x"), (1, " y")]
    (output,) = outputs.process_outputs([core_output("0_dd", [], finish_reason=FinishReason.LENGTH)]).request_outputs
    assert [(c.index, c.text) for c in output.outputs] == [(0, "")] and not output.finished


# -- aborts ------------------------------------------------------------------------------------
class ListQueue:
    def __init__(self) -> None:
        self.items: list[RequestOutput] = []

    def put(self, output: RequestOutput) -> None:
        self.items.append(output)


def test_abort_parent_returns_child_ids_and_wakes_its_queue(inputs, outputs, tokenizer) -> None:
    queue = ListQueue()
    _, request = inputs.process_inputs("q", "Hi", SamplingParams(n=2))
    outputs.add_request(request, "Hi", queue=queue)
    processed = outputs.process_outputs([core_output("0_q", tokenizer.encode(" so"))])
    assert processed.request_outputs == [] and len(queue.items) == 1  # went to the queue
    assert outputs.abort_requests(["q", "unknown"]) == ["0_q", "1_q"]
    final = queue.items[-1]
    assert final.finished and [c.finish_reason for c in final.outputs] == ["abort", "abort"]
    assert not outputs.has_unfinished_requests()
    assert outputs.abort_requests("q") == []


def test_abort_from_the_core(inputs, outputs) -> None:
    submit(inputs, outputs, "x", "Hi")
    (output,) = outputs.process_outputs([core_output("x", [], finish_reason=FinishReason.ABORT)]).request_outputs
    assert output.finished and output.outputs[0].finish_reason == "abort"


def test_request_output_add_aggregates_deltas() -> None:
    def out(text, ids, finished):
        completion = CompletionOutput(0, text, ids, None, None, "length" if finished else None)
        return RequestOutput("r", "p", [1], None, [completion], finished)

    merged = out("a", [1], False)
    merged.add(out("b", [2], True), aggregate=True)
    assert merged.outputs[0].text == "ab" and merged.outputs[0].token_ids == [1, 2] and merged.finished
    with pytest.raises(ValueError, match="request_id"):
        merged.add(RequestOutput("other", None, None, None, [], True), aggregate=False)


def test_special_tokens_in_output_follow_sampling_params(inputs, outputs, tokenizer) -> None:
    ids = tokenizer.encode(f"Hi{IM_END}there{ENDOFTEXT}")
    submit(inputs, outputs, "k", "Hi", skip_special_tokens=False, spaces_between_special_tokens=False)
    submit(inputs, outputs, "s", "Hi")
    processed = outputs.process_outputs(
        [core_output(rid, ids, finish_reason=FinishReason.LENGTH) for rid in ("k", "s")])
    assert [o.outputs[0].text for o in processed.request_outputs] == [f"Hi{IM_END}there{ENDOFTEXT}", "Hithere"]
