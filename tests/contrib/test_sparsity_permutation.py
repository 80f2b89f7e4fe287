"""Model-level channel permutation for ASP (``permutation_lib``), its search kernels and the
``permutation_search_cuda`` compatibility module."""

import io
import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from apex.contrib.sparsity import ASP
from apex.contrib.sparsity.permutation_lib import Permutation, replicate_sequence
from apex.contrib.sparsity.permutation_search_kernels import accelerated_search_for_good_permutation
from apex.contrib.sparsity.permutation_search_kernels.channel_swap import Channel_Swap
from apex.contrib.sparsity.permutation_search_kernels.exhaustive_search import Exhaustive_Search
from apex.contrib.sparsity.permutation_search_kernels.permutation_utilities import (
    apply_2_to_4,
    sum_after_2_to_4,
    try_swap,
)


@pytest.fixture(autouse=True)
def _fresh_asp():
    ASP.reset()
    yield
    ASP.reset()


def _rel(out, ref):
    return float((out.detach().double() - ref.detach().double()).norm() / ref.detach().double().norm())


def _sparse_records(model):
    """ASP's records for every eligible Linear/Conv/MHA weight, without registering anything."""
    recs = []
    for name, mod in model.named_modules():
        for p_name in ("weight", "in_proj_weight"):
            p = getattr(mod, p_name, None)
            if isinstance(mod, (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.MultiheadAttention)) \
                    and isinstance(p, torch.nn.Parameter) and p.dim() >= 2 and p.shape[0] % 8 == 0 \
                    and p.shape[1] % 16 == 0:
                recs.append((name, mod, p_name, p, None, None))
    return recs


def _permute(model):
    Permutation.set_permutation_params_from_asp(model, _sparse_records(model), [], 0)
    assert Permutation.permute_model(model)
    return Permutation.get_permutation_stats()


def _kept(model):
    return sum(sum_after_2_to_4(r[3].detach().movedim(1, -1).reshape(-1, r[3].shape[1])) for r in
               _sparse_records(model))


# ---------------------------------------------------------------- models


class MLP(torch.nn.Module):
    def __init__(self, d_in=16, hidden=(32, 48), d_out=8):
        super().__init__()
        dims = (d_in, *hidden)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.drop = torch.nn.Dropout(0.0)
        self.head = torch.nn.Linear(dims[-1], d_out)

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = self.drop(torch.nn.functional.gelu(layer(x)) if i % 2 else torch.relu(layer(x)))
        return self.head(x)


class ResCNN(torch.nn.Module):
    """Conv-BN-ReLU stem, a residual block, a grouped conv, a concat, pooling and a linear head."""

    def __init__(self, c=16):
        super().__init__()
        self.stem = torch.nn.Sequential(torch.nn.Conv2d(3, c, 3, padding=1), torch.nn.BatchNorm2d(c),
                                        torch.nn.ReLU())
        self.a1 = torch.nn.Conv2d(c, 2 * c, 3, padding=1)
        self.bn1 = torch.nn.BatchNorm2d(2 * c)
        self.a2 = torch.nn.Conv2d(2 * c, c, 1)
        self.grouped = torch.nn.Conv2d(c, c, 3, padding=1, groups=2)  # 8 channels per group
        self.side = torch.nn.Conv2d(c, c, 1)
        self.offset = torch.nn.Parameter(torch.randn(c, 1, 1))
        self.merge = torch.nn.Conv2d(2 * c, 32, 1)
        self.post = torch.nn.Conv2d(c, 32, 1)  # its input, a grouped conv's output, keeps its order
        self.pool = torch.nn.AdaptiveAvgPool2d(1)
        self.head = torch.nn.Linear(32, 8)

    def forward(self, x):
        s = self.stem(x)
        r = s + self.a2(torch.relu(self.bn1(self.a1(s))))
        y = torch.cat([self.side(r) + self.offset, r], dim=1)
        z = self.merge(y) + self.post(self.grouped(r))
        return self.head(torch.flatten(self.pool(torch.relu(z)), 1))


class Block(torch.nn.Module):
    """Pre-LN transformer block on an embedded input, with a final LayerNorm and head."""

    def __init__(self, d_in=12, d=32, heads=4, ff=64, batch_first=True):
        super().__init__()
        self.embed = torch.nn.Linear(d_in, d)
        self.ln1 = torch.nn.LayerNorm(d)
        self.attn = torch.nn.MultiheadAttention(d, heads, batch_first=batch_first)
        self.ln2 = torch.nn.LayerNorm(d)
        self.ff1 = torch.nn.Linear(d, ff)
        self.ff2 = torch.nn.Linear(ff, d)
        self.ln3 = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, 8)

    def forward(self, x):
        h = self.embed(x)
        q = self.ln1(h)
        h = h + self.attn(q, q, q, need_weights=False)[0]
        h = h + self.ff2(torch.nn.functional.gelu(self.ff1(self.ln2(h))))
        return self.head(self.ln3(h))


def _check_same_function(model, shape, expect_c, expect_k, train=False):
    torch.manual_seed(1)
    xs = [torch.randn(shape) for _ in range(2)]
    model.train(train)
    with torch.no_grad():
        ref = [model(x) for x in xs]
    kept_before = _kept(model)
    c, k, missed = _permute(model)
    assert set(expect_c) <= set(c) and set(expect_k) <= set(k) and not missed, (c, k)
    with torch.no_grad():
        for x, r in zip(xs, ref):
            assert _rel(model(x), r) <= 1e-6
    assert _kept(model) >= kept_before
    return c, k


@pytest.mark.parametrize("train", [False, True])
def test_mlp_permutation_keeps_the_function(train):
    torch.manual_seed(0)
    model = MLP()
    c, k = _check_same_function(model, (5, 16), ["layers.1.weight", "head.weight"],
                                ["layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias"], train)
    assert "layers.0.weight" not in c  # the model input's channel order is fixed


@pytest.mark.parametrize("train", [False, True])
def test_cnn_with_batchnorm_residual_concat_keeps_the_function(train):
    torch.manual_seed(0)
    model = ResCNN()
    model.train()
    with torch.no_grad():  # non-trivial running statistics for the eval-mode case
        model(torch.randn(4, 3, 6, 6))
    c, k = _check_same_function(
        model, (2, 3, 7, 5),
        expect_c=["a1.weight", "a2.weight", "grouped.weight", "side.weight", "merge.weight", "head.weight"],
        expect_k=["stem.0.weight", "stem.1.running_mean", "stem.1.running_var", "a2.bias", "offset", "side.weight",
                  "a1.weight", "bn1.running_var", "merge.bias", "post.weight"],
        train=train)
    assert "grouped.weight" not in k and "post.weight" not in c  # a grouped conv's outputs keep their order


@pytest.mark.parametrize("batch_first", [True, False])
def test_transformer_block_with_layernorm_keeps_the_function(batch_first):
    torch.manual_seed(0)
    model = Block(batch_first=batch_first)
    _check_same_function(model, (3, 5, 12),
                         expect_c=["attn.in_proj_weight", "ff1.weight", "ff2.weight", "head.weight"],
                         expect_k=["embed.weight", "ln1.weight", "ln3.bias", "attn.out_proj.weight", "ff1.bias"])


@settings(max_examples=3, deadline=None)
@given(h1=st.sampled_from([16, 32, 48]), h2=st.sampled_from([16, 40]), seed=st.integers(0, 100))
def test_mlp_sizes(h1, h2, seed):
    torch.manual_seed(seed)
    # the head is searched only when its weight is eligible for 2:4 (input channels a multiple of 16)
    _check_same_function(MLP(16, (h1, h2), 8), (3, 16), ["head.weight"] if h2 % 16 == 0 else [], [])


def test_constructed_case_gains_strictly():
    # the four largest input channels of `second` sit in one group of 4: 2:4 must drop two of them
    torch.manual_seed(0)
    first, second = torch.nn.Linear(8, 16), torch.nn.Linear(16, 16)
    with torch.no_grad():
        second.weight.uniform_(-0.1, 0.1)
        second.weight[:, :4] = 10.0
    model = torch.nn.Sequential(first, torch.nn.ReLU(), second)
    before = sum_after_2_to_4(second.weight)
    x = torch.randn(4, 8)
    ref = model(x).detach()
    c, k, _ = _permute(model)
    assert c == ["2.weight"] and k == ["0.weight", "0.bias"]
    assert sum_after_2_to_4(second.weight) > before + 70  # all four large channels are kept now
    assert _rel(model(x), ref) <= 1e-6


def test_untraceable_models_and_blocked_channels_are_left_alone():
    class Dynamic(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 32), torch.nn.Linear(32, 16)

        def forward(self, x):
            h = self.a(x)
            if h.sum() > 0:  # data-dependent control flow: torch.fx cannot trace it
                h = -h
            return self.b(h)

    class Blocked(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Conv2d(4, 32, 1), torch.nn.Conv2d(32, 16, 1)
            self.c, self.d = torch.nn.Conv2d(32, 32, 1), torch.nn.Conv2d(32, 16, 1)
            self.lrn, self.gn = torch.nn.LocalResponseNorm(3), torch.nn.GroupNorm(4, 32)

        def forward(self, x):
            h = self.a(x)
            t = self.c(x.new_zeros(1, 32, 1, 1) + self.gn(h))
            return self.b(self.lrn(h)) + self.d(t.transpose(2, 3))

    for cls in (Dynamic, Blocked):
        torch.manual_seed(0)
        model = cls()
        before = {n: t.clone() for n, t in model.state_dict().items()}
        Permutation.set_permutation_params_from_asp(model, _sparse_records(model), [], 0)
        assert Permutation.permute_model(model) == (cls is Blocked)
        assert Permutation.get_permutation_stats() == ([], [], [])
        assert all(torch.equal(before[n], t) for n, t in model.state_dict().items())
    with pytest.raises(TypeError, match="model"):
        Permutation.permute_model("not a model")


def test_replicate_sequence():
    assert replicate_sequence([1, 0, 2], 2) == [1, 0, 2, 4, 3, 5]


# ---------------------------------------------------------------- ASP with permutation


def _train(model, opt, shape, steps):
    for _ in range(steps):
        loss = model(torch.randn(shape)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_asp_permutes_then_prunes_and_masks_survive_training():
    torch.manual_seed(0)
    model = Block()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ASP.init_model_for_pruning(model, "m4n2_1d", verbosity=0, allow_recompute_mask=True)
    ASP.init_optimizer_for_pruning(opt)
    _train(model, opt, (2, 5, 12), 2)  # dense: builds Adam state that must follow the permutation
    exp_avg = {id(p): opt.state[p]["exp_avg"].clone() for p in model.parameters()}
    x = torch.randn(2, 5, 12)
    with torch.no_grad():
        dense_out = model(x)
    no_perm = sum(sum_after_2_to_4(r[3].detach()) for r in ASP._sparse_parameters)
    ASP.compute_sparse_masks()
    assert ASP.is_sparsity_enabled()
    applied = {}
    for t, d, i in Permutation._applied:  # a weight may be permuted along C and along K
        applied.setdefault(id(t), []).append((d, i))
    assert len(applied[id(model.ff2.weight)]) == 2
    for p in model.parameters():  # optimizer state permuted exactly like its parameter
        expect = exp_avg[id(p)]
        for d, i in applied.get(id(p), []):
            expect = expect.index_select(d, i)
        assert torch.equal(opt.state[p]["exp_avg"], expect)
    # dense weights (kept + pruned) compute the original function: the permutation changed nothing else
    with torch.no_grad():
        for *_, p, _mask, pruned in ASP._sparse_parameters:
            p.add_(pruned)
        assert _rel(model(x), dense_out) <= 1e-6
        for *_, p, mask, _pruned in ASP._sparse_parameters:
            p.mul_(mask)
    kept = sum(float(r[3].detach().abs().sum(dtype=torch.float64)) for r in ASP._sparse_parameters)
    assert kept >= no_perm * (1 - 1e-9)
    _train(model, opt, (2, 5, 12), 3)
    for *_, p, mask, _ in ASP._sparse_parameters:
        rows = p.detach().movedim(1, -1).reshape(-1, 4)
        assert bool(((rows != 0).sum(1) == 2).all()) and bool((p[~mask] == 0).all())
        assert torch.equal(mask.movedim(1, -1).reshape(-1, 4).sum(1), torch.full((rows.shape[0],), 2))


def test_checkpoint_restores_permuted_weights_masks_and_training():
    torch.manual_seed(0)
    model = ResCNN()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    ASP.init_model_for_pruning(model, "m4n2_1d", verbosity=0)
    ASP.init_optimizer_for_pruning(opt)
    ASP.compute_sparse_masks()
    assert Permutation.get_permutation_stats()[0]  # something was permuted
    _train(model, opt, (2, 3, 5, 5), 2)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    ASP.reset()

    torch.manual_seed(5)
    clone = ResCNN()
    opt2 = torch.optim.SGD(clone.parameters(), lr=1e-2, momentum=0.9)
    ASP.init_model_for_pruning(clone, "m4n2_1d", verbosity=0)
    ASP.init_optimizer_for_pruning(opt2)
    buf.seek(0)
    ckpt = torch.load(buf)
    clone.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    assert ASP.is_sparsity_enabled()
    clone.eval(), model.eval()
    x = torch.randn(2, 3, 6, 6)
    assert torch.equal(clone(x), model(x))
    clone.train()
    _train(clone, opt2, (2, 3, 5, 5), 2)
    for *_, p, mask, _ in ASP._sparse_parameters:
        assert bool((p[~mask] == 0).all()) and int(mask.sum()) * 2 == mask.numel()


def test_set_permutation_saving_params_dumps_the_graph(tmp_path):
    model = MLP()
    ASP.init_model_for_pruning(model, verbosity=0, allow_permutation=False)
    ASP.set_permutation_saving_params(True, True, str(tmp_path))
    ASP.compute_sparse_masks()
    assert (tmp_path / "model_offline_permutation_graph.json").exists()
    assert "head.weight" in Permutation.get_permutation_stats()[0]


def test_reset_forgets_the_graph_dump(tmp_path, monkeypatch):
    """After ``ASP.reset()`` a search on another model writes nothing, wherever the working directory is."""
    ASP.init_model_for_pruning(MLP(), verbosity=0, allow_permutation=False)
    ASP.set_permutation_saving_params(True, True, str(tmp_path / "asked"))
    ASP.reset()
    monkeypatch.chdir(tmp_path)
    ASP.init_model_for_pruning(MLP(), verbosity=0, allow_permutation=False)
    Permutation.set_permutation_params_from_asp(ASP._model, ASP._sparse_parameters, [], 0)
    assert Permutation.permute_model(ASP._model)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


# ---------------------------------------------------------------- search kernels


@pytest.mark.parametrize("strategy", ["exhaustive", "channel swap", "progressive channel swap"])
def test_every_strategy_improves_and_returns_a_permutation(strategy):
    w = torch.randn(24, 32, generator=torch.Generator().manual_seed(0))
    perm = accelerated_search_for_good_permutation(w, {"strategy": strategy, "escape_attempts": 2})
    assert sorted(perm) == list(range(32))
    assert sum_after_2_to_4(w[:, perm]) > sum_after_2_to_4(w)
    assert accelerated_search_for_good_permutation(w, {"strategy": "user defined"}) == list(range(32))


def test_channel_swap_reaches_a_local_optimum_and_exhaustive_a_pair_optimum():
    w = np.random.default_rng(0).standard_normal((10, 16)).astype(np.float32)
    out, seconds, perm = Channel_Swap(w)
    assert isinstance(out, np.ndarray) and np.array_equal(out, w[:, perm]) and seconds >= 0
    assert all(try_swap(out, i, j)[1] <= 1e-9 for i, j in itertools.combinations(range(16), 2))
    out, _, perm = Exhaustive_Search(torch.from_numpy(w), stripe_group_size=8)
    for s0, s1 in itertools.combinations(range(4), 2):  # no re-split of any two stripes does better
        cols = list(range(4 * s0, 4 * s0 + 4)) + list(range(4 * s1, 4 * s1 + 4))
        pair = out[:, cols]
        best = max(sum_after_2_to_4(pair[:, list(c) + [x for x in range(8) if x not in c]])
                   for c in itertools.combinations(range(8), 4))
        assert sum_after_2_to_4(pair) >= best - 1e-6
    with pytest.raises(ValueError, match="permutation"):
        Channel_Swap(w, permutation=[0] * 16)


def test_apply_2_to_4_and_try_swap():
    w = torch.randn(6, 8, dtype=torch.float64)
    kept = sum_after_2_to_4(w)
    pruned = apply_2_to_4(w.clone())
    assert float(pruned.abs().sum()) == pytest.approx(kept) and int((pruned != 0).sum()) == 24
    swapped = w.clone()
    swapped[:, [1, 6]] = swapped[:, [6, 1]]
    assert try_swap(w, 1, 6)[1] == pytest.approx(sum_after_2_to_4(swapped) - kept)


def test_permutation_search_cuda_compat_module():
    import permutation_search_cuda as k

    rng = np.random.default_rng(0)
    m = rng.standard_normal((6, 16)).astype(np.float32)
    out = np.zeros(1, np.float32)
    assert k.sum_after_2_to_4(m.ravel(), 6, 16, 4, 12, 1, 32, out) == 0
    assert out[0] == pytest.approx(sum_after_2_to_4(m[:, 4:12]), rel=1e-6)
    swaps = np.zeros(32, np.float32)
    k.build_swap_map(m.ravel(), 6, 16, np.array([0, 2, 1, 3], np.uint32), swaps)
    for pair, (s0, s1) in enumerate([(0, 2), (1, 3)]):
        for c0, c1 in itertools.product(range(4), range(4)):
            sw = m.copy()
            sw[:, [4 * s0 + c0, 4 * s1 + c1]] = sw[:, [4 * s1 + c1, 4 * s0 + c0]]
            expect = sum_after_2_to_4(sw) - sum_after_2_to_4(m)
            assert swaps[16 * pair + 4 * c0 + c1] == pytest.approx(expect, abs=1e-5)
    perms = np.array([list(range(8)), [0, 4, 2, 3, 1, 5, 6, 7], [4, 5, 2, 3, 0, 1, 6, 7]], np.uint32)
    imp, idx = np.zeros(2, np.float32), np.zeros(2, np.uint32)
    k.build_permute_map(m.ravel(), 6, 16, np.array([0, 1, 2, 3], np.uint32), 2, 2, perms.ravel(), 8, imp, idx)
    for g, stripes in enumerate([(0, 1), (2, 3)]):
        cols = [4 * s + i for s in stripes for i in range(4)]
        sums = [sum_after_2_to_4(m[:, cols][:, p]) for p in perms]
        assert imp[g] == pytest.approx(max(sums) - sums[0], abs=1e-5)
        assert idx[g] == (int(np.argmax(sums)) if max(sums) > sums[0] else 0)
    one_imp, one_idx = np.zeros(1, np.float32), np.zeros(1, np.uint32)
    k.check_permutations(m.ravel(), 6, 16, np.array([2, 3], np.uint32), 2, 1, perms.ravel(), 3, one_imp, one_idx)
    assert one_imp[0] == pytest.approx(imp[1], abs=1e-6) and one_idx[0] == idx[1]


def test_shared_module_tied_embedding_and_view_flatten():
    class Shared(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(40, 32)
            self.a, self.b = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)
            self.conv = torch.nn.Conv2d(3, 16, 1)
            self.fc = torch.nn.Linear(16 * 4, 32)
            self.out = torch.nn.Linear(32, 40, bias=False)
            self.out.weight = self.emb.weight  # tied: the head's C is the embedding's channel dim

        def forward(self, tokens, img):
            h = self.emb(tokens)
            h = self.a(torch.relu(self.b(h))) + self.a(h)  # `a` is called on two different spaces
            c = self.conv(img)
            return self.out(h), self.fc(c.view(c.size(0), -1))

    torch.manual_seed(0)
    model = Shared()
    tokens, img = torch.randint(0, 40, (2, 5)), torch.randn(2, 3, 2, 2)
    ref = torch.cat([t.detach().flatten() for t in model(tokens, img)])
    recs = [(n, m, "weight", m.weight, None, None) for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and m.weight.shape[1] % 16 == 0]
    Permutation.set_permutation_params_from_asp(model, recs, [], 0)
    assert Permutation.permute_model(model)
    c, k, missed = Permutation.get_permutation_stats()
    assert not missed and "b.weight" in k and "a.weight" in c and "emb.weight" in k
    assert "conv.weight" not in k  # the view mixes its channels with the pixels: blocked
    assert _rel(torch.cat([t.flatten() for t in model(tokens, img)]), ref) <= 1e-6
