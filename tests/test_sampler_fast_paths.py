"""The sampler's cheap paths against their slow, obvious references: the two-level draw (float32
chunk sums) against a float64 inverse CDF, the top-k window against the full sort, the sparse
penalties against the dense ones, the incremental output history against padding the lists, the
vectorised seeded uniforms against ``step_uniform``, and logprobs for the rows that asked only."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import sparrow.sample.filters as filters_module
import sparrow.sample.sampler as sampler_module
from sparrow.sample.history import OutputHistory
from sparrow.sample.metadata import SamplingTensors, build_sampling_metadata, pad_token_ids, step_uniform, step_uniforms
from sparrow.sample.penalties import apply_penalties
from sparrow.sample.sampler import Sampler, apply_top_k_top_p, inverse_cdf
from sparrow.sampling_params import SamplingParams


def reference_draw(probs: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The float64 inverse CDF over whole rows: (token, the target u * total, the row's cdf)."""
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    target = uniforms.to(torch.float64).unsqueeze(1) * cdf[:, -1:]
    ids = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return torch.minimum(ids, (cdf < cdf[:, -1:]).sum(dim=-1)), target, cdf


def tailed_rows(vocab: int, rows: int, seed: int) -> torch.Tensor:
    """Skewed rows with zeros, a few heavy tokens and tails of 1e-9 and 1e-12 tokens."""
    gen = torch.Generator().manual_seed(seed)
    probs = torch.rand(rows, vocab, generator=gen) ** 8
    probs[:, ::3] = 0.0
    heavy = torch.randint(0, vocab, (rows, 4), generator=gen)
    probs.scatter_(1, heavy, 50.0)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    probs[: rows // 2, 1::3] = 1e-9  # a long tail of tiny tokens in half the rows
    probs[rows // 2 :, 1::7] = 1e-12
    return probs


@pytest.mark.parametrize("vocab", [151936, 50257, 4096])  # chunks of 128; padded to 128; 128
def test_two_level_draw_is_the_float64_draw_within_the_stated_bound(vocab):
    probs = tailed_rows(vocab, 12, seed=vocab)
    gen = torch.Generator().manual_seed(vocab + 1)
    uniforms = torch.rand(12, generator=gen, dtype=torch.float64)
    # Half the rows aim at the middle of a tiny tail token far into the row.
    expected, _, cdf = reference_draw(probs, uniforms)
    for row in range(0, 12, 2):
        tiny = ((probs[row] > 0) & (probs[row] < 1e-8)).nonzero().squeeze(1)
        token = int(tiny[len(tiny) * 4 // 5])
        uniforms[row] = ((cdf[row, token] - probs[row, token].double() / 2) / cdf[row, -1]).item()
    expected, target, cdf = reference_draw(probs, uniforms)
    got = inverse_cdf(probs, uniforms)

    assert bool((probs.gather(1, got.unsqueeze(1)) > 0).all())  # never a zero-probability token
    chunk = sampler_module._chunk_size(vocab)
    bound = 3 * (chunk - 1) * 2.0**-24 * cdf[:, -1:]  # the docstring's bound on a boundary's shift
    start = cdf.gather(1, got.unsqueeze(1)) - probs.gather(1, got.unsqueeze(1)).double()
    end = cdf.gather(1, got.unsqueeze(1))
    # The token drawn is the float64 draw at a target moved by less than the bound...
    assert bool(((start - bound <= target) & (target < end + bound)).all())
    # ...so wherever the target is further than that from every boundary, it is the same token.
    boundaries = torch.cat([cdf.new_zeros(12, 1), cdf], dim=1)
    margin = (boundaries - target).abs().amin(dim=1)
    clear = margin > bound.squeeze(1)
    assert bool(clear.any())
    assert got[clear].tolist() == expected[clear].tolist()


def test_two_level_draw_is_exact_where_float32_chunk_sums_are():
    """One non-zero token per chunk of 128: the float32 chunk sums are exact, and so is every
    draw, tiny tokens and a target at any point of the row included."""
    vocab, rows = 151936, 8
    gen = torch.Generator().manual_seed(7)
    probs = torch.zeros(rows, vocab)
    chunks = vocab // 128
    positions = torch.arange(chunks) * 128 + torch.randint(0, 128, (chunks,), generator=gen)
    values = torch.rand(rows, chunks, generator=gen)
    values[:, ::5] = 1e-9
    values[:, 3::11] = 1e-12
    probs[:, positions] = values
    probs = probs / probs.sum(dim=-1, keepdim=True)
    _, _, cdf = reference_draw(probs, torch.zeros(rows, dtype=torch.float64))
    for trial in range(4):
        uniforms = torch.rand(rows, generator=gen, dtype=torch.float64)
        tiny = positions[5 * (trial * 97 % (chunks // 5))]  # a 1e-9 token: aim at its middle
        uniforms[::2] = (cdf[::2, tiny] - probs[::2, tiny].double() / 2) / cdf[::2, -1]
        expected, _, _ = reference_draw(probs, uniforms)
        got = inverse_cdf(probs, uniforms)
        assert got.tolist() == expected.tolist()
        assert got[::2].tolist() == [int(tiny)] * (rows // 2)


def dense_penalties(logits, output_ids, prompt_ids, repetition, frequency, presence):
    """The dense [B, V] version the sparse one replaces (count and mask tensors)."""
    rows, vocab = logits.shape
    padded = pad_token_ids(output_ids, vocab, "cpu")
    counts = torch.zeros(rows, vocab + 1).scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    counts = counts[:, :vocab]
    seen = counts > 0
    prompt_padded = pad_token_ids(prompt_ids, vocab, "cpu")
    prompt_seen = torch.zeros(rows, vocab + 1, dtype=torch.bool).scatter_(1, prompt_padded, True)
    seen_any = seen | prompt_seen[:, :vocab]
    penalty = repetition.unsqueeze(1)
    logits = torch.where(seen_any, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
    logits = logits - frequency.unsqueeze(1) * counts
    return logits - presence.unsqueeze(1) * seen.to(logits.dtype)


def test_sparse_penalties_equal_the_dense_ones_bit_for_bit():
    rng = random.Random(0)
    vocab, rows = 300, 7
    params = [SamplingParams(repetition_penalty=rng.choice([1.0, 1.3, 0.7]), frequency_penalty=rng.uniform(-1, 1),
                             presence_penalty=rng.choice([0.0, 0.4])) for _ in range(rows)]
    outputs = [[rng.randrange(vocab) for _ in range(rng.randrange(0, 40))] for _ in range(rows)]
    outputs[2] = []  # a row with no output yet
    outputs[3] = [vocab - 1] * 5 + [0, 0]  # the last and first ids, repeated
    prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 20))] for _ in range(rows)]
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(1)) * 3
    logits[4, 10] = float("-inf")
    metadata = build_sampling_metadata(params, outputs, prompts, vocab, "cpu")
    assert metadata.output_token_tensor is not None
    expected = dense_penalties(logits, outputs, prompts, metadata.repetition_penalties,
                               metadata.frequency_penalties, metadata.presence_penalties)
    assert torch.equal(apply_penalties(logits, metadata), expected)
    metadata.output_token_tensor = None  # the lists are padded instead: same result
    assert torch.equal(apply_penalties(logits, metadata), expected)


def test_incremental_history_equals_padding_the_lists_after_random_changes():
    rng = random.Random(3)
    pad = 1000
    history = OutputHistory(pad, "cpu")
    rows = [[rng.randrange(pad) for _ in range(rng.randrange(5))] for _ in range(6)]
    for step in range(300):
        action = rng.random()
        if action < 0.6:  # a decode step: every row gains a token
            for tokens in rows:
                tokens.append(rng.randrange(pad))
        elif action < 0.7 and rows:  # a request leaves
            rows.pop(rng.randrange(len(rows)))
        elif action < 0.8:  # a request joins (or comes back after preemption with its tokens)
            rows.insert(rng.randrange(len(rows) + 1), [rng.randrange(pad) for _ in range(rng.randrange(30))])
        elif action < 0.87 and len(rows) > 1:  # two rows swap places
            i, j = rng.sample(range(len(rows)), 2)
            rows[i], rows[j] = rows[j], rows[i]
        elif action < 0.94 and rows:  # drafts accepted: several tokens at once
            rows[rng.randrange(len(rows))].extend(rng.randrange(pad) for _ in range(rng.randrange(1, 5)))
        elif rows:  # a list that shrank in place is read again
            tokens = rows[rng.randrange(len(rows))]
            del tokens[rng.randrange(len(tokens) + 1):]
        got = history.update(rows)
        assert torch.equal(got, pad_token_ids(rows, pad, "cpu")), step


def test_the_history_only_lives_while_a_penalty_is_set():
    tensors = SamplingTensors(50, "cpu")
    outputs = [[1, 2], [3]]
    tensors.update_batch([SamplingParams(), SamplingParams(frequency_penalty=0.5)], [[0], [0]])
    assert tensors.metadata(outputs).output_token_tensor.tolist() == [[1, 2], [3, 50]]
    outputs[1].append(4)
    assert tensors.metadata(outputs).output_token_tensor.tolist() == [[1, 2], [3, 4]]
    tensors.update_batch([SamplingParams(), SamplingParams()], [[0], [0]])
    assert tensors.metadata(outputs).output_token_tensor is None and tensors._history is None


def test_vectorised_seeded_uniforms_equal_step_uniform():
    rng = random.Random(5)
    seeds = [0, 1, -1, -5, 42, 2**63 + 11, 2**64 - 1, -(2**70)] + [rng.randrange(-2**80, 2**80) for _ in range(200)]
    positions = [rng.randrange(0, 1 << 20) for _ in seeds]
    got = step_uniforms(np.array([s & (2**64 - 1) for s in seeds], dtype=np.uint64), np.array(positions))
    assert got.tolist() == [step_uniform(s, p) for s, p in zip(seeds, positions)]


@pytest.mark.parametrize("with_top_p", [False, True])
def test_top_k_window_cuts_where_the_full_sort_does(with_top_p):
    gen = torch.Generator().manual_seed(11)
    rows, vocab = 24, 4000
    logits = (torch.randn(rows, vocab, generator=gen) * 2).round(decimals=1)  # many ties
    logits[3, :] = 0.0  # a row of ties only: the k-th value's ties run far past the window
    logits[4, :100] = 5.0
    top_k = torch.randint(1, 60, (rows,), generator=gen)
    top_k[5] = 0  # a row that does not filter (its p is 1)
    top_p = torch.rand(rows, generator=gen) * 0.9 + 0.05 if with_top_p else None
    if top_p is not None:
        top_p[5] = 1.0
        top_p[6] = 1.0  # top-k alone in a top-p batch
    window = int(top_k.max())
    expected = filters_module._full_sort_cut(logits, top_k, top_p)
    got = apply_top_k_top_p(logits, top_k, top_p, max_top_k=window)
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    assert not torch.isinf(got[5]).any() and (~torch.isinf(got[3])).sum() == vocab
    assert 0 < (~torch.isinf(got)).sum() < rows * vocab


def test_top_p_window_on_cpu_cuts_where_the_full_sort_does_or_declines():
    gen = torch.Generator().manual_seed(12)
    rows, vocab = 16, 9000
    logits = (torch.randn(rows, vocab, generator=gen) * 4).round(decimals=1)
    top_p = torch.rand(rows, generator=gen) * 0.9 + 0.05
    top_k = torch.randint(0, 3, (rows,), generator=gen) * 20  # rows with k 0, 20 or 40
    top_p[0], top_k[0] = 1.0, 0  # does not filter
    top_p[1], top_k[1] = 1.0, 20  # top-k alone
    for k in (None, top_k):
        expected = filters_module._full_sort_cut(logits, k, top_p)
        window = filters_module._window_cut(logits, k, top_p, 1024, checked=True)
        assert window is not None  # these rows' cuts lie within their top 1024
        assert torch.equal(torch.isinf(window), torch.isinf(expected))
        assert torch.equal(torch.isinf(apply_top_k_top_p(logits, k, top_p)), torch.isinf(expected))
    # A flat row whose top-p cut lies far past the window: the window declines, the sort decides.
    logits[2] = torch.randn(vocab, generator=gen) * 0.01
    top_k[2], top_p[2] = 0, 0.9
    assert filters_module._window_cut(logits, top_k, top_p, 1024, checked=True) is None
    expected = filters_module._full_sort_cut(logits, top_k, top_p)
    assert torch.equal(torch.isinf(apply_top_k_top_p(logits, top_k, top_p)), torch.isinf(expected))
    assert (~torch.isinf(expected[2])).sum() > 1024


def test_max_top_k_is_given_only_when_every_filtering_row_has_a_k():
    greedy = SamplingParams(temperature=0.0, top_p=0.5)  # greedy rows never filter
    assert build_sampling_metadata([SamplingParams(top_k=5), SamplingParams(top_k=9, top_p=0.8), SamplingParams(),
                                    greedy], [[]] * 4, [[]] * 4, 100, "cpu").max_top_k == 9
    assert build_sampling_metadata([SamplingParams(top_k=5), SamplingParams(top_p=0.8)], [[]] * 2, [[]] * 2, 100,
                                   "cpu").max_top_k is None


def test_logprobs_are_computed_for_the_rows_that_asked_only(monkeypatch):
    torch.manual_seed(2)
    logits = torch.randn(5, 40)
    params = [SamplingParams(temperature=0.0, logprobs=2 if row in (1, 3) else None) for row in range(5)]
    metadata = build_sampling_metadata(params, [[]] * 5, [[]] * 5, 40, "cpu")
    assert metadata.logprob_rows.tolist() == [1, 3]
    lists = Sampler()(logits, metadata).logprobs_lists()
    every = build_sampling_metadata([SamplingParams(temperature=0.0, logprobs=2)] * 5, [[]] * 5, [[]] * 5, 40, "cpu")
    assert every.logprob_rows is None
    reference = Sampler()(logits, every).logprobs_lists()
    assert lists[0] is None and lists[2] is None and lists[4] is None
    assert lists[1] == reference[1] and lists[3] == reference[3]

    def refuse(*args, **kwargs):
        raise AssertionError("logprobs computed for a batch that asked for none")

    monkeypatch.setattr(sampler_module, "gather_logprobs", refuse)
    none = build_sampling_metadata([SamplingParams(temperature=0.7)] * 5, [[]] * 5, [[]] * 5, 40, "cpu")
    assert Sampler()(logits, none).logprobs is None


def test_logprobs_stay_raw_when_a_processor_writes_in_place_on_half_precision_logits():
    from sparrow.sample.logits_processor import LogitsProcessor, LogitsProcessors

    class ZeroFirstColumn(LogitsProcessor):  # writes into the tensor it is given
        def __init__(self, config=None, device=None, is_pin_memory=False):
            pass

        def is_argmax_invariant(self):
            return False

        def update_state(self, batch_update):
            pass

        def apply(self, logits):
            logits[:, 0] = 100.0
            return logits

    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    tensors = SamplingTensors(40, "cpu", LogitsProcessors([ZeroFirstColumn()]))
    tensors.update_batch([SamplingParams(temperature=0.0, logprobs=1)] * 3, [[]] * 3)
    out = Sampler()(logits, tensors.metadata([[], [], []]))
    assert out.sampled_token_ids.tolist() == [0, 0, 0]  # the processor ran
    reference = logits.float().log_softmax(dim=-1)
    for row, entry in enumerate(out.logprobs_lists()):
        assert entry.logprobs[0] == pytest.approx(reference[row, 0].item(), abs=1e-6)  # not its 100
