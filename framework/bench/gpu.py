"""GPU parts of the throughput benchmark: the Qwen3-0.6B-shaped model and the memory roofline.

The GPU workload of docs/benchmarks.md: Qwen3-0.6B's architecture with random bf16 weights, 256
requests, prompt and output lengths uniform in [100, 1024], ignore_eos, temperature 0.6. Decoding
is memory-bound, so the bar is a memory roofline: the bytes every decode step must read (the
weights once per step, plus every running request's KV cache), summed over the workload, divided
by the card's measured copy bandwidth.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

# Qwen3-0.6B's config.json values.
QWEN3_0_6B = dict(
    hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
    intermediate_size=3072, max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
QWEN3_0_6B_VOCAB = 151936


def build_qwen3_0_6b(out_dir: Path) -> Path:
    """Random bf16 weights in Qwen3-0.6B's shapes; the small local tokenizer (4096 ids) is
    enough because the benchmark sends token ids."""
    from sparrow.tiny.model import build_model_dir
    from sparrow.tiny.tokenizer import build_tokenizer

    if (out_dir / "config.json").is_file():
        return out_dir
    staging = out_dir.with_name(out_dir.name + ".tmp")
    build_model_dir(staging, arch="qwen3", preset="tiny", seed=0, vocab_size=QWEN3_0_6B_VOCAB,
                    with_tokenizer=False, save_dtype="bfloat16", **QWEN3_0_6B)
    build_tokenizer(staging, 4096)
    staging.rename(out_dir)
    return out_dir


def measure_copy_bandwidth(device: str = "cuda", num_bytes: int = 2 << 30, repeats: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read and written."""
    import torch

    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * num_bytes * repeats / (time.perf_counter() - started)


def memory_roofline_bytes(hf_config: Any, workload: list[tuple[list[int], int]],
                          dtype_bytes: int = 2) -> dict[str, float]:
    """Bytes the decode steps of ``workload`` must read at least.

    Weights: once per decode step; with every request running at once the number of decode steps
    is the longest output. KV: each decode step of a request reads its whole context so far.
    """
    layers, kv_heads = hf_config.num_hidden_layers, hf_config.num_key_value_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    kv_bytes_per_token = 2 * layers * kv_heads * head_dim * dtype_bytes
    hidden, inter, vocab = hf_config.hidden_size, hf_config.intermediate_size, hf_config.vocab_size
    q_dim = hf_config.num_attention_heads * head_dim
    per_layer = hidden * (q_dim + 2 * kv_heads * head_dim) + q_dim * hidden + 3 * hidden * inter
    weight_bytes = (layers * per_layer + vocab * hidden) * dtype_bytes  # the LM head is read every step
    decode_steps = max(max_tokens for _, max_tokens in workload)
    kv_reads = 0
    for prompt, max_tokens in workload:
        # decode step t (t = 1..max_tokens-1) reads prompt + t tokens of context
        kv_reads += sum(len(prompt) + t for t in range(1, max_tokens))
    return {
        "weight_bytes_per_step": weight_bytes,
        "kv_bytes_per_token": kv_bytes_per_token,
        "decode_steps": decode_steps,
        "total_bytes": weight_bytes * decode_steps + kv_reads * kv_bytes_per_token,
    }
