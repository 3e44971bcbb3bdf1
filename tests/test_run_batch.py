"""``sparrow run-batch`` (vLLM's ``vllm run-batch``) as a user runs it: the real console script in a
subprocess, an OpenAI batch file in, one result line per request out, in order.

Reference: HF transformers' greedy continuation on the same directory (chat rendered with the
tokenizer's template); the error lines name the field, as the server's answers do.
"""

from __future__ import annotations

import http.server
import json
import select
import socket
import subprocess
import threading
import time
import urllib.request

import pytest
import torch

from tests.test_cli import SMALL, assert_one_error_line, run_sparrow, sparrow_command

MESSAGES = [{"role": "user", "content": "Tell me a story about a bird"}]
PROMPT = "Once upon a time"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def hf_replies(qwen3_dir):
    """(chat reply, completion) texts of HF greedy decoding: 8 and 5 new tokens, cut at EOS."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(qwen3_dir)
    model = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32, local_files_only=True).eval()

    def greedy(text: str, new: int) -> str:
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)

    chat = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    return greedy(chat, 8), greedy(PROMPT, 5)


def _line(custom_id, url, body, method="POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


def _results(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_a_batch_file_gives_hf_replies_and_one_error_line_per_bad_request(qwen3_dir, hf_replies, tmp_path):
    chat_reply, completion = hf_replies
    lines = [
        _line("chat", "/v1/chat/completions", {"model": qwen3_dir, "messages": MESSAGES, "max_completion_tokens": 8,
                                                "temperature": 0}),
        _line("text", "/v1/completions", {"model": qwen3_dir, "prompt": PROMPT, "max_tokens": 5, "temperature": 0}),
        "{not json",
        "",  # blank lines are skipped
        _line("files", "/v1/files", {}),
        _line("cold", "/v1/chat/completions", {"model": qwen3_dir, "messages": MESSAGES, "temperature": -1}),
        _line("chat", "/v1/completions", {"model": qwen3_dir, "prompt": "x"}),
        _line("streamed", "/v1/completions", {"model": qwen3_dir, "prompt": "x", "stream": True}),
        _line("got", "/v1/completions", {"model": qwen3_dir, "prompt": "x"}, method="GET"),
        _line("who", "/v1/completions", {"model": "another-model", "prompt": "x"}),
    ]
    source, target = tmp_path / "batch.jsonl", tmp_path / "results.jsonl"
    source.write_text("\n".join(lines) + "\n")
    result = run_sparrow("run-batch", "-i", str(source), "-o", str(target), "--model", qwen3_dir, *SMALL)
    assert result.returncode == 0, result.stderr
    out = _results(target.read_text())
    assert [entry["custom_id"] for entry in out] == ["chat", "text", None, "files", "cold", "chat", "streamed", "got",
                                                    "who"]
    chat, text, *failed = out
    for entry in (chat, text):
        assert entry["error"] is None and entry["response"]["status_code"] == 200
        assert entry["id"].startswith("sparrow-") and entry["response"]["request_id"].startswith("sparrow-batch-")
    assert chat["response"]["body"]["choices"][0]["message"]["content"] == chat_reply
    assert text["response"]["body"]["choices"][0]["text"] == completion
    assert chat["response"]["body"]["id"].endswith(chat["response"]["request_id"])  # X-Request-Id reached the API
    statuses = [entry["response"]["status_code"] for entry in failed]
    params = [entry["error"]["error"]["param"] for entry in failed]
    assert statuses == [400, 400, 400, 400, 400, 400, 404]
    assert params == ["line", "url", "temperature", "custom_id", "body.stream", "method", "model"]
    assert all(entry["response"]["body"] is None for entry in failed)


def test_input_and_output_urls(qwen3_dir, hf_replies, tmp_path):
    """GET the batch from a URL and PUT the results to one (a real HTTP server on 127.0.0.1)."""
    batch = _line("text", "/v1/completions", {"model": qwen3_dir, "prompt": PROMPT, "max_tokens": 5,
                                              "temperature": 0}).encode() + b"\n"
    uploads: list[bytes] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(200)
            self.send_header("Content-Length", str(len(batch)))
            self.end_headers()
            self.wfile.write(batch)

        def do_PUT(self):  # noqa: N802
            uploads.append(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        result = run_sparrow("run-batch", "-i", f"{base}/batch.jsonl", "-o", f"{base}/results.jsonl",
                             "--output-tmp-dir", str(tmp_path), "--model", qwen3_dir, *SMALL)
    finally:
        server.shutdown()
    assert result.returncode == 0, result.stderr
    (entry,) = _results(uploads[0].decode())
    assert entry["custom_id"] == "text" and entry["response"]["body"]["choices"][0]["text"] == hf_replies[1]
    assert not list(tmp_path.iterdir())  # the local copy, made in --output-tmp-dir, is gone once uploaded


def test_standard_input_and_output_with_metrics_while_it_runs(qwen3_dir):
    port = free_port()
    process = subprocess.Popen([*sparrow_command(), "run-batch", "-i", "-", "-o", "-", "--model", qwen3_dir,
                                *SMALL, "--enable-metrics", "--port", str(port)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        process.stdin.write(_line("one", "/v1/completions", {"model": qwen3_dir, "prompt": PROMPT, "max_tokens": 2})
                            + "\n")
        process.stdin.flush()
        deadline, metrics = time.monotonic() + 120, None
        while metrics is None and time.monotonic() < deadline and process.poll() is None:
            try:
                metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            except OSError:
                time.sleep(0.2)
        assert metrics is not None and "sparrow:num_requests_running" in metrics, process.stderr.read()
        # The result comes while standard input is still open: reading it does not hold the batch up.
        ready, _, _ = select.select([process.stdout], [], [], 120)
        assert ready, "no result while standard input stays open"
        (entry,) = _results(process.stdout.readline())
        stdout, stderr = process.communicate(timeout=120)  # closes standard input: the batch ends
    finally:
        process.kill()
    assert process.returncode == 0, stderr
    assert not stdout.strip()
    assert entry["custom_id"] == "one" and entry["response"]["body"]["usage"]["completion_tokens"] == 2


def test_a_missing_input_file_is_one_line_before_the_model_loads(tmp_path):
    result = run_sparrow("run-batch", "-i", str(tmp_path / "none.jsonl"), "-o", str(tmp_path / "out.jsonl"))
    assert_one_error_line(result, "--input-file", "none.jsonl")
