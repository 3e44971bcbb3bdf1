"""Sampler: greedy, filters (checked by chi-square goodness of fit), penalties, min_tokens,
seeding (batch- and preemption-invariant) and logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from sparrow.sample.logprobs import compute_token_logprobs
from sparrow.sample.metadata import SamplingTensors, build_sampling_metadata, step_seed
from sparrow.sample.sampler import Sampler, apply_penalties
from sparrow.sampling_params import SamplingParams

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
        ],
    ),
]

# Upper 0.1% points of the chi-square distribution by degrees of freedom (from the standard
# tables), so a correct sampler fails a check about once in a thousand seeds; the seeds are fixed.
CHI2_CRITICAL_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}

# V = 8; distinct values so filters have an unambiguous answer.
LOGITS_8 = torch.tensor([2.0, 1.4, 1.1, 0.6, 0.2, -0.3, -1.0, -1.7])


def metadata_for(params, device="cpu", output_token_ids=None, prompt_token_ids=None, vocab=8):
    output_token_ids = output_token_ids or [[] for _ in params]
    prompt_token_ids = prompt_token_ids or [[] for _ in params]
    return build_sampling_metadata(params, output_token_ids, prompt_token_ids, vocab, device)


def draw_counts(params: SamplingParams, num_draws: int, device: str, seed: int = 0) -> torch.Tensor:
    """Sample ``num_draws`` times from LOGITS_8 (one batch of identical rows) -> counts [8]."""
    logits = LOGITS_8.to(device).expand(num_draws, -1).contiguous()
    metadata = metadata_for([params] * num_draws, device)
    generator = torch.Generator(device=device).manual_seed(seed)
    sampled = Sampler(generator)(logits, metadata).sampled_token_ids
    return torch.bincount(sampled.cpu(), minlength=8).to(torch.float64)


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of ``counts`` against ``probs`` and its degrees of freedom.

    A draw where ``probs`` is 0 makes the statistic infinite (the distribution is impossible).
    """
    probs = probs.to(torch.float64)
    support = probs > 0
    if counts[~support].sum() > 0:
        return math.inf, int(support.sum()) - 1
    expected = probs[support] / probs[support].sum() * counts.sum()
    statistic = ((counts[support] - expected) ** 2 / expected).sum().item()
    return statistic, int(support.sum()) - 1


def assert_fits(counts: torch.Tensor, probs: torch.Tensor) -> None:
    statistic, dof = chi_square(counts, probs)
    if dof == 0:
        assert statistic == 0.0
        return
    assert statistic < CHI2_CRITICAL_999[dof], (statistic, dof, counts, probs)


def assert_rejected(counts: torch.Tensor, wrong_probs: torch.Tensor) -> None:
    statistic, dof = chi_square(counts, wrong_probs)
    assert statistic > CHI2_CRITICAL_999[max(dof, 1)], (statistic, dof)


def reference_filtered(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> torch.Tensor:
    """The intended distribution, computed the slow obvious way (no ties in LOGITS_8)."""
    probs = torch.softmax(LOGITS_8.double() / temperature, dim=0)
    keep = torch.ones(8, dtype=torch.bool)
    if min_p > 0:
        keep &= probs >= min_p * probs.max()
    order = sorted(range(8), key=lambda i: -probs[i].item())
    if top_k > 0:
        for i in order[top_k:]:
            keep[i] = False
    if top_p < 1.0:
        kept = [i for i in order if keep[i]]
        renorm = probs[kept] / probs[kept].sum()
        mass = 0.0
        for position, i in enumerate(kept):
            mass += renorm[position].item()
            if mass >= top_p:
                for j in kept[position + 1 :]:
                    keep[j] = False
                break
    filtered = torch.where(keep, probs, 0.0)
    return filtered / filtered.sum()


# --- greedy -----------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_argmax_and_mixed_batches_keep_greedy_rows_exact(device):
    torch.manual_seed(0)
    logits = torch.randn(6, 100, device=device)
    greedy = SamplingParams(temperature=0.0, top_p=0.5, top_k=3)  # filters ignored when greedy
    metadata = metadata_for([greedy] * 6, device, vocab=100)
    assert metadata.all_greedy and metadata.top_k is None and metadata.top_p is None
    out = Sampler()(logits, metadata)
    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.logprobs is None and out.logprobs_lists() is None

    mixed = [greedy, SamplingParams(temperature=1.5), greedy, SamplingParams(seed=3)] * 2
    logits = torch.randn(8, 100, device=device)
    metadata = metadata_for(mixed, device, vocab=100)
    assert not metadata.all_greedy and not metadata.all_random
    sampled = Sampler()(logits, metadata).sampled_token_ids
    for row in (0, 2, 4, 6):
        assert sampled[row] == logits[row].argmax()


# --- distributions ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "filters, wrong",
    [
        (dict(temperature=1.0), dict(temperature=0.8)),
        (dict(temperature=0.6), dict(temperature=1.0)),
        (dict(temperature=1.3, top_k=3), dict(temperature=1.3, top_k=4)),
        (dict(top_p=0.7), dict(top_p=0.9)),
        (dict(top_p=0.05), dict(top_k=2)),  # top_p below the top token's mass keeps only it
        (dict(min_p=0.2), dict(min_p=0.1)),
        (dict(temperature=0.8, top_k=6, top_p=0.9, min_p=0.03), dict(temperature=0.8, top_k=6)),
    ],
)
def test_random_sampling_matches_intended_distribution(filters, wrong):
    counts = draw_counts(SamplingParams(**filters), 20_000, "cpu", seed=0)
    assert_fits(counts, reference_filtered(**filters))
    # The test has the power to tell: a nearby wrong distribution is rejected.
    assert_rejected(counts, reference_filtered(**wrong))


@pytest.mark.parametrize("device", DEVICES)
def test_distribution_on_device(device):
    filters = dict(temperature=0.9, top_k=5, top_p=0.85)
    counts = draw_counts(SamplingParams(**filters), 20_000, device, seed=0)
    assert_fits(counts, reference_filtered(**filters))


def test_seeded_rows_sample_the_intended_distribution():
    num_draws = 5_000
    params = [SamplingParams(temperature=0.7, seed=seed) for seed in range(num_draws)]
    logits = LOGITS_8.expand(num_draws, -1).contiguous()
    sampled = Sampler()(logits, metadata_for(params)).sampled_token_ids
    counts = torch.bincount(sampled, minlength=8).to(torch.float64)
    assert_fits(counts, reference_filtered(temperature=0.7))
    assert_rejected(counts, reference_filtered(temperature=1.0))


def test_top_k_keeps_ties_at_the_boundary():
    logits = torch.tensor([3.0, 1.0, 1.0, 0.0, -1.0]).expand(4000, -1).contiguous()
    params = [SamplingParams(top_k=2)] * 4000
    metadata = metadata_for(params, vocab=5)
    sampled = Sampler(torch.Generator().manual_seed(0))(logits, metadata).sampled_token_ids
    counts = torch.bincount(sampled, minlength=5).to(torch.float64)
    # Both tied tokens stay (3 survivors), in proportion to their probabilities.
    expected = torch.cat([torch.softmax(torch.tensor([3.0, 1.0, 1.0]), 0), torch.zeros(2)])
    assert_fits(counts, expected)


# --- penalties and min_tokens ------------------------------------------------------------------


def test_penalties_follow_vllm_semantics():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 1.0, 3.0]]).repeat(3, 1)
    prompt = [[0, 1], [0, 1], [0, 1]]
    output = [[2, 2, 3], [2, 2, 3], [2, 2, 3]]
    params = [
        SamplingParams(repetition_penalty=2.0),
        SamplingParams(frequency_penalty=0.5, presence_penalty=0.3),
        SamplingParams(),  # neutral neighbour: untouched
    ]
    metadata = metadata_for(params, output_token_ids=output, prompt_token_ids=prompt, vocab=6)
    penalised = apply_penalties(logits, metadata)
    # repetition: prompt and output tokens; positive / 2, negative * 2.
    assert torch.allclose(penalised[0], torch.tensor([1.0, -2.0, 0.25, -1.0, 1.0, 3.0]))
    # frequency counts output occurrences, presence is 0/1; prompt tokens are not penalised.
    expected = torch.tensor([2.0, -1.0, 0.5 - 2 * 0.5 - 0.3, -0.5 - 0.5 - 0.3, 1.0, 3.0])
    assert torch.allclose(penalised[1], expected)
    assert torch.equal(penalised[2], logits[2])
    assert torch.equal(logits[0], torch.tensor([2.0, -1.0, 0.5, -0.5, 1.0, 3.0]))  # not mutated


def test_penalties_change_the_greedy_choice():
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]])
    params = [SamplingParams(temperature=0.0, frequency_penalty=2.0)]
    metadata = metadata_for(params, output_token_ids=[[1]], vocab=4)
    assert Sampler()(logits, metadata).sampled_token_ids.item() == 2
    metadata = metadata_for(params, output_token_ids=[[3]], vocab=4)
    assert Sampler()(logits, metadata).sampled_token_ids.item() == 1


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[0.0, 0.0, 2.0, 0.0, 0.0, 4.0, 0.0, 5.0]])  # 7 = EOS, 5 = stop id
    params = [
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[5], all_stop_token_ids=[7])
    ]
    short = metadata_for(params, output_token_ids=[[1]])
    assert Sampler()(logits, short).sampled_token_ids.item() == 2  # 7 and 5 masked
    reached = metadata_for(params, output_token_ids=[[1, 1, 1]])
    assert Sampler()(logits, reached).sampled_token_ids.item() == 7

    # Random rows too: the masked ids are never drawn.
    random_params = [SamplingParams(min_tokens=2, all_stop_token_ids=[7], stop_token_ids=[5])]
    metadata = metadata_for(random_params * 2000, output_token_ids=[[]] * 2000)
    sampled = Sampler(torch.Generator().manual_seed(0))(logits.expand(2000, -1), metadata)
    assert not torch.isin(sampled.sampled_token_ids, torch.tensor([5, 7])).any()


# --- seeding ----------------------------------------------------------------------------------


def _seeded_run(device, steps, batch_builder, sampler_seed):
    """Sample ``steps`` tokens for the seeded request; returns its tokens."""
    vocab = 1000
    torch.manual_seed(1234)
    step_logits = [torch.randn(vocab).to(device) * 2 for _ in range(max(steps) + 1)]
    target = SamplingParams(temperature=1.0, top_p=0.95, seed=42)
    params, row = batch_builder(target)
    tensors = SamplingTensors(vocab, device)
    tensors.update_batch(params, [[1, 2, 3]] * len(params))
    sampler = Sampler(torch.Generator(device=device).manual_seed(sampler_seed))
    noise_gen = torch.Generator().manual_seed(sampler_seed)
    outputs: list[list[int]] = [[] for _ in params]
    tokens = []
    for step in steps:
        outputs[row] = list(range(step))  # the target has generated `step` tokens so far
        logits = torch.randn(len(params), vocab, generator=noise_gen).to(device)
        logits[row] = step_logits[step]
        sampled = sampler(logits, tensors.metadata(outputs)).sampled_token_ids
        tokens.append(sampled[row].item())
    return tokens


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_row_is_independent_of_batch_and_preemption(device):
    steps = list(range(12))
    alone = _seeded_run(device, steps, lambda t: ([t], 0), sampler_seed=0)
    assert len(set(alone)) > 3  # the noise really changes with the position

    def crowded(target):
        neighbours = [
            SamplingParams(temperature=0.8),
            SamplingParams(temperature=0.0),
            SamplingParams(temperature=1.2, seed=7),
            SamplingParams(top_k=5, seed=42),  # same seed, different row: must not interfere
            SamplingParams(),
        ]
        return neighbours[:3] + [target] + neighbours[3:], 3

    assert _seeded_run(device, steps, crowded, sampler_seed=99) == alone
    # Preemption: the request is recomputed and positions 5.. are sampled again.
    replay = _seeded_run(device, steps[5:], crowded, sampler_seed=5)
    assert replay == alone[5:]

    other_seed = build_sampling_metadata(
        [SamplingParams(seed=43)], [[]], [[]], 1000, device
    )
    logits = torch.zeros(1, 1000, device=device)  # uniform: the token is decided by noise alone
    first = Sampler()(logits, metadata_for([SamplingParams(seed=42)], device, vocab=1000))
    second = Sampler()(logits, other_seed)
    assert first.sampled_token_ids.item() != second.sampled_token_ids.item()


def test_inverse_cdf_never_picks_a_zero_probability_token():
    from sparrow.sample.sampler import inverse_cdf

    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0], [0.0, 0.0, 1.0, 0.0, 0.0]])
    for u in (0.0, 0.25, 0.4999, 0.5, 0.75, 1.0 - 2**-24):
        ids = inverse_cdf(probs, torch.tensor([u, u])).tolist()
        assert ids[0] == (1 if u < 0.5 else 3) and ids[1] == 2, (u, ids)
    # u * total rounding up to the total still lands on the last token with probability > 0
    assert inverse_cdf(probs, torch.tensor([1.0, 1.0])).tolist() == [3, 2]


def test_a_batch_mixing_seeded_and_unseeded_rows_keeps_each_kind_exact():
    num_rows = 4_000  # even rows seeded (each its own seed), odd rows from the shared generator
    params = [SamplingParams(temperature=0.7, seed=row if row % 2 == 0 else None) for row in range(num_rows)]
    logits = LOGITS_8.expand(num_rows, -1).contiguous()
    sampled = Sampler(torch.Generator().manual_seed(0))(logits, metadata_for(params)).sampled_token_ids
    for start in (0, 1):
        counts = torch.bincount(sampled[start::2], minlength=8).to(torch.float64)
        assert_fits(counts, reference_filtered(temperature=0.7))


def test_step_seed_is_stable_and_spreads():
    assert step_seed(42, 0) == step_seed(42, 0)
    values = {step_seed(seed, position) for seed in range(30) for position in range(30)}
    assert len(values) == 900
    assert all(0 <= value < 2**64 for value in values)
    assert step_seed(-5, 3) >= 0  # negative seeds are fine


def test_cached_tensors_match_a_fresh_build():
    params = [
        SamplingParams(temperature=0.5, top_k=10, min_tokens=4, all_stop_token_ids=[2]),
        SamplingParams(temperature=0.0, repetition_penalty=1.3, logprobs=2),
        SamplingParams(seed=9, min_p=0.1, presence_penalty=0.5),
    ]
    prompts = [[1, 2], [3, 4, 5], [6]]
    tensors = SamplingTensors(50, "cpu")
    tensors.update_batch(params, prompts)
    outputs = [[7], [8, 9], []]
    cached = tensors.metadata(outputs)
    fresh = build_sampling_metadata(params, outputs, prompts, 50, "cpu")
    for name in ("temperature", "top_k", "top_p", "min_p", "presence_penalties",
                 "frequency_penalties", "repetition_penalties", "prompt_token_ids"):
        a, b = getattr(cached, name), getattr(fresh, name)
        assert (a is None and b is None) or torch.equal(a, b), name
    for metadata in (cached, fresh):  # min_tokens: row 0's EOS (2) is masked, nothing else
        masked = metadata.logits_processors.apply_non_argmax_invariant(torch.zeros(3, 50), owned=False)
        assert torch.isinf(masked).nonzero().tolist() == [[0, 2]]
    assert cached.seeded_rows.tolist() == fresh.seeded_rows.tolist() == [2]
    assert torch.equal(cached.seeded_uniforms, fresh.seeded_uniforms)
    assert cached.num_logprobs == [None, 2, None] and cached.max_num_logprobs == 2
    logits = torch.randn(3, 50)
    first = Sampler(torch.Generator().manual_seed(0))(logits, cached).sampled_token_ids
    second = Sampler(torch.Generator().manual_seed(0))(logits, fresh).sampled_token_ids
    assert torch.equal(first, second)
    # Metadata is safe to reuse: the seeded row does not advance between calls.
    again = Sampler(torch.Generator().manual_seed(1))(logits, cached).sampled_token_ids
    assert again[2] == first[2]


# --- logprobs ---------------------------------------------------------------------------------


def reference_rank(row_logprobs: torch.Tensor, token_id: int) -> int:
    return 1 + int((row_logprobs > row_logprobs[token_id]).sum())


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_are_raw_and_ranks_are_exact(device):
    torch.manual_seed(3)
    logits = torch.randn(4, 50)
    logits[3, [4, 9]] = 10.0  # a tie at the top of row 3
    logits = logits.to(device)
    params = [
        SamplingParams(logprobs=None),
        SamplingParams(logprobs=0, temperature=0.3, repetition_penalty=1.5),
        SamplingParams(logprobs=3, top_k=4, frequency_penalty=1.0),
        SamplingParams(logprobs=5, temperature=0.0),
    ]
    metadata = metadata_for(params, device, output_token_ids=[[1], [2], [3, 3], [9]],
                            prompt_token_ids=[[0]] * 4, vocab=50)
    assert metadata.max_num_logprobs == 5
    out = Sampler()(logits, metadata)
    lists = out.logprobs_lists()
    reference = torch.log_softmax(logits.double().cpu(), dim=-1)
    sampled = out.sampled_token_ids.cpu().tolist()
    assert lists[0] is None
    for row in (1, 2, 3):
        k = params[row].logprobs
        entry = lists[row]
        assert len(entry.token_ids) == len(entry.logprobs) == len(entry.ranks) == 1 + k
        assert entry.token_ids[0] == sampled[row]
        top = reference[row].topk(k).indices.tolist()
        assert sorted(entry.token_ids[1:]) == sorted(top)
        for token_id, logprob, rank in zip(entry.token_ids, entry.logprobs, entry.ranks):
            assert logprob == pytest.approx(reference[row, token_id].item(), abs=1e-5)
            assert rank == reference_rank(reference[row], token_id)
    assert lists[3].ranks[1:3] == [1, 1]  # tied tokens share a rank
    assert lists[3].ranks[3] == 3


def test_compute_token_logprobs_for_prompt_positions():
    torch.manual_seed(4)
    logprobs = torch.log_softmax(torch.randn(5, 30), dim=-1)  # [num_positions, V]
    next_tokens = torch.tensor([3, 0, 29, 7, 7])
    entries = compute_token_logprobs(logprobs, next_tokens, 2)
    assert len(entries) == 5
    for position, entry in enumerate(entries):
        assert entry.token_ids[0] == next_tokens[position].item()
        assert entry.token_ids[1:] == logprobs[position].topk(2).indices.tolist()
        assert entry.ranks[1:] == [1, 2]
        assert entry.ranks[0] == reference_rank(logprobs[position], entry.token_ids[0])
        assert entry.logprobs[0] == pytest.approx(logprobs[position, entry.token_ids[0]].item())
    assert compute_token_logprobs(logprobs, next_tokens, 0)[0].token_ids == [3]


def test_bad_inputs_raise_clear_errors():
    metadata = metadata_for([SamplingParams()], vocab=8)
    with pytest.raises(ValueError, match="vocab_size"):
        Sampler()(torch.zeros(1, 9), metadata)
    with pytest.raises(ValueError, match="batch"):
        Sampler()(torch.zeros(2, 8), metadata)
    with pytest.raises(RuntimeError, match="update_batch"):
        SamplingTensors(8, "cpu").metadata([[]])


def test_logit_bias_shifts_logits_after_the_logprobs_are_taken():
    params = [SamplingParams(temperature=0.0, logit_bias={3: 50.0}, logprobs=1), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, logit_bias={0: -100.0, 1: 2.5})]
    logits = torch.tensor([[5.0, 1.0, 0.0, 0.0, 0.0]] * 3)
    out = Sampler()(logits, metadata_for(params, vocab=5))
    assert out.sampled_token_ids.tolist() == [3, 0, 1]
    # logprobs are the model's own distribution, before the bias
    assert out.logprobs_lists()[0].token_ids[0] == 3 and out.logprobs_lists()[0].ranks[0] > 1
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: 101.0})
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={-1: 1.0})


@pytest.mark.parametrize("vocab", [4096, 1000, 151936, 999])  # chunks of 1024, 8 (whole-row scan), 128, none
def test_two_level_inverse_cdf_equals_a_full_scan(vocab):
    from sparrow.sample.sampler import inverse_cdf

    generator = torch.Generator().manual_seed(vocab)
    probs = torch.rand(16, vocab, generator=generator) ** 8  # skewed, with many near-zero entries
    probs[:, ::3] = 0.0  # zero-probability tokens must never come out
    probs[0, :] = 0.0
    probs[0, vocab // 2] = 1.0  # all the mass on one token
    probs = probs / probs.sum(dim=-1, keepdim=True)
    uniforms = torch.rand(16, generator=generator, dtype=torch.float64)
    uniforms[1], uniforms[2] = 0.0, 1.0 - 2**-53
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    reference = torch.searchsorted(cdf, (uniforms.unsqueeze(1) * cdf[:, -1:]), right=True).squeeze(1)
    reference = torch.minimum(reference, (cdf < cdf[:, -1:]).sum(dim=-1))
    got = inverse_cdf(probs, uniforms)
    assert got.tolist() == reference.tolist()
    assert bool((probs.gather(1, got[:, None]) > 0).all())


def test_float32_sums_for_devices_without_float64(monkeypatch):
    import sparrow.sample.sampler as sampler_module

    monkeypatch.setattr(sampler_module, "sum_dtype", lambda device: torch.float32)
    counts = draw_counts(SamplingParams(temperature=0.7), 20_000, "cpu", seed=0)
    assert_fits(counts, reference_filtered(temperature=0.7))
    probs = torch.rand(8, 4096, generator=torch.Generator().manual_seed(1))
    probs[:, 1::2] = 0.0
    ids = sampler_module.inverse_cdf(probs / probs.sum(-1, keepdim=True), torch.rand(8, dtype=torch.float32))
    assert bool((ids % 2 == 0).all())


def test_allowed_token_ids_restrict_greedy_and_random_rows():
    params = [SamplingParams(temperature=0.0, allowed_token_ids=[2, 5], logprobs=1),
              SamplingParams(temperature=1.0, allowed_token_ids=[6]), SamplingParams(temperature=0.0)]
    logits = torch.tensor([[9.0, 0.0, 1.0, 0.0, 0.0, 3.0, 0.0, 0.0]] * 3)
    out = Sampler(torch.Generator().manual_seed(0))(logits, metadata_for(params))
    assert out.sampled_token_ids.tolist() == [5, 6, 0]
    assert out.logprobs_lists()[0].ranks[0] == 2  # logprobs stay the model's own
    many = [SamplingParams(temperature=1.0, allowed_token_ids=[1, 3, 4])] * 3000
    sampled = Sampler(torch.Generator().manual_seed(1))(LOGITS_8.expand(3000, -1).contiguous(),
                                                        metadata_for(many)).sampled_token_ids
    assert set(sampled.tolist()) == {1, 3, 4}
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
