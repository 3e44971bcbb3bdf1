"""Request traces: the JSONL format, its validation, the synthetic generators, ``sparrow bench trace``
and ``sparrow bench serve --trace`` replaying a trace against a real ``sparrow serve``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sparrow.bench.trace import TraceRequest, load_trace, prompt_tokens, save_trace, synthesize

GOOD = {"arrival_s": 0.5, "prompt_len": 8, "output_len": 4}


def _write(path: Path, lines: list) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def test_round_trip_keeps_every_field(tmp_path):
    requests = [
        TraceRequest(arrival_s=0.0, output_len=3, prompt_len=10),
        TraceRequest(arrival_s=0.25, output_len=5, prompt_token_ids=[1, 2, 3, 4], prefix_group="a", prefix_len=2),
        TraceRequest(arrival_s=0.25, output_len=1, prompt_len=7, prefix_group="a", prefix_len=4, priority=-2),
        TraceRequest(arrival_s=3, output_len=2, prompt_len=1, prefix_group="b"),
    ]
    path = tmp_path / "sub" / "trace.jsonl"
    save_trace(path, requests)
    assert load_trace(path) == requests
    lines = path.read_text().splitlines()
    assert len(lines) == 4
    # Keys at their defaults are left out of the file.
    assert json.loads(lines[0]) == {"arrival_s": 0.0, "prompt_len": 10, "output_len": 3}
    assert json.loads(lines[2])["priority"] == -2


def test_blank_lines_are_skipped_and_line_numbers_count_them(tmp_path):
    path = _write(tmp_path / "t.jsonl", [GOOD, "", {**GOOD, "output_len": 0}])
    with pytest.raises(ValueError, match=r"line 3: 'output_len'"):
        load_trace(path)
    assert len(load_trace(_write(tmp_path / "u.jsonl", ["", GOOD, "  ", GOOD]))) == 2


@pytest.mark.parametrize(("line", "field"), [
    ({**GOOD, "arrival_s": 0.1}, "arrival_s"),  # earlier than line 1's 0.5
    ({**GOOD, "arrival_s": -1.0}, "arrival_s"),
    ({**GOOD, "arrival_s": "soon"}, "arrival_s"),
    ({**GOOD, "prompt_len": -3}, "prompt_len"),
    ({**GOOD, "prompt_len": 0}, "prompt_len"),
    ({**GOOD, "prompt_len": 2.5}, "prompt_len"),
    ({**GOOD, "output_len": -1}, "output_len"),
    ({**GOOD, "output_len": True}, "output_len"),
    ({"arrival_s": 1.0, "prompt_len": 8}, "output_len"),
    ({"prompt_len": 8, "output_len": 2}, "arrival_s"),
    ({**GOOD, "prompt_token_ids": [1, 2]}, "prompt_token_ids"),  # both
    ({"arrival_s": 1.0, "output_len": 2}, "prompt_len"),  # neither
    ({"arrival_s": 1.0, "output_len": 2, "prompt_token_ids": []}, "prompt_token_ids"),
    ({"arrival_s": 1.0, "output_len": 2, "prompt_token_ids": [1, -5]}, "prompt_token_ids"),
    ({**GOOD, "prefix_group": "g", "prefix_len": 9}, "prefix_len"),  # longer than the 8-token prompt
    ({**GOOD, "prefix_group": "g", "prefix_len": -1}, "prefix_len"),
    ({**GOOD, "prefix_len": 2}, "prefix_group"),
    ({**GOOD, "prefix_group": ""}, "prefix_group"),
    ({**GOOD, "priority": "high"}, "priority"),
    ({**GOOD, "prompt_length": 8}, "prompt_length"),  # a misspelt key is refused, not ignored
    ([1, 2], "JSON object"),
    ("{not json", "not valid JSON"),
])
def test_each_validation_error_names_the_line_and_field(tmp_path, line, field):
    path = _write(tmp_path / "t.jsonl", [GOOD, line])
    with pytest.raises(ValueError) as info:
        load_trace(path)
    message = str(info.value)
    assert "line 2" in message and field in message, message


def test_an_empty_trace_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no requests"):
        load_trace(_write(tmp_path / "t.jsonl", [""]))


def test_save_refuses_requests_out_of_arrival_order(tmp_path):
    late = TraceRequest(arrival_s=2.0, output_len=1, prompt_len=1)
    early = TraceRequest(arrival_s=1.0, output_len=1, prompt_len=1)
    with pytest.raises(ValueError, match=r"request 1: 'arrival_s'"):
        save_trace(tmp_path / "t.jsonl", [late, early])


def test_prompt_tokens_share_group_prefixes_and_keep_explicit_ids():
    requests = [
        TraceRequest(arrival_s=0, output_len=1, prompt_len=20, prefix_group="s", prefix_len=12),
        TraceRequest(arrival_s=0, output_len=1, prompt_len=30, prefix_group="s", prefix_len=12),
        TraceRequest(arrival_s=0, output_len=1, prompt_len=20),
        TraceRequest(arrival_s=0, output_len=1, prompt_token_ids=[5, 6, 7]),
    ]
    tokens = prompt_tokens(requests, vocab_size=100, seed=3)
    assert [len(t) for t in tokens] == [20, 30, 20, 3]
    assert tokens[0][:12] == tokens[1][:12]
    assert tokens[0][12:] != tokens[1][12:20]  # unique suffixes
    assert tokens[3] == [5, 6, 7]
    assert all(0 <= t < 100 - 16 for ids in tokens[:3] for t in ids)
    assert prompt_tokens(requests, vocab_size=100, seed=3) == tokens
    assert prompt_tokens(requests, vocab_size=100, seed=4) != tokens
    with pytest.raises(ValueError, match="vocab_size"):
        prompt_tokens(requests, vocab_size=16)


def test_shared_system_prompt_trace_is_shaped_as_documented():
    requests = synthesize("shared-system-prompt", 60, seed=5, num_system_prompts=3, system_prompt_len=40,
                          suffix_len_min=2, suffix_len_max=9, output_len_min=1, output_len_max=4, request_rate=10.0)
    assert requests == synthesize("shared-system-prompt", 60, seed=5, num_system_prompts=3, system_prompt_len=40,
                                  suffix_len_min=2, suffix_len_max=9, output_len_min=1, output_len_max=4,
                                  request_rate=10.0)
    assert requests != synthesize("shared-system-prompt", 60, seed=6, num_system_prompts=3, system_prompt_len=40)
    assert len(requests) == 60
    assert {r.prefix_group for r in requests} == {"system-0", "system-1", "system-2"}
    assert all(r.prefix_len == 40 and 42 <= r.prompt_len <= 49 and 1 <= r.output_len <= 4 for r in requests)
    arrivals = [r.arrival_s for r in requests]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
    # Poisson at 10 req/s: 59 gaps of mean 0.1 s (a loose bound: it checks the unit, not the luck).
    assert 2.0 < arrivals[-1] < 12.0
    tokens = prompt_tokens(requests, vocab_size=1000)
    by_group: dict[str, list[list[int]]] = {}
    for request, ids in zip(requests, tokens):
        by_group.setdefault(request.prefix_group, []).append(ids)
    for group in by_group.values():
        assert len({tuple(ids[:40]) for ids in group}) == 1
    assert len({tuple(group[0][:40]) for group in by_group.values()}) == 3


def test_multi_turn_trace_is_shaped_as_documented():
    requests = synthesize("multi-turn", 80, seed=2, turns_min=2, turns_max=5, user_len_min=3, user_len_max=10,
                          output_len_min=2, output_len_max=6, think_time_s=1.0, request_rate=4.0)
    assert requests == synthesize("multi-turn", 80, seed=2, turns_min=2, turns_max=5, user_len_min=3,
                                  user_len_max=10, output_len_min=2, output_len_max=6, think_time_s=1.0,
                                  request_rate=4.0)
    assert len(requests) == 80
    arrivals = [r.arrival_s for r in requests]
    assert arrivals == sorted(arrivals)
    conversations: dict[str, list[TraceRequest]] = {}
    for request in requests:
        conversations.setdefault(request.prefix_group, []).append(request)
    assert len(conversations) >= 80 // 5
    for turns in conversations.values():
        assert turns[0].prefix_len == 0
        for previous, turn in zip(turns, turns[1:]):
            # The prefix is the previous turn's whole context: its prompt and its answer.
            assert turn.prefix_len == previous.prompt_len + previous.output_len
            assert 3 <= turn.prompt_len - turn.prefix_len <= 10
            assert turn.arrival_s >= previous.arrival_s
    tokens = prompt_tokens(requests, vocab_size=500, seed=1)
    index = {id(r): i for i, r in enumerate(requests)}
    for turns in conversations.values():
        for previous, turn in zip(turns, turns[1:]):
            before, now = tokens[index[id(previous)]], tokens[index[id(turn)]]
            assert now[:previous.prompt_len] == before  # the previous prompt is a prefix of this one


def test_multi_turn_max_prompt_len_ends_conversations():
    requests = synthesize("multi-turn", 50, seed=0, max_prompt_len=200, user_len_max=50, output_len_max=60)
    assert max(r.prompt_len for r in requests) <= 200
    assert len(requests) == 50


@pytest.mark.parametrize(("kind", "options", "field"), [
    ("nope", {}, "kind"),
    ("multi-turn", {"system_prompt_len": 8}, "system_prompt_len"),
    ("multi-turn", {"turns_min": 4, "turns_max": 2}, "turns_min"),
    ("multi-turn", {"max_prompt_len": 10, "user_len_max": 20}, "max_prompt_len"),
    ("shared-system-prompt", {"request_rate": 0}, "request_rate"),
    ("shared-system-prompt", {"suffix_len_min": 0}, "suffix_len_min"),
    ("shared-system-prompt", {"num_system_prompts": 1.5}, "num_system_prompts"),
])
def test_generator_options_are_validated(kind, options, field):
    with pytest.raises(ValueError, match=field):
        synthesize(kind, 10, **options)
    with pytest.raises(ValueError, match="num_requests"):
        synthesize("multi-turn", 0)


def test_request_rate_inf_sends_everything_at_once():
    requests = synthesize("shared-system-prompt", 10, request_rate=float("inf"))
    assert {r.arrival_s for r in requests} == {0.0}


# -- the command line --------------------------------------------------------------------------
def _sparrow(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sparrow.entrypoints.cli", *argv], capture_output=True, text=True,
                          timeout=timeout)


def test_bench_trace_cli_writes_a_loadable_deterministic_trace(tmp_path):
    argv = ["bench", "trace", "--kind", "multi-turn", "--num-requests", "30", "--request-rate", "4", "--seed", "0",
            "--turns-max", "3", "--think-time-s", "2"]
    first = _sparrow(*argv, "-o", str(tmp_path / "a.jsonl"))
    assert first.returncode == 0, first.stderr
    assert "30 requests" in first.stdout
    assert _sparrow(*argv, "-o", str(tmp_path / "b.jsonl")).returncode == 0
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    assert load_trace(tmp_path / "a.jsonl") == synthesize("multi-turn", 30, seed=0, request_rate=4.0, turns_max=3,
                                                          think_time_s=2.0)
    wrong = _sparrow("bench", "trace", "--kind", "shared-system-prompt", "--turns-min", "3", "-o", str(tmp_path / "c"))
    assert wrong.returncode != 0 and "--turns-min" in wrong.stderr
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize(("flags", "message"), [
    (["--kind", "multi-turn", "--num-requests", "0"], "--num-requests must be an integer >= 1, got 0"),
    (["--kind", "multi-turn", "--turns-min", "4", "--turns-max", "2"],
     "--turns-min (4) is larger than --turns-max (2)"),
    (["--kind", "shared-system-prompt", "--request-rate", "0"], "--request-rate must be > 0, got 0.0"),
    (["--kind", "multi-turn", "--max-prompt-len", "10", "--user-len-max", "20"],
     "--max-prompt-len (10) is shorter than --user-len-max (20)"),
    (["--kind", "shared-system-prompt", "--turns-min", "3"],
     "--turns-min does not apply to --kind shared-system-prompt"),
    (["--kind", "shared-system-prompt", "--turns-min", "3", "--think-time-s", "1"],
     "--think-time-s, --turns-min do not apply to --kind shared-system-prompt"),
])
def test_bench_trace_errors_name_the_flags(flags, message, tmp_path):
    result = _sparrow("bench", "trace", *flags, "-o", str(tmp_path / "t.jsonl"), timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("sparrow: error: ") and message in lines[0], lines[0]
    assert "_" not in lines[0].split(":", 2)[2].split("(its options")[0]  # flags, never Python names
    assert not (tmp_path / "t.jsonl").exists()


# -- replay against a real server ------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests.conftest import build_test_model
    from tests.test_server import serve_for_module

    model_dir = str(build_test_model(tmp_path_factory.mktemp("trace-model"), "qwen3"))
    # The priority scheduler: a trace's priorities are sent, and a policy that ignores them refuses them.
    yield from serve_for_module(model_dir, tmp_path_factory, "trace-logs", "--scheduler", "priority")


def _replay(server, trace: Path, result: Path, *extra: str) -> dict:
    from tests.test_server import API_KEY

    done = _sparrow("bench", "serve", "--trace", str(trace), "--base-url", server.url, "--api-key", API_KEY,
                    "--result-file", str(result), *extra)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Prefix cache hit rate (%)" in done.stdout
    return json.loads(result.read_text())


def test_bench_serve_replays_a_shared_prefix_trace(server, tmp_path):
    trace = tmp_path / "shared.jsonl"
    made = _sparrow("bench", "trace", "--kind", "shared-system-prompt", "--num-requests", "8", "--request-rate", "8",
                    "--num-system-prompts", "2", "--system-prompt-len", "64", "--suffix-len-min", "4",
                    "--suffix-len-max", "12", "--output-len-min", "2", "--output-len-max", "5", "-o", str(trace))
    assert made.returncode == 0, made.stderr
    requests = load_trace(trace)
    result = _replay(server, trace, tmp_path / "shared.json")
    assert result["completed"] == 8 and result["failed"] == 0
    assert result["total_input_tokens"] == sum(r.prompt_len for r in requests)
    assert result["total_output_tokens"] == sum(r.output_len for r in requests)  # ignore_eos
    assert result["duration_s"] >= requests[-1].arrival_s  # requests were sent at their arrival times
    # Two system prompts of 64 tokens shared by 8 requests: the later ones find them cached.
    assert result["prefix_cache_queries"] >= result["total_input_tokens"] - 8
    assert result["prefix_cache_hit_rate"] > 0.2

    # The same lengths without prefix groups (explicit, distinct ids; priorities sent): nothing to hit.
    plain = [TraceRequest(arrival_s=r.arrival_s, output_len=r.output_len, priority=i % 2,
                          prompt_token_ids=[(7 * i + 3 * j) % 4000 for j in range(r.prompt_len)])
             for i, r in enumerate(requests)]
    save_trace(tmp_path / "plain.jsonl", plain)
    control = _replay(server, tmp_path / "plain.jsonl", tmp_path / "plain.json", "--num-prompts", "5")
    assert control["completed"] == 5 and control["failed"] == 0
    assert control["prefix_cache_hits"] == 0 and control["prefix_cache_hit_rate"] == 0.0


def test_bench_serve_refuses_a_request_rate_with_a_trace(tmp_path):
    save_trace(tmp_path / "t.jsonl", [TraceRequest(arrival_s=0, output_len=1, prompt_len=4)])
    done = _sparrow("bench", "serve", "--trace", str(tmp_path / "t.jsonl"), "--request-rate", "3",
                    "--base-url", "http://127.0.0.1:9", "--result-file", "")
    assert done.returncode != 0 and "--request-rate" in done.stderr


def test_bench_serve_splices_the_servers_real_answers_into_the_next_turn(server, tmp_path):
    trace = tmp_path / "chat.jsonl"
    made = _sparrow("bench", "trace", "--kind", "multi-turn", "--num-requests", "12", "--request-rate", "10",
                    "--turns-min", "2", "--turns-max", "3", "--think-time-s", "0.2", "--user-len-min", "8",
                    "--user-len-max", "24", "--output-len-min", "20", "--output-len-max", "30", "-o", str(trace))
    assert made.returncode == 0, made.stderr
    requests = load_trace(trace)
    # Different seeds: the second replay must not hit the first one's first-turn prompts.
    drawn = _replay(server, trace, tmp_path / "drawn.json", "--seed", "11")
    real = _replay(server, trace, tmp_path / "real.json", "--seed", "12", "--trace-answers", "server")
    for result in (drawn, real):
        assert result["completed"] == 12 and result["failed"] == 0
        assert result["total_input_tokens"] == sum(r.prompt_len for r in requests)  # lengths kept
    # Drawn answers miss the cache past the previous prompt; the server's own answers hit it.
    assert real["prefix_cache_hits"] > drawn["prefix_cache_hits"]
    assert real["trace_answers"] == "server"


def test_splice_answer_keeps_the_prompt_length():
    from sparrow.bench.serve import BenchRequest, RequestResult, _token_ids, splice_answer

    turn = BenchRequest(prompt_token_ids=list(range(100, 110)), max_tokens=2, prefix_len=7)
    previous = RequestResult(prompt_ids=[1, 2, 3], output_ids=[4, 5])
    assert splice_answer(turn, previous).prompt_token_ids == [1, 2, 3, 4, 5, 105, 106, 107, 108, 109]
    failed = RequestResult(prompt_ids=[1, 2, 3])  # no answer: the drawn ids stand in for it
    assert splice_answer(turn, failed).prompt_token_ids == [1, 2, 3, 103, 104, 105, 106, 107, 108, 109]
    longer = RequestResult(prompt_ids=[1, 2, 3, 4, 5, 6], output_ids=[7, 8, 9])
    assert splice_answer(turn, longer).prompt_token_ids == [1, 2, 3, 4, 5, 6, 7, 107, 108, 109]
    assert _token_ids({"tokens": ["token_id:12", "token_id:0", "hello", "xtoken_id:3"]}) == [12, 0]
    assert _token_ids(None) == []
