"""scripts/train_copy_model.py at a toy size: the sequences it trains on have the copy layout, and the
directory it writes loads in Sparrow and in transformers with the trained weights. (Trained accuracy is
the benchmark's business; the hand-set circuit it starts from is checked here.)"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "train_copy_model.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("train_copy_model", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("train_copy_model", module)
    spec.loader.exec_module(module)
    return module


# The smallest model the hand-set circuit fits in.
TOY = ["--steps", "3", "--layers", "2", "--seq-len", "64", "--batch-size", "2", "--eval-seqs", "2"]


@pytest.fixture(scope="module")
def trained(script, tmp_path_factory):
    out = tmp_path_factory.mktemp("copy-model")
    accuracy = script.main(["--out", str(out), *TOY])
    return out, accuracy


def test_sequences_copy_their_source(script, trained):
    from transformers import AutoTokenizer

    data = script.CopyData(AutoTokenizer.from_pretrained(str(trained[0])), 4096, 128)
    rng = np.random.default_rng(0)
    sep = data.sep.tolist()
    for from_text in (True, False):
        ids, weights = data.sequence(rng, from_text=from_text, train=False)
        ids = ids.tolist()
        at = next(i for i in range(len(ids)) if ids[i:i + len(sep)] == sep)  # end of the source
        source, copy = ids[:at], ids[at + len(sep):at + len(sep) + at]
        assert copy == source and len(source) >= data.min_chunk
        assert not weights[:at + len(sep)].any()  # no loss on the source, nor the separator after it
        assert weights[at + len(sep):at + len(sep) + at].tolist() == [1.0] * at
        if not from_text:
            assert min(source) >= script.FIRST_ORDINARY_ID  # no special token among random ones
    # Training sequences fill the length with copies; edited ones leave inserted tokens unscored.
    ids, weights = data.sequence(np.random.default_rng(1), from_text=True, train=True)
    assert len(ids) == data.seq_len and ids.tolist().count(sep[0]) >= 2
    assert set(np.unique(weights).tolist()) <= {0.0, float(np.float32(script.LM_WEIGHT)), 1.0}


def test_bad_arguments_name_the_field(script):
    with pytest.raises(ValueError, match="--head-dim must be even"):
        script.parse_args(["--out", "x", "--init", "random", "--head-dim", "129"])
    with pytest.raises(ValueError, match="--init circuit needs --layers >= 2"):
        script.parse_args(["--out", "x", "--layers", "1"])
    with pytest.raises(ValueError, match="--steps"):
        script.parse_args(["--out", "x", "--steps", "0"])


def test_hand_set_circuit_copies_random_tokens(script, trained):
    """Before any training step: the position heads and the induction head copy."""
    from transformers import AutoConfig, AutoTokenizer, Qwen3ForCausalLM

    out = str(trained[0])
    model = Qwen3ForCausalLM(AutoConfig.from_pretrained(out)).float().eval()
    data = script.CopyData(AutoTokenizer.from_pretrained(out), 4096, 160)
    batch = data.batch(np.random.default_rng(0), 4, train=False, from_text=False)
    assert script.copy_accuracy(model, *batch) < 0.2  # transformers' initialisation does not
    script.induction_init(model, torch.Generator().manual_seed(0))
    assert script.copy_accuracy(model, *batch) > 0.8


def test_writes_a_model_sparrow_and_transformers_load(trained):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from sparrow import LLM, SamplingParams
    from sparrow.tiny.model import random_weights

    out, accuracy = trained
    assert set(accuracy) == {"text", "random"} and all(0.0 <= v <= 1.0 for v in accuracy.values())
    saved = load_file(str(out / "model.safetensors"))
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16)
    assert hf.config.num_hidden_layers == 2 and hf.config.head_dim == 256
    assert torch.equal(hf.model.embed_tokens.weight, saved["model.embed_tokens.weight"])
    # The trained weights replaced the random ones build_model_dir wrote first.
    recipe = random_weights(hf.config, "qwen3", seed=0, dtype=torch.bfloat16)
    assert not torch.equal(recipe["model.embed_tokens.weight"], saved["model.embed_tokens.weight"])
    assert "lm_head.weight" not in saved  # tied to the embedding, as small Qwen3 models are
    assert (out / "tokenizer.json").is_file()
    llm = LLM(str(out), multiprocess=False)
    try:
        output = llm.generate(["the sparrow"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0]
    finally:
        llm.shutdown()
    assert len(output.token_ids) == 4
