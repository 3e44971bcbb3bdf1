"""FlexibleArgumentParser (vLLM's, under ``sparrow.utils``): underscored flags, ``--flag.key``
JSON keys and ``--config FILE.yaml``, in users' scripts and in the ``sparrow`` commands; and
vLLM's basic example (examples/generate.py) run as a user runs it, checked against HF
transformers on the same directory."""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sparrow import EngineArgs
from sparrow.utils import FlexibleArgumentParser

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "generate.py"


def engine_parser() -> FlexibleArgumentParser:
    parser = FlexibleArgumentParser(prog="script")
    EngineArgs.add_cli_args(parser.add_argument_group("engine"))
    parser.add_argument("--num_prompts", type=int)  # a script's own flag, defined with underscores
    parser.add_argument("--prompt", action="append")
    parser.add_argument("--lengths", type=int, nargs="+")
    parser.add_argument("--verbose", action="store_true")
    return parser


def refusal(parser: argparse.ArgumentParser, args: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(args)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_underscored_flags_are_the_dashed_ones_and_a_scripts_own_spelling_stays():
    args = engine_parser().parse_args(["--max_model_len", "64", "--enforce_eager", "--no_enable_prefix_caching",
                                       "--kv_cache_dtype=bfloat16", "--num_prompts", "3"])
    assert (args.max_model_len, args.enforce_eager, args.enable_prefix_caching) == (64, True, False)
    assert (args.kv_cache_dtype, args.num_prompts) == ("bfloat16", 3)


def test_json_flags_take_their_keys_one_by_one_and_merge_with_the_object():
    args = engine_parser().parse_args([
        "--speculative-config.method", "ngram", "--speculative_config.num_speculative_tokens=3",
        "--hf-overrides", '{"rope_theta": 1000, "rope_scaling": {"type": "linear"}}',
        "--hf_overrides.rope_scaling.factor", "2.0", "--hf-overrides.rope_theta", "5000",
    ])
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 3}
    assert args.hf_overrides == {"rope_theta": 5000, "rope_scaling": {"type": "linear", "factor": 2.0}}
    # Keys before the object: the object is the base and the keys are set on it.
    args = engine_parser().parse_args(["--hf-overrides.a", "x", "--hf-overrides", '{"a": 1, "b": 2}'])
    assert args.hf_overrides == {"a": "x", "b": 2}


def test_a_config_file_gives_flags_of_every_kind_and_the_command_line_wins(tmp_path):
    config = tmp_path / "engine.yaml"
    config.write_text("max_model_len: 128\n"
                      "enforce-eager: true\n"
                      "enable_prefix_caching: false\n"
                      "hf_overrides: {rope_theta: 10000}\n"
                      "logits_processors: [a, b]\n"
                      "prompt: [one, two]\n"
                      "lengths: [4, 5]\n"
                      "verbose: true\n"
                      "seed: 7\n"
                      "tokenizer:\n")
    args = engine_parser().parse_args(["--max-model-len", "32", "--config", str(config), "--seed=9"])
    assert (args.max_model_len, args.seed) == (32, 9)  # the command line's, wherever --config stands
    assert (args.enforce_eager, args.enable_prefix_caching, args.verbose) == (True, False, True)
    assert args.hf_overrides == {"rope_theta": 10000}
    assert args.logits_processors == ["a", "b"] and args.lengths == [4, 5]
    assert args.prompt == ["one", "two"] and args.tokenizer is None


@pytest.mark.parametrize("content, message", [
    (None, r"argument --config: cannot read '.*missing\.yaml'"),
    ("max_model_len: [1\n", r"argument --config: '.*' is not valid YAML"),
    ("- max_model_len\n", r"must hold a mapping of flag names to values, got a list"),
    ("max_modle_len: 64\n", r"sets 'max_modle_len', which is not a flag of `script`"),
    ("enforce_eager: yes please\n", r"sets 'enforce_eager' to 'yes please'; it is a switch"),
])
def test_a_bad_config_file_is_a_usage_error_naming_the_file_and_key(tmp_path, capsys, content, message):
    path = tmp_path / ("missing.yaml" if content is None else "engine.yaml")
    if content is not None:
        path.write_text(content)
    assert re.search(message, refusal(engine_parser(), ["--config", str(path)], capsys))


def test_bad_key_syntax_is_a_usage_error_naming_the_flag(capsys):
    parser = engine_parser()
    assert "--hf-overrides.: a key is empty" in refusal(parser, ["--hf-overrides.", "1"], capsys)
    assert "--hf-overrides itself must be a JSON object, got '[1]'" in refusal(
        parser, ["--hf-overrides", "[1]", "--hf-overrides.a", "1"], capsys)
    assert "argument --config: expected a YAML file" in refusal(parser, ["--config"], capsys)
    assert "unrecognized arguments: --max_modle_len" in refusal(parser, ["--max_modle_len", "3"], capsys)


def test_the_sparrow_commands_read_the_same_spellings(tmp_path, capsys):
    from sparrow.entrypoints.cli import build_parser, main

    config = tmp_path / "serve.yaml"
    config.write_text("port: 9123\nmax_num_seqs: 4\nenable_auto_tool_choice: true\ntool_call_parser: hermes\n"
                      "allowed_origins: [http://a.example]\n")
    args = build_parser().parse_args(["--log-level", "INFO", "serve", "--config", str(config), "--max_model_len",
                                      "64", "--speculative-config.method", "ngram"])
    assert (args.port, args.max_num_seqs, args.max_model_len) == (9123, 4, 64)
    assert args.enable_auto_tool_choice and args.tool_call_parser == "hermes"
    assert args.allowed_origins == ["http://a.example"] and args.speculative_config == {"method": "ngram"}
    config.write_text("port: 1\nbogus: 2\n")
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--config", str(config)])
    assert exc.value.code == 2
    assert "sets 'bogus', which is not a flag of `sparrow serve`" in capsys.readouterr().err


def hf_texts(model_dir: str, prompts: list[str], max_tokens: int) -> list[str]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True).eval()
    texts = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = tokenizer(prompt).input_ids
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
            texts.append(tokenizer.decode(out[0, len(ids):], skip_special_tokens=True))
    return texts


def test_vllms_basic_example_runs_as_a_user_runs_it_and_equals_hf(qwen3_dir, tmp_path):
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        import generate as example
    finally:
        sys.path.pop(0)
    config = tmp_path / "engine.yaml"
    config.write_text(f"model: {qwen3_dir}\ndtype: float32\nmax_model_len: 256\nnum_kv_blocks: 64\n")
    result = subprocess.run([sys.executable, str(EXAMPLE), "--config", str(config), "--max_tokens", "8",
                             "--temperature", "0"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    printed = re.findall(r"^Prompt: (.*), Generated text: (.*)$", result.stdout, flags=re.MULTILINE)
    assert [ast.literal_eval(prompt) for prompt, _ in printed] == example.PROMPTS
    assert [ast.literal_eval(text) for _, text in printed] == hf_texts(qwen3_dir, example.PROMPTS, 8)


def test_help_with_a_keyword_shows_the_matching_flags_or_a_group(capsys):
    """vLLM's ``--help=KEYWORD``: the flags that mention it, a group by name, or the groups' list."""
    from sparrow.entrypoints.cli import build_parser

    def help_for(value: str) -> str:
        with pytest.raises(SystemExit) as done:
            build_parser().parse_args(["serve", f"--help={value}"])
        assert done.value.code == 0
        return capsys.readouterr().out

    matching = help_for("max_model")
    assert "--max-model-len" in matching and "--port" not in matching
    by_help = help_for("certificate")  # a word of the TLS flags' help, not of their names
    assert "--ssl-certfile" in by_help and "--ssl-ca-certs" in by_help and "--max-model-len" not in by_help
    groups = help_for("listgroup")
    assert "server" in groups and "engine arguments" in groups
    server = help_for("server")
    assert "--port" in server and "--max-model-len" not in server
    assert "--max-model-len" in help_for("all") and "--port" in help_for("all")
    assert "no flag or group matches 'no-such-thing'" in help_for("no-such-thing")
