"""Kernels that promise IEEE fp32 results: the optimizers, the multi-tensor ops and the reductions that feed them.

Their results are compared with PyTorch's own fused kernels to about one ulp, so they must not use the
approximate instructions Triton emits on NVIDIA GPUs for plain fp32 arithmetic: ``/`` becomes
``div.full.f32`` (up to 2 ulp), ``tl.sqrt`` ``sqrt.approx.f32``, ``tl.rsqrt`` ``rsqrt.approx.f32``, ``tl.exp``
and ``tl.exp2`` ``ex2.approx.f32``, ``tl.log2`` ``lg2.approx.f32``. They use ``tl.div_rn`` / ``tl.sqrt_rn``.
The Triton interpreter computes every one of these exactly, and it passes Python-float arguments as fp64
where a GPU launch passes fp32, so neither class shows in an interpreted test. Two CPU checks:

* the PTX that these kernels compile to for sm_90 has no approximate instruction (an allow-list, with
  reasons, for the few that do not touch the results);
* interpreted, their results do not change when scalar arguments are rounded to fp32 as a GPU launch rounds
  them (``1 - beta2`` computed in the kernel from an fp32 ``beta2 = 0.999`` is 1.3e-5 off).
"""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest
import torch

from apex.testing import rel_error
from tests import _device
from tests._compiled import run_uninterpreted

ROOT = Path(__file__).resolve().parents[1]

# Kernel modules whose results are checked against PyTorch's fused kernels to the ulp.
IEEE_MODULES = ("apex._kernels.multi_tensor_adagrad", "apex._kernels.multi_tensor_adam",
                "apex._kernels.multi_tensor_axpby", "apex._kernels.multi_tensor_l2norm",
                "apex._kernels.multi_tensor_lamb", "apex._kernels.multi_tensor_novograd",
                "apex._kernels.multi_tensor_scale", "apex._kernels.multi_tensor_sgd", "apex._kernels._chunk_reduce",
                "apex._kernels.openfold_adam_swa", "apex._kernels.update_scale_hysteresis")
APPROXIMATE = re.compile(r"\b(div\.full|div\.approx|sqrt\.approx|rsqrt\.approx|rcp\.approx|ex2\.approx|lg2\.approx|"
                         r"sin\.approx|cos\.approx|tanh\.approx)(?:\.\w+)+")
# "module.kernel" -> {"div.full" (an instruction without its type suffixes): why it does not change a result}.
# Empty: none of these kernels needs an exception.
ALLOWED: dict[str, dict[str, str]] = {}


# ------------------------------------------------------------------------------------ the calls checked
def _t(*shape, gen, dtype=torch.float32, positive=False):
    x = torch.randn(*shape, generator=gen)
    return (x.abs() + 0.1 if positive else x).to(dtype)


def _lists(kinds, shapes=((5,), (300,), (7, 11)), seed=0):
    """One list per entry of ``kinds`` ("g", "p", "m", "v" for positive, "0" for zeros; an optional dtype)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for kind in kinds:
        kind, dtype = (kind, torch.float32) if isinstance(kind, str) else kind
        out.append([torch.zeros(s, dtype=dtype) if kind == "0" else _t(*s, gen=gen, dtype=dtype, positive=kind == "v")
                    for s in shapes])
    return out


def _flag():
    return torch.zeros(1, dtype=torch.int32)


def _adam(mode, capturable=False, master=False):
    import amp_C

    # Moments start at zero, as an optimizer's do: the first steps are all (1 - beta) * g terms.
    kinds = [(("g", torch.float16) if master else "g"), (("p", torch.float16) if master else "p"), "0", "0"]
    lists = _lists(kinds + (["p"] if master else []))
    if master:
        for half, full in zip(lists[1], lists[4]):
            full.copy_(half.float())
    for step in (1, 2, 3):
        if capturable:
            fn = amp_C.multi_tensor_adam_capturable_master if master else amp_C.multi_tensor_adam_capturable
            fn(2048, _flag(), lists, torch.tensor([1e-3]), 0.9, 0.999, 1e-8, torch.tensor([float(step)]), mode, 1,
               0.01, torch.tensor([0.5]))
        else:
            amp_C.multi_tensor_adam(2048, _flag(), lists, 1e-3, 0.9, 0.999, 1e-8, step, mode, 1, 0.01)
    return lists


def _sgd(nesterov):
    import amp_C

    lists = _lists(["g", "p", "m"])
    for first in (True, False, False):
        amp_C.multi_tensor_sgd(2048, _flag(), lists, 1e-4, 0.9, 0.1, 0.05, nesterov, first, False, 0.5)
    return lists


def _lars():
    import amp_C

    lists = _lists(["g", "p", "m"])
    for first in (True, False):
        gn = torch.stack([g.norm() for g in lists[0]])
        pn = torch.stack([p.norm() for p in lists[1]])
        amp_C.multi_tensor_lars(2048, _flag(), lists, gn, pn, 0.05, 0.02, 1e-8, 1e-4, 0.9, 0.1, False, first, False,
                                1.0, False)
    return lists


def _adagrad(mode):
    import amp_C

    lists = _lists(["g", "p", "v"])
    for _ in range(3):
        amp_C.multi_tensor_adagrad(2048, _flag(), lists, 1e-2, 1e-10, mode, 0.01)
    return lists


def _novograd(norm_type, moment_mode):
    import amp_C

    lists = _lists(["g", "p", "0"])
    norms = torch.zeros(3)
    for step in (1, 2, 3):
        amp_C.multi_tensor_novograd(2048, _flag(), lists, norms, 1e-2, 0.95, 0.98, 1e-8, step, 1, 0.01, 1,
                                    moment_mode, norm_type)
    return lists + [[norms]]


def _lamb(weight_decay, mp=False):
    import amp_C

    lists = _lists(["g", "p", "0", "0"])
    gn = torch.stack([g.norm() for g in lists[0]]).norm().reshape(1)
    for step in (1, 2, 3):
        if mp:
            amp_C.multi_tensor_lamb_mp(2048, _flag(), lists, torch.tensor([1e-2]), 0.9, 0.999, 1e-6,
                                       torch.tensor([step], dtype=torch.int32), 1, weight_decay, 1, 1, gn,
                                       torch.tensor([1.0]), False, torch.zeros(1), torch.tensor([0.5]))
        else:
            amp_C.multi_tensor_lamb(2048, _flag(), lists, 1e-2, 0.9, 0.999, 1e-6, step, 1, weight_decay, 1, 1, gn, 1.0,
                                    False)
    return lists


def _lamb_stages():
    import amp_C

    lists = _lists(["g", "p", "0", "0", "0"])
    gn = torch.stack([g.norm() for g in lists[0]]).norm().reshape(1)
    decay = torch.full((3,), 0.01)
    for step in range(3):
        amp_C.multi_tensor_lamb_stage1_cuda(2048, _flag(), lists, decay, step, 0.9, 0.999, 1e-6, gn, 1.0)
        _, pn = amp_C.multi_tensor_l2norm(2048, _flag(), [lists[1]], True)
        _, un = amp_C.multi_tensor_l2norm(2048, _flag(), [lists[4]], True)
        amp_C.multi_tensor_lamb_stage2_cuda(2048, _flag(), [lists[1], lists[4]], pn, un, 1e-2, 0.01, False)
    return lists


def _norms():
    import amp_C

    (x,) = _lists(["g"])
    out = [torch.empty_like(t) for t in x]
    results = [*amp_C.multi_tensor_l2norm(2048, _flag(), [x], True),
               *amp_C.multi_tensor_l2norm_mp(2048, _flag(), [x], True),
               *amp_C.multi_tensor_l2norm_scale(2048, _flag(), [x, out], 0.3, True),
               *amp_C.multi_tensor_unscale_l2norm(2048, _flag(), [x], torch.tensor([0.7]), True)]
    blended = [torch.full((3,), 2.0), torch.full((3,), 2.0)]
    amp_C.multi_tensor_norm_out_cuda(2048, _flag(), [x], blended[0], 0.98, 0.02, 2)
    amp_C.multi_tensor_norm_out_cuda(2048, _flag(), [x], blended[1], 0.98, 0.02, 0)
    return [results, out, blended]


def _elementwise():
    import amp_C

    x, y, out1, out2 = _lists(["g", "g", "0", "0"])
    amp_C.multi_tensor_scale(2048, _flag(), [x, out1], 0.3)
    amp_C.multi_tensor_axpby(2048, _flag(), [x, y, out2], 0.3, 0.7, -1)
    return [out1, out2]


def _hysteresis():
    import amp_C

    out = []
    for found in (0.0, 1.0):
        scale, growth, hyst = torch.tensor([65536.0]), torch.tensor([1], dtype=torch.int32), torch.tensor(
            [1], dtype=torch.int32)
        amp_C.update_scale_hysteresis(scale, growth, hyst, torch.tensor([found]), 2.0, 0.3, 2, 1)
        out.append(scale)
    return [out]


def _adam_swa(state_dtype=torch.float32):
    from apex.ops.openfold_adam_swa import adam_swa_step

    g, p, m, v = _lists([("g", state_dtype), ("p", state_dtype), ("0", state_dtype), ("0", state_dtype)])
    compute = [t.to(torch.bfloat16) for t in p]
    swa = [t.clone() for t in p]
    for step in (1, 2, 3):
        adam_swa_step(g, p, compute, swa, m, v, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                      bias_correction1=1 - 0.9 ** step, bias_correction2=1 - 0.999 ** step, swa_decay_rate=0.9,
                      first_average=step == 1, mode=0, step=step)
    return [p, m, v, swa]


CASES = {
    "adam": lambda: _adam(0), "adamw": lambda: _adam(1),
    "adam_capturable": lambda: _adam(1, capturable=True),
    "adam_capturable_master": lambda: _adam(0, capturable=True, master=True),
    "sgd": lambda: _sgd(False), "sgd_nesterov": lambda: _sgd(True), "lars": _lars,
    "adagrad": lambda: _adagrad(0), "adagrad_w": lambda: _adagrad(1),
    "novograd_l2": lambda: _novograd(2, 0), "novograd_max": lambda: _novograd(0, 1),
    "lamb": lambda: _lamb(0.01), "lamb_no_trust": lambda: _lamb(0.0), "lamb_mp": lambda: _lamb(0.01, mp=True),
    "lamb_stages": _lamb_stages, "norms": _norms, "scale_axpby": _elementwise, "hysteresis": _hysteresis,
    "adam_swa": _adam_swa, "adam_swa_fp64": lambda: _adam_swa(torch.float64),
}


# ------------------------------------------------------------------------------------- the PTX check
_PTX_SCRIPT = textwrap.dedent('''
    import importlib, json, re, sys
    from triton.runtime.jit import JITFunction
    from apex.testing.triton_compile import compile_only

    pattern = re.compile(sys.argv[1])
    found = {}
    with compile_only("cuda:90"):
        inner = JITFunction.run

        def capture(self, *args, **kwargs):
            kernel = inner(self, *args, **kwargs)
            if kernel is not None:
                seen = found.setdefault(f"{self.fn.__module__}.{self.fn.__name__}", {})
                for m in pattern.finditer(kernel.asm["ptx"]):
                    seen[m.group(0)] = seen.get(m.group(0), 0) + 1
            return kernel

        JITFunction.run = capture
        try:
            for spec in sys.argv[2:]:
                module, name, *args = spec.split(":")
                getattr(importlib.import_module(module), name)(*args)
        finally:
            JITFunction.run = inner
    print("PTX-FINDINGS " + json.dumps(found))
''')


def approximate_instructions(calls: list[str], cwd: Path = ROOT, timeout: int = 600) -> dict[str, dict[str, int]]:
    """``{kernel: {instruction: count}}`` over the sm_90 PTX of every kernel that ``calls`` compile: each is
    ``module:function`` or ``module:function:argument``, run on CPU tensors. Every compiled kernel is a key."""
    proc = run_uninterpreted(["-c", _PTX_SCRIPT, APPROXIMATE.pattern, *calls], cwd=cwd, timeout=timeout,
                             env={"APEX_BACKEND": "triton"})
    line = next(x for x in proc.stdout.splitlines() if x.startswith("PTX-FINDINGS "))
    return json.loads(line[len("PTX-FINDINGS "):])


def run_case(name: str) -> None:
    """Entry point of the PTX check's subprocess: one of :data:`CASES`."""
    CASES[name]()


def test_ieee_kernels_compile_without_approximate_instructions():
    pytest.importorskip("triton")
    from apex.testing.triton_compile import launched_kernels

    found = approximate_instructions([f"tests.test_ieee_kernels:run_case:{n}" for n in CASES])
    expected = {k for k in launched_kernels() if k.rsplit(".", 1)[0] in IEEE_MODULES}
    assert expected <= found.keys(), f"kernels the cases never compiled: {sorted(expected - found.keys())}"
    bad = {k: {i: c for i, c in instrs.items() if APPROXIMATE.match(i).group(1) not in ALLOWED.get(k, {})}
           for k, instrs in found.items() if k.rsplit(".", 1)[0] in IEEE_MODULES}
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, ("approximate instructions in kernels that promise IEEE fp32 results (use tl.div_rn / "
                     f"tl.sqrt_rn, or allow-list with a reason): {bad}")


def test_the_ptx_check_sees_a_planted_approximate_division(tmp_path):
    pytest.importorskip("triton")
    (tmp_path / "planted.py").write_text(textwrap.dedent('''
        import torch, triton, triton.language as tl

        @triton.jit
        def approximate(X, Y, N: tl.constexpr):
            x = tl.load(X + tl.arange(0, N))
            tl.store(Y + tl.arange(0, N), x / (tl.sqrt(x) + 1.0))

        @triton.jit
        def ieee(X, Y, N: tl.constexpr):
            x = tl.load(X + tl.arange(0, N))
            tl.store(Y + tl.arange(0, N), tl.div_rn(x, tl.sqrt_rn(x) + 1.0))

        def run():
            x = torch.rand(64)
            approximate[(1,)](x, torch.empty_like(x), N=64)
            ieee[(1,)](x, torch.empty_like(x), N=64)
    '''))
    found = approximate_instructions(["planted:run"], cwd=tmp_path, timeout=300)
    assert {APPROXIMATE.match(i).group(1) for i in found["planted.approximate"]} == {"div.full", "sqrt.approx"}, found
    assert found["planted.ieee"] == {}, found


# --------------------------------------------------------------- fp32 scalar arguments under the interpreter
def _flat(tree):
    if isinstance(tree, torch.Tensor):
        return [tree]
    return [t for item in tree for t in _flat(item)]


@pytest.mark.parametrize("name", list(CASES))
def test_results_do_not_depend_on_fp64_scalar_arguments(name):
    if _device.requested() != "cpu":
        pytest.skip("an interpreter check: compiled kernels always receive fp32 scalars (the float64 references of "
                    "the optimizer tests check them on the GPU)")
    pytest.importorskip("triton")
    import apex
    from apex.testing import fp32_scalar_arguments, wide_scalar_arguments

    fp32_scalar_arguments()  # tests/conftest.py's prepare_interpreter() has it on already
    with apex.backend("triton"):
        with wide_scalar_arguments():
            wide = _flat(CASES[name]())
        narrow = _flat(CASES[name]())
    for i, (a, b) in enumerate(zip(wide, narrow)):
        if a.dtype in (torch.float16, torch.bfloat16):
            continue  # the roundings of fp32 results compared here
        err = rel_error(b.double(), a.double())
        assert err <= 1e-6, f"{name}: tensor {i} moves by {err:.2e} when scalar arguments are fp32"


@pytest.mark.parametrize("mode", [0, 1, 2])
def test_adam_swa_fp32_state_matches_float64_with_beta2_0_999(backend_name, mode):
    # The state's 1 - beta must not be taken from beta rounded to fp32 (with beta2 = 0.999, 1.3e-5 off).
    from apex.contrib.openfold_triton.fused_adam_swa import AdamMathType
    from apex.ops.openfold_adam_swa import adam_swa_step
    from tests.ops.test_openfold_adam_swa import _ref_adam_swa

    gen = torch.Generator().manual_seed(3)
    sizes, steps, hp = (5, 300), 3, dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    p = [torch.randn(s, generator=gen) for s in sizes]
    init = [x.double() for x in p]
    grads = [[torch.randn(s, generator=gen) for s in sizes] for _ in range(steps)]
    m, v = [torch.zeros(s) for s in sizes], [torch.zeros(s) for s in sizes]
    compute, swa = [x.to(torch.bfloat16) for x in p], [x.clone() for x in p]
    for t in range(1, steps + 1):
        adam_swa_step(grads[t - 1], p, compute, swa, m, v, **hp, bias_correction1=1 - 0.9 ** t,
                      bias_correction2=1 - 0.999 ** t, swa_decay_rate=0.9, first_average=t == 1, mode=mode, step=t)
    for i, x0 in enumerate(init):
        rp, rm, rv, rs = _ref_adam_swa(x0, [gs[i].double() for gs in grads], torch.zeros_like(x0),
                                       torch.zeros_like(x0), range(1, steps + 1), hp["lr"], hp["beta1"],
                                       hp["beta2"], hp["eps"], hp["weight_decay"], 0.9, AdamMathType(mode), 1.0,
                                       0, x0.clone())
        for name, got, ref in (("param", p[i], rp), ("exp_avg", m[i], rm), ("exp_avg_sq", v[i], rv),
                               ("swa", swa[i], rs)):
            assert rel_error(got, ref) <= 1e-6, f"{name}[{i}]: {rel_error(got, ref):.2e}"


def test_interpreted_kernels_receive_fp32_scalars_as_compiled_ones_do(triton_device):
    """``prepare_interpreter()`` (tests/conftest.py) passes Python floats as fp32, as a GPU launch does: ``1 - b``
    from ``b = 0.999`` is the fp32 result there, and the exact one only inside ``wide_scalar_arguments()``."""
    import triton
    import triton.language as tl

    from apex.testing import wide_scalar_arguments

    @triton.jit
    def one_minus(out, b):
        tl.store(out, 1.0 - b)

    fp32 = float(1 - torch.tensor(0.999, dtype=torch.float32).double())
    out = torch.zeros(1, dtype=torch.float64)
    one_minus[(1,)](out, 0.999)
    assert out.item() == fp32
    if _device.requested() == "cpu":
        with wide_scalar_arguments():
            one_minus[(1,)](out, 0.999)
        assert out.item() == pytest.approx(1 - 0.999, rel=1e-7)  # 1.3e-5 from the fp32 result
