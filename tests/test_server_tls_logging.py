"""`sparrow serve --ssl-keyfile/--ssl-certfile` (HTTPS), `--log-config-file` and
`--reasoning-parser-plugin`: one real server process with all three, on a port it picks (0) and
names in its start-up line, called by the real `openai` client over TLS with a certificate made
by the `openssl` command. Wrong values are refused at start-up in one line (status 2), before
the model loads: real `sparrow serve` subprocesses, and the checks themselves in-process."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import ssl
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from sparrow.entrypoints.openai.cli_args import load_log_config, tls_options
from tests.test_reasoning import END_BIAS, MESSAGES, SCHEMA, add_think_tokens, json_format

MODEL_NAME = "tiny-tls"
SEED = 1  # a sample that ends its reasoning, then answers, within 40 tokens
PLUGIN_FILE = Path(__file__).with_name("reasoning_parser_plugin.py")
START_TIMEOUT_S = 120
STARTED = re.compile(rf"uvicorn\.error\|INFO\|serving {MODEL_NAME} on (https?)://127\.0\.0\.1:(\d+) ")


def make_certificate(directory: Path, name: str = "server") -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key (PEM), made by the openssl command."""
    key, cert = directory / f"{name}.key", directory / f"{name}.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True, timeout=60)
    return key, cert


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    return make_certificate(tmp_path_factory.mktemp("tls"))


def log_config(log_file: Path) -> dict:
    """Routes the server's sparrow and uvicorn loggers to ``log_file`` only, in a format of its own."""
    return {"version": 1, "disable_existing_loggers": False,
            "formatters": {"marked": {"format": "%(name)s|%(levelname)s|%(message)s"}},
            "handlers": {"file": {"class": "logging.FileHandler", "filename": str(log_file), "formatter": "marked"}},
            "loggers": {name: {"handlers": ["file"], "level": "INFO", "propagate": False}
                        for name in ("sparrow", "uvicorn")}}


# --ssl-ciphers: the server offers these alone (TLS 1.2's list; TLS 1.3 suites are OpenSSL's own).
CIPHERS = "ECDHE+AESGCM"


class TLSServer:
    """``sparrow serve --port 0`` over HTTPS, its sparrow and uvicorn logs in ``log_file`` (its
    --log-config-file's), the rest of its output in ``output``."""

    def __init__(self, model_dir: str, directory: Path, key: Path, cert: Path) -> None:
        self.cert = cert
        self.log_file, self.output = directory / "configured.log", directory / "output.log"
        config_file = directory / "logging.json"
        config_file.write_text(json.dumps(log_config(self.log_file)))
        command = [sys.executable, "-m", "sparrow.entrypoints.cli", "serve", model_dir, "--port", "0",
                   "--served-model-name", MODEL_NAME, "--max-model-len", "512", "--kv-cache-memory-bytes",
                   str(16 << 20), "--disable-access-log", "--ssl-keyfile", str(key), "--ssl-certfile", str(cert),
                   "--ssl-ciphers", CIPHERS,
                   "--log-config-file", str(config_file), "--reasoning-parser-plugin", str(PLUGIN_FILE),
                   "--reasoning-parser", "qwen3_from_file"]
        with open(self.output, "wb") as output:
            self.proc = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while (started := STARTED.search(self.log())) is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"no start-up line (exit code {self.proc.returncode}):\n{self.log()}\n"
                                   f"{self.output.read_text(errors='replace')}")
            time.sleep(0.1)
        self.scheme, self.port = started.group(1), int(started.group(2))

    def log(self) -> str:
        return self.log_file.read_text(errors="replace") if self.log_file.exists() else ""

    def http_client(self) -> httpx.Client:
        return httpx.Client(verify=ssl.create_default_context(cafile=str(self.cert)), timeout=60)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture(scope="module")
def think_dir(qwen3_dir, tmp_path_factory) -> str:
    return add_think_tokens(qwen3_dir, tmp_path_factory.mktemp("think") / "model")


@pytest.fixture(scope="module")
def server(think_dir, certificate, tmp_path_factory):
    srv = TLSServer(think_dir, tmp_path_factory.mktemp("tls-server"), *certificate)
    yield srv
    srv.stop()
    assert srv.proc.returncode == 0, srv.log()


@pytest.fixture(scope="module")
def client(server):
    with server.http_client() as http:
        yield openai.OpenAI(base_url=f"https://127.0.0.1:{server.port}/v1", api_key="EMPTY", http_client=http,
                            max_retries=0)


@pytest.fixture(scope="module")
def end_of_thinking(think_dir) -> str:
    """The id of the </think> token (add_think_tokens added it), for a logit_bias."""
    added = json.loads((Path(think_dir) / "tokenizer.json").read_text())["added_tokens"]
    return str(next(token["id"] for token in added if token["content"] == "</think>"))


# -- refusals ----------------------------------------------------------------------------------------
def test_wrong_flags_are_one_cli_line_before_the_model_loads(tmp_path, certificate):
    key, cert = certificate
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("-----BEGIN CERTIFICATE-----\nnot base64 at all\n-----END CERTIFICATE-----\n")
    bad_handler = tmp_path / "bad_handler.json"
    bad_handler.write_text(json.dumps({"version": 1, "handlers": {"h": {"class": "logging.NoSuchHandler"}}}))
    not_json = tmp_path / "logging.json"
    not_json.write_text("{version: 1")
    # MODEL does not exist: each error must come before the model is even looked at (and before
    # the server stack is imported: each of these commands takes a fraction of a second).
    no_model = str(tmp_path / "no-model")
    cases = [
        ([no_model, "--ssl-keyfile", str(tmp_path / "missing.key"), "--ssl-certfile", str(cert)],
         "--ssl-keyfile: no such file"),
        ([no_model, "--ssl-keyfile", str(key)], "--ssl-keyfile needs --ssl-certfile"),
        ([no_model, "--ssl-keyfile", str(key), "--ssl-certfile", str(garbage)], "--ssl-keyfile / --ssl-certfile: "),
        ([no_model, "--log-config-file", str(tmp_path / "missing.json")], "--log-config-file: no such file"),
        ([no_model, "--log-config-file", str(not_json)], f"--log-config-file: '{not_json}' is not valid JSON"),
        ([no_model, "--log-config-file", str(bad_handler)], "is not a valid logging configuration: Unable to "
                                                            "configure handler 'h'"),
        # The file is loaded before --reasoning-parser is looked up (by the engine's pre-flight
        # checks, before any engine process starts; no model named, and the built-in one never loads).
        (["--reasoning-parser-plugin", str(PLUGIN_FILE), "--reasoning-parser", "nope"],
         "unknown reasoning parser 'nope'; registered: deepseek_r1, deepseek_v3, glm45, mistral, qwen3, "
         "qwen3_from_file"),
    ]

    def serve(argv: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "sparrow.entrypoints.cli", "serve", "--port", "0", *argv],
                              capture_output=True, text=True, timeout=120, cwd=tmp_path)

    with ThreadPoolExecutor(2) as pool:  # the last case imports the server stack: seconds
        results = list(pool.map(serve, [argv for argv, _ in reversed(cases)]))[::-1]
    for result, (argv, phrase) in zip(results, cases):
        lines = result.stderr.strip().splitlines()
        # The server's own flags: one line. An engine argument (the plugin file) is checked by the
        # engine's pre-flight, after the platform's choice is logged.
        assert result.returncode == 2 and phrase in lines[-1], (argv, result.stderr)
        assert lines[-1].startswith("sparrow: error: ") and (len(lines) == 1 or argv[0] != no_model), lines
        assert not result.stdout, result.stdout


def test_a_wrong_reasoning_parser_plugin_is_a_config_error_naming_it(tmp_path):
    """In-process, as the engine's pre-flight meets it (the CLI's one-line form is checked above
    with an unknown parser name after loading a good file)."""
    from sparrow.config import ConfigError, EngineConfig
    from sparrow.engine.preflight import load_plugin_files

    no_hook = tmp_path / "no_hook.py"
    no_hook.write_text("X = 1\n")
    for path, phrase in [(tmp_path / "missing.py", "no such file"),
                         (no_hook, "defines no sparrow_register_reasoning_parsers hook")]:
        with pytest.raises(ConfigError, match=f"invalid engine argument 'reasoning_parser_plugin': .*{phrase}"):
            load_plugin_files(EngineConfig.from_kwargs(reasoning_parser_plugin=str(path)))


def tls_args(**flags) -> argparse.Namespace:
    return argparse.Namespace(**{"ssl_keyfile": None, "ssl_certfile": None, "ssl_ca_certs": None,
                                 "ssl_cert_reqs": None, **flags})


def test_the_tls_checks(certificate, tmp_path):
    key, cert = certificate
    assert tls_options(tls_args()) == {}
    assert tls_options(tls_args(ssl_keyfile=str(key), ssl_certfile=str(cert))) == {
        "ssl_keyfile": str(key), "ssl_certfile": str(cert), "ssl_ca_certs": None, "ssl_cert_reqs": ssl.CERT_NONE}
    # Client certificates: verified against --ssl-ca-certs, which they need.
    mutual = tls_options(tls_args(ssl_keyfile=str(key), ssl_certfile=str(cert), ssl_ca_certs=str(cert),
                                  ssl_cert_reqs=2))
    assert (mutual["ssl_ca_certs"], mutual["ssl_cert_reqs"]) == (str(cert), ssl.CERT_REQUIRED)
    assert tls_options(tls_args(ssl_keyfile=str(key), ssl_certfile=str(cert), ssl_ciphers=CIPHERS))["ssl_ciphers"] \
        == CIPHERS
    other_key, _ = make_certificate(tmp_path, "other")
    encrypted = tmp_path / "encrypted.key"
    subprocess.run(["openssl", "pkey", "-in", str(key), "-out", str(encrypted), "-aes256", "-passout", "pass:secret"],
                   check=True, capture_output=True, timeout=60)
    for flags, phrase in [
            ({"ssl_certfile": str(cert)}, "--ssl-certfile needs --ssl-keyfile too"),
            ({"ssl_ca_certs": str(cert)}, "--ssl-ca-certs needs --ssl-keyfile and --ssl-certfile"),
            ({"ssl_cert_reqs": 1}, "--ssl-cert-reqs needs --ssl-keyfile and --ssl-certfile"),
            ({"ssl_ciphers": CIPHERS}, "--ssl-ciphers needs --ssl-keyfile and --ssl-certfile"),
            ({"ssl_keyfile": str(key), "ssl_certfile": str(cert), "ssl_ciphers": "NO-SUCH-CIPHER"},
             "--ssl-ciphers: 'NO-SUCH-CIPHER' selects no cipher"),
            ({"ssl_keyfile": str(other_key), "ssl_certfile": str(cert)}, "do not load as a PEM private key and its "
                                                                         "certificate: KEY_VALUES_MISMATCH"),
            ({"ssl_keyfile": str(key), "ssl_certfile": str(cert), "ssl_ca_certs": str(key)}, "--ssl-ca-certs: "),
            ({"ssl_keyfile": str(key), "ssl_certfile": str(cert), "ssl_cert_reqs": 2}, "only against --ssl-ca-certs"),
            ({"ssl_keyfile": str(key), "ssl_certfile": str(tmp_path)}, "--ssl-certfile: no such file"),
            # OpenSSL would ask for the passphrase on the terminal: refused instead.
            ({"ssl_keyfile": str(encrypted), "ssl_certfile": str(cert)}, "is encrypted, and sparrow serve takes "
                                                                         "no passphrase")]:
        with pytest.raises(ValueError, match=re.escape(phrase)):
            tls_options(tls_args(**flags))


def test_the_log_config_file_is_json_or_yaml_and_a_mapping(tmp_path):
    config = log_config(tmp_path / "x.log")
    (tmp_path / "a.json").write_text(json.dumps(config))
    (tmp_path / "a.yaml").write_text(json.dumps(config, indent=2))  # JSON is YAML too
    (tmp_path / "b.yml").write_text("version: 1\nroot: {level: INFO}\n")
    assert load_log_config(str(tmp_path / "a.json")) == config == load_log_config(str(tmp_path / "a.yaml"))
    assert load_log_config(str(tmp_path / "b.yml")) == {"version": 1, "root": {"level": "INFO"}}
    (tmp_path / "list.json").write_text("[1]")
    (tmp_path / "bad.yaml").write_text("version: [1\n")
    for name, phrase in [("list.json", "must hold a mapping"), ("bad.yaml", "is not valid YAML")]:
        with pytest.raises(ValueError, match=f"--log-config-file: .*{phrase}"):
            load_log_config(str(tmp_path / name))


# -- one server: HTTPS, its logs where the configuration sends them, a reasoning parser from a file --
def test_https_serves_the_openai_client_and_plain_http_is_refused(server, client):
    assert server.scheme == "https"  # the start-up line names the scheme it serves
    completion = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=4,
                                           temperature=0.0, extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == 4 and completion.choices[0].text
    with pytest.raises(httpx.TransportError):  # plain HTTP on the TLS port: no HTTP answer at all
        httpx.get(f"http://127.0.0.1:{server.port}/health", timeout=10)
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):  # the system CAs do not know it
        httpx.get(f"https://127.0.0.1:{server.port}/health", timeout=10)
    with server.http_client() as http:
        assert http.get(f"https://127.0.0.1:{server.port}/health").status_code == 200
    # --ssl-ciphers: a TLS 1.2 client offering only a cipher outside the list gets no handshake.
    for cipher, accepted in (("ECDHE-ECDSA-AES128-GCM-SHA256", True), ("ECDHE-ECDSA-CHACHA20-POLY1305", False)):
        context = ssl.create_default_context(cafile=str(server.cert))
        context.maximum_version = ssl.TLSVersion.TLSv1_2
        context.set_ciphers(cipher)
        with httpx.Client(verify=context, timeout=10) as http:
            if accepted:
                assert http.get(f"https://127.0.0.1:{server.port}/health").status_code == 200
            else:
                with pytest.raises(httpx.ConnectError, match="HANDSHAKE_FAILURE|NO_SHARED_CIPHER|UNEXPECTED_EOF"):
                    http.get(f"https://127.0.0.1:{server.port}/health")


def test_the_log_config_file_routes_the_servers_logs(server):
    log = server.log()
    # The engine's start-up, logged before uvicorn starts, follows the file too; so does uvicorn.
    assert re.search(r"^sparrow\.engine\.engine_process\|INFO\|engine core pid \d+ ready", log, re.M), log
    assert re.search(r"^uvicorn\.error\|INFO\|Application startup complete", log, re.M), log
    # The engine-core process applies the file too ($SPARROW_LOGGING_CONFIG_PATH, set by the server).
    assert re.search(r"^sparrow\.engine\.core\|INFO\|engine core ready in", log, re.M), log
    # ... and no longer reaches the default handler (the process's output).
    output = server.output.read_text(errors="replace")
    assert f"serving {MODEL_NAME} on" not in output and "engine core pid" not in output, output
    assert "engine core ready in" not in output, output


def test_a_reasoning_parser_from_a_plugin_file_splits_the_reply(server, client, end_of_thinking):
    message = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, seed=SEED, temperature=1.0,
                                             max_completion_tokens=40,
                                             logit_bias={end_of_thinking: END_BIAS}).choices[0].message
    # The prompt opened the reasoning; the first </think> the model wrote ended it (without a
    # parser, all of it would be the content).
    assert message.reasoning_content and message.content, message
    assert "</think>" not in message.reasoning_content
    # The engine core, which applies grammars after the reasoning, loads the file too (the
    # reasoning_parser_plugin engine argument): the grammar applies once the file's parser says
    # the reasoning ended.
    choice = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, seed=SEED, temperature=1.0,
                                            max_completion_tokens=60, logit_bias={end_of_thinking: END_BIAS},
                                            response_format=json_format(SCHEMA)).choices[0]
    assert choice.finish_reason == "stop", choice
    assert choice.message.reasoning_content and "</think>" not in choice.message.content
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
