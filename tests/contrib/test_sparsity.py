import itertools
import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from apex.contrib.sparsity import ASP, create_mask
from apex.contrib.sparsity import sparse_masklib as ml

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def _distinct(shape, dtype=torch.float32, seed=0):
    # distinct magnitudes so "the largest" is unambiguous in every dtype
    g = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    mags = (torch.randperm(n, generator=g).double() + 1) / n
    signs = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    return (mags * signs).reshape(shape).to(dtype)


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 9), groups=st.integers(1, 6), extra=st.integers(0, 3),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 1000))
def test_1d_keeps_the_two_largest_of_every_four(rows, groups, extra, dtype, seed):
    cols = 4 * groups + extra
    x = _distinct((rows, cols), torch.float64, seed).to(dtype)  # ties after rounding are allowed below
    mask = create_mask(x, "m4n2_1d")
    assert mask.dtype == x.dtype and mask.shape == x.shape
    assert set(mask.unique().tolist()) <= {0.0, 1.0}
    a = x.double().abs()
    for r in range(rows):
        for g0 in range(0, cols, 4):
            m = mask[r, g0:g0 + 4].bool()
            v = a[r, g0:g0 + 4]
            assert int(m.sum()) == min(2, v.numel())
            if m.sum() < v.numel():
                assert v[m].min() >= v[~m].max()


def test_1d_on_a_non_contiguous_tensor_equals_the_contiguous_one():
    x = torch.randn(24, 16).t()
    assert not x.is_contiguous()
    assert torch.equal(create_mask(x), create_mask(x.contiguous()))


@pytest.mark.parametrize("shape", [(8, 16, 3), (8, 16, 3, 2), (8, 16, 2, 1, 3)])
def test_conv_weights_are_pruned_along_the_input_channels(shape):
    w = _distinct(shape)
    mask = create_mask(w, "m4n2_1d")
    # move C last and check every run of 4 input channels independently
    cl = w.movedim(1, -1).reshape(-1, shape[1])
    ml_ = mask.movedim(1, -1).reshape(-1, shape[1])
    ref = ml.mn_1d_best(cl, 4, 2).to(mask.dtype)
    assert torch.equal(ml_, ref)
    assert torch.equal(ml_.reshape(-1, 4).sum(1), torch.full((ml_.numel() // 4,), 2.0))


def test_1d_vector():
    x = _distinct((12,))
    mask = create_mask(x)
    assert mask.shape == (12,) and torch.equal(mask.reshape(3, 4).sum(1), torch.full((3,), 2.0))


def test_valid_2d_patterns_are_the_90_doubly_2_of_4_blocks():
    pats = ml.compute_valid_2d_patterns(4, 2)
    ref = set()
    for ones in itertools.combinations(range(16), 8):
        b = torch.zeros(16)
        b[list(ones)] = 1
        b = b.reshape(4, 4)
        if (b.sum(0) == 2).all() and (b.sum(1) == 2).all():
            ref.add(tuple(b.flatten().tolist()))
    assert len(ref) == 90
    assert {tuple(p.flatten().tolist()) for p in pats} == ref
    assert ml.compute_valid_1d_patterns(4, 2).shape == (6, 4)


def _best_block_score(block):
    pats = ml.compute_valid_2d_patterns(4, 2).double()
    return max(float((block * p).sum()) for p in pats)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_2d_best_maximises_kept_magnitude_and_is_valid_both_ways(dtype):
    x = torch.randn(12, 16, dtype=torch.float64).to(dtype)
    mask = create_mask(x, "m4n2_2d_best")
    a = x.double().abs()
    md = mask.double()
    assert torch.equal(md.reshape(12, 4, 4).sum(-1), torch.full((12, 4), 2.0, dtype=torch.float64))
    assert torch.equal(md.t().reshape(16, 3, 4).sum(-1), torch.full((16, 3), 2.0, dtype=torch.float64))
    for i in range(0, 12, 4):
        for j in range(0, 16, 4):
            blk = a[i:i + 4, j:j + 4]
            got = float((blk * md[i:i + 4, j:j + 4]).sum())
            # bf16 inputs are scored in fp32: exact up to fp32 summation order
            assert got == pytest.approx(_best_block_score(blk), rel=1e-6)


def _greedy_reference(a):
    # sequential greedy on one block: visit from the largest magnitude down, stable for ties
    order = sorted(range(16), key=lambda k: -float(a.flatten()[k]))
    rows, cols, keep = [0] * 4, [0] * 4, torch.zeros(16)
    for k in order:
        r, c = divmod(k, 4)
        if rows[r] < 2 and cols[c] < 2:
            keep[k] = 1
            rows[r] += 1
            cols[c] += 1
    return keep.reshape(4, 4)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_2d_greedy_matches_a_sequential_greedy_and_edges_stay_dense(seed):
    x = _distinct((9, 10), seed=seed)  # ragged: row 8 and columns 8-9 lie outside whole blocks
    mask = create_mask(x, "m4n2_2d_greedy")
    a = x.abs()
    for i in range(0, 8, 4):
        for j in range(0, 8, 4):
            blk = mask[i:i + 4, j:j + 4]
            assert torch.equal(blk, _greedy_reference(a[i:i + 4, j:j + 4]))
            assert (blk.sum(0) <= 2).all() and (blk.sum(1) <= 2).all()
    assert bool(mask[8:].all()) and bool(mask[:, 8:].all())


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="pattern"):
        create_mask(torch.randn(4, 8), "m4n3_1d")
    with pytest.raises(TypeError, match="tensor"):
        create_mask([[1.0, 2.0, 3.0, 4.0]])
    with pytest.raises(ValueError, match="dimensions"):
        create_mask(torch.tensor(1.0))


# ---------------------------------------------------------------- ASP


@pytest.fixture(autouse=True)
def _fresh_asp():
    ASP.reset()
    yield
    ASP.reset()


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(16, 16, 3, padding=1)   # weight (16, 16, 3, 3): eligible
        self.fc1 = torch.nn.Linear(16, 32)                 # weight (32, 16): eligible
        self.fc2 = torch.nn.Linear(32, 10)                 # weight (10, 32): 10 % 8 != 0, skipped
        self.norm = torch.nn.LayerNorm(32)

    def forward(self, x):
        h = self.conv(x).mean(dim=(2, 3))
        return self.fc2(self.norm(torch.relu(self.fc1(h))))


def _train(model, opt, steps=3):
    for _ in range(steps):
        loss = model(torch.randn(2, 16, 5, 5)).square().sum()
        opt.zero_grad()
        loss.backward()
        opt.step()


def _is_2_of_4(w):
    rows = w.detach().movedim(1, -1).reshape(-1, 4)
    return bool(((rows != 0).sum(1) <= 2).all())


def test_asp_prunes_eligible_layers_and_masks_survive_training(caplog):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    with caplog.at_level(logging.INFO, logger="apex.contrib.sparsity"):
        ASP.init_model_for_pruning(model, "m4n2_1d", allow_recompute_mask=True)
    assert ASP.already_init_asp_model()
    assert any("skipping" in r.getMessage() and "fc2" in r.getMessage() for r in caplog.records)
    assert hasattr(model.fc1, "__weight_mma_mask") and not hasattr(model.fc2, "__weight_mma_mask")
    ASP.init_optimizer_for_pruning(opt)
    _train(model, opt, 2)  # dense training: masks are all ones
    assert not ASP.is_sparsity_enabled()
    dense = {n: p.detach().clone() for n, p in model.named_parameters()}
    expected = {n: create_mask(dense[n + ".weight"]).bool() for n in ("conv", "fc1")}
    ASP.compute_sparse_masks()
    assert ASP.is_sparsity_enabled()
    for n in ("conv", "fc1"):
        w = getattr(model, n).weight
        assert torch.equal(w != 0, expected[n])
        assert torch.equal(w.detach(), dense[n + ".weight"] * expected[n])
    assert torch.equal(model.fc2.weight, dense["fc2.weight"])
    _train(model, opt, 3)  # AdamW with weight decay would move pruned weights without the patched step
    for n in ("conv", "fc1"):
        w = getattr(model, n).weight
        assert _is_2_of_4(w) and bool((w[~expected[n]] == 0).all())
        assert not torch.equal(w.detach(), dense[n + ".weight"] * expected[n])  # training did move the kept ones
    assert model.fc2.weight.count_nonzero() == model.fc2.weight.numel()


def test_restore_pruned_weights_gives_back_the_dense_weights():
    torch.manual_seed(1)
    model = Net()
    ASP.init_model_for_pruning(model, "m4n2_2d_best", verbosity=0, allow_recompute_mask=True)
    dense = model.fc1.weight.detach().clone()
    ASP.compute_sparse_masks()
    assert not torch.equal(model.fc1.weight, dense)
    ASP.restore_pruned_weights()
    assert torch.equal(model.fc1.weight, dense)
    assert not ASP.is_sparsity_enabled()
    # recomputing masks after more pruning restores first, so the result only depends on the dense weights
    ASP.compute_sparse_masks()
    first = model.fc1.weight.detach().clone()
    ASP.compute_sparse_masks()
    assert torch.equal(model.fc1.weight, first)


def test_recompute_without_stored_pruned_weights_raises_and_changes_nothing():
    model = Net()
    ASP.init_model_for_pruning(model, verbosity=0)
    ASP.compute_sparse_masks()
    before = {n: t.clone() for n, t in model.state_dict().items()}
    with pytest.raises(RuntimeError, match="allow_recompute_mask"):
        ASP.compute_sparse_masks()
    with pytest.raises(RuntimeError, match="allow_recompute_mask"):
        ASP.restore_pruned_weights()
    after = model.state_dict()
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_layer_name_filters_custom_layers_and_callable_calculator():
    class MyLinear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(8, 16))

    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16), MyLinear())
    calls = []

    def calc(p):
        calls.append(p.shape)
        return create_mask(p, "m4n2_1d").bool()

    ASP.init_model_for_pruning(model, calc, verbosity=0, whitelist=[torch.nn.Linear], disallowed_layer_names=["1"],
                               custom_layer_dict={MyLinear: ["w"]})
    ASP.compute_sparse_masks()
    assert calls == [torch.Size([16, 16]), torch.Size([8, 16])]
    assert _is_2_of_4(model[0].weight) and _is_2_of_4(model[2].w)
    assert model[1].weight.count_nonzero() == 256
    ASP.reset()
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
    ASP.init_model_for_pruning(model, verbosity=0, allowed_layer_names=["1"])
    ASP.compute_sparse_masks()
    assert model[0].weight.count_nonzero() == 256 and _is_2_of_4(model[1].weight)


def test_multihead_attention_in_proj_is_pruned():
    mha = torch.nn.MultiheadAttention(16, 2)
    ASP.init_model_for_pruning(mha, verbosity=0)
    ASP.compute_sparse_masks()
    assert _is_2_of_4(mha.in_proj_weight) and _is_2_of_4(mha.out_proj.weight)


def test_misuse_raises_runtime_errors():
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert not ASP.already_init_asp_model()
    with pytest.raises(RuntimeError, match="init_model_for_pruning"):
        ASP.init_optimizer_for_pruning(opt)
    with pytest.raises(ValueError, match="pattern"):
        ASP.init_model_for_pruning(model, "m8n2")
    assert not ASP.already_init_asp_model()
    with pytest.raises(ValueError, match="whitelist"):
        ASP.init_model_for_pruning(model, whitelist=[torch.nn.LayerNorm])
    ASP.init_model_for_pruning(model, verbosity=0)
    with pytest.raises(RuntimeError, match="initialized already"):
        ASP.init_model_for_pruning(model)
    ASP.init_optimizer_for_pruning(opt)
    with pytest.raises(RuntimeError, match="optimizer already"):
        ASP.init_optimizer_for_pruning(opt)
    ASP.reset()
    assert "step" not in vars(opt)  # the optimizer's own step is back


def test_prune_trained_model_and_permutation_params():
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ASP.set_permutation_saving_params(allow_permutation=False, save_permutation_graph=False)
    ASP.prune_trained_model(model, opt)
    assert ASP.is_sparsity_enabled()
    _train(model, opt, 2)
    assert _is_2_of_4(model.fc1.weight) and _is_2_of_4(model.conv.weight)


# ---------------------------------------------------------------- permutation search


def test_sum_after_2_to_4_matches_the_masked_sum():
    from apex.contrib.sparsity.permutation_search_kernels import sum_after_2_to_4

    w = torch.randn(12, 16, dtype=torch.float64)
    assert sum_after_2_to_4(w) == pytest.approx(float((w.abs() * create_mask(w)).sum()), rel=1e-12)
    assert sum_after_2_to_4(w.numpy()) == pytest.approx(sum_after_2_to_4(w), rel=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_permutation_search_finds_the_best_stripe_split_of_8_columns(seed):
    from apex.contrib.sparsity.permutation_search_kernels import (
        accelerated_search_for_good_permutation,
        sum_after_2_to_4,
    )

    w = torch.randn(6, 8, generator=torch.Generator().manual_seed(seed))
    best = max(sum_after_2_to_4(w[:, list(c) + [x for x in range(8) if x not in c]])
               for c in itertools.combinations(range(8), 4))
    perm = accelerated_search_for_good_permutation(w)
    assert sorted(perm) == list(range(8))
    assert sum_after_2_to_4(w[:, perm]) == pytest.approx(best, rel=1e-12)


def test_permutation_search_improves_and_the_permuted_pair_computes_the_same_function():
    from apex.contrib.sparsity.permutation_search_kernels import (
        accelerated_search_for_good_permutation,
        sum_after_2_to_4,
    )

    torch.manual_seed(3)
    first, second = torch.nn.Linear(8, 32), torch.nn.Linear(32, 16)
    perm = accelerated_search_for_good_permutation(second.weight)
    assert sorted(perm) == list(range(32)) and perm != list(range(32))
    assert sum_after_2_to_4(second.weight[:, perm]) > sum_after_2_to_4(second.weight)
    x = torch.randn(5, 8)
    ref = second(torch.relu(first(x)))
    with torch.no_grad():  # permute the first layer's outputs (K) and the second's inputs (C) together
        first.weight.copy_(first.weight[perm])
        first.bias.copy_(first.bias[perm])
        second.weight.copy_(second.weight[:, perm])
    assert_close = torch.testing.assert_close
    assert_close(second(torch.relu(first(x))), ref)
    with pytest.raises(ValueError, match="strategy"):
        accelerated_search_for_good_permutation(second.weight, {"strategy": "bogus"})
    with pytest.raises(ValueError, match="multiple of 4"):
        accelerated_search_for_good_permutation(torch.randn(4, 6))
