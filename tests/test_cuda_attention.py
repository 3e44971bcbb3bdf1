"""CUDA attention backends (Triton, FlashInfer) against a torch reference, in bf16 on the GPU.

Nothing here imports triton at module level (see test_triton_kernels.py: whether triton kernels are
interpreted is decided by the first import).
"""

from __future__ import annotations

import math

import pytest
import torch

from sparrow.attention import AttentionMetadata

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]


def reference_attention(queries, keys, values, scale) -> torch.Tensor:
    """Causal attention per request (fp32): new token j sits at position seq_len - query_len + j."""
    outs = []
    for q, k, v in zip(queries, keys, values):
        query_len, num_heads, _ = q.shape
        seq_len, num_kv_heads, _ = k.shape
        group = num_heads // num_kv_heads
        k = k.float().repeat_interleave(group, dim=1)  # [seq_len, num_heads, head_dim]
        v = v.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale  # [heads, query, key]
        query_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)[:, None]
        key_pos = torch.arange(seq_len, device=q.device)[None, :]
        scores = scores.masked_fill(key_pos > query_pos, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v))
    return torch.cat(outs)


class Step:
    """A random step on the GPU: per request (query_len, context_len), a shuffled paged cache
    whose unwritten slots are NaN, the cached context already in place."""

    def __init__(self, query_and_context_lens, *, num_heads, num_kv_heads, head_dim, block_size,
                 dtype, num_padding_tokens=0, seed=0):
        device = torch.device("cuda")
        gen = torch.Generator(device=device).manual_seed(seed)

        def randn(*shape):
            return torch.randn(*shape, generator=gen, device=device).to(dtype)

        self.query_lens = [q for q, _ in query_and_context_lens]
        self.seq_lens = [q + c for q, c in query_and_context_lens]
        num_reqs = len(self.seq_lens)
        blocks_needed = [math.ceil(s / block_size) for s in self.seq_lens]
        num_blocks = sum(blocks_needed) + 7
        perm = torch.randperm(num_blocks, generator=gen, device=device)
        self.block_table = torch.zeros(num_reqs, max(blocks_needed) + 1, dtype=torch.int32,
                                       device=device)
        self.kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim),
                                   float("nan"), dtype=dtype, device=device)
        flat = self.kv_cache.view(2, -1, num_kv_heads, head_dim)
        self.keys, self.values, self.queries, slots = [], [], [], []
        used = 0
        for i, (query_len, seq_len) in enumerate(zip(self.query_lens, self.seq_lens)):
            ids = perm[used:used + blocks_needed[i]]
            used += blocks_needed[i]
            self.block_table[i, :len(ids)] = ids.to(torch.int32)
            pos = torch.arange(seq_len, device=device)
            req_slots = ids[pos // block_size] * block_size + pos % block_size
            k, v = randn(seq_len, num_kv_heads, head_dim), randn(seq_len, num_kv_heads, head_dim)
            context_len = seq_len - query_len
            flat[0, req_slots[:context_len]] = k[:context_len]
            flat[1, req_slots[:context_len]] = v[:context_len]
            self.keys.append(k)
            self.values.append(v)
            self.queries.append(randn(query_len, num_heads, head_dim))
            slots.append(req_slots[context_len:])
        pad = num_padding_tokens
        self.num_actual_tokens = sum(self.query_lens)
        self.query = torch.cat(self.queries + [randn(pad, num_heads, head_dim)])
        self.new_keys = torch.cat([k[s - q:] for k, q, s in
                                   zip(self.keys, self.query_lens, self.seq_lens)]
                                  + [randn(pad, num_kv_heads, head_dim)])
        self.new_values = torch.cat([v[s - q:] for v, q, s in
                                     zip(self.values, self.query_lens, self.seq_lens)]
                                    + [randn(pad, num_kv_heads, head_dim)])
        slot_mapping = torch.cat(slots + [torch.full((pad,), -1, device=device)])
        query_start_loc_cpu = torch.tensor([0] + self.query_lens).cumsum(0).to(torch.int32)
        seq_lens_cpu = torch.tensor(self.seq_lens, dtype=torch.int32)
        self.metadata = AttentionMetadata(
            num_actual_tokens=self.num_actual_tokens, num_reqs=num_reqs,
            max_query_len=max(self.query_lens), max_seq_len=max(self.seq_lens),
            query_start_loc=query_start_loc_cpu.to(device), seq_lens=seq_lens_cpu.to(device),
            block_table=self.block_table, slot_mapping=slot_mapping.to(torch.int64),
            query_start_loc_cpu=query_start_loc_cpu, seq_lens_cpu=seq_lens_cpu,
            is_decode_only=all(q == 1 for q in self.query_lens))
        self.scale = head_dim ** -0.5

    def reference(self) -> torch.Tensor:
        return reference_attention(self.queries, self.keys, self.values, self.scale)

    def run(self, backend) -> torch.Tensor:
        backend.prepare(self.metadata)
        return backend.forward(self.query, self.new_keys, self.new_values, self.kv_cache,
                               self.metadata)


def mixed_lens(seed: int) -> list[tuple[int, int]]:
    """Decodes over various contexts, a fresh prefill, chunks after prefix hits."""
    gen = torch.Generator().manual_seed(seed)
    decodes = [(1, int(c)) for c in torch.randint(0, 3000, (24,), generator=gen)]
    return decodes + [(512, 0), (256, 1024), (77, 777), (1, 0), (3, 4000)]


def decode_lens(seed: int) -> list[tuple[int, int]]:
    gen = torch.Generator().manual_seed(seed)
    return [(1, int(c)) for c in torch.randint(0, 8000, (6,), generator=gen)]


CONFIGS = [  # num_heads, num_kv_heads, head_dim, block_size
    (32, 8, 128, 16),
    (16, 2, 64, 32),
    (28, 4, 128, 16),  # GQA group of 7 (Qwen2-7B shape)
    (8, 8, 256, 16),
]


def make_backend(name: str, num_heads, num_kv_heads, head_dim, dtype):
    from sparrow_cuda.attention import FlashInferAttentionBackend, TritonAttentionBackend

    if name == "flashinfer":
        pytest.importorskip("flashinfer")
        cls = FlashInferAttentionBackend
    else:
        pytest.importorskip("triton")
        cls = TritonAttentionBackend
    return cls(num_heads, num_kv_heads, head_dim, head_dim ** -0.5, dtype, torch.device("cuda"))


def check(step: Step, out: torch.Tensor) -> None:
    n = step.num_actual_tokens
    assert out.shape == step.query.shape
    assert not torch.isnan(out[:n]).any()
    torch.testing.assert_close(out[:n].float(), step.reference(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("backend_name", ["triton", "flashinfer"])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", CONFIGS)
def test_mixed_batch_bf16(backend_name, num_heads, num_kv_heads, head_dim, block_size):
    if backend_name == "flashinfer" and head_dim not in (64, 128, 256):
        pytest.skip("FlashInfer head_dim")
    backend = make_backend(backend_name, num_heads, num_kv_heads, head_dim, torch.bfloat16)
    step = Step(mixed_lens(0), num_heads=num_heads, num_kv_heads=num_kv_heads,
                head_dim=head_dim, block_size=block_size, dtype=torch.bfloat16,
                num_padding_tokens=5)
    check(step, step.run(backend))


@pytest.mark.parametrize("backend_name", ["triton", "flashinfer"])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", CONFIGS[:2])
def test_decode_batch_bf16(backend_name, num_heads, num_kv_heads, head_dim, block_size):
    # Few long decodes: the Triton backend takes its split-KV path, FlashInfer its decode wrapper.
    backend = make_backend(backend_name, num_heads, num_kv_heads, head_dim, torch.bfloat16)
    step = Step(decode_lens(1), num_heads=num_heads, num_kv_heads=num_kv_heads,
                head_dim=head_dim, block_size=block_size, dtype=torch.bfloat16)
    assert step.metadata.is_decode_only
    check(step, step.run(backend))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_triton_other_dtypes(dtype):
    backend = make_backend("triton", 32, 8, 128, dtype)
    step = Step(mixed_lens(2), num_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
                dtype=dtype)
    check(step, step.run(backend))


def test_flashinfer_backend_twice_in_a_step():
    # Every layer of a step reuses the plan made by prepare(); a new step re-plans.
    backend = make_backend("flashinfer", 32, 8, 128, torch.bfloat16)
    for seed in (3, 4):
        step = Step(mixed_lens(seed), num_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
                    dtype=torch.bfloat16)
        check(step, step.run(backend))
        out = backend.forward(step.query, step.new_keys, step.new_values, step.kv_cache,
                              step.metadata)
        check(step, out)
