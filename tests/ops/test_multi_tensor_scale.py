import amp_C
import pytest
import torch

from apex.multi_tensor_apply import multi_tensor_applier
from apex.testing import TritonTrace, assert_rel_close
from tests.ops._lists import CHUNK_SIZES, flag, mixed, ragged

PAIRS = [(torch.float32, torch.float32), (torch.float16, torch.float32), (torch.float32, torch.float16),
         (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16), (torch.float16, torch.float16)]


def _run(backend_name, chunk_size, noop, ins, outs, scale):
    if backend_name == "triton":
        with TritonTrace(bounds=True) as tr:
            tr.watch(ins, outs, noop)
            amp_C.multi_tensor_scale(chunk_size, noop, [ins, outs], scale)
        groups = {(x.dtype, o.dtype) for x, o in zip(ins, outs)}
        assert tr.launches == len(groups)
    else:
        amp_C.multi_tensor_scale(chunk_size, noop, [ins, outs], scale)


@pytest.mark.parametrize("in_dtype,out_dtype", PAIRS)
@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
def test_scale_matches_float64(backend_name, in_dtype, out_dtype, chunk_size):
    ins = ragged(in_dtype, scale=3.0)
    outs = [torch.full_like(x, 7.0, dtype=out_dtype) for x in ins]
    noop = flag()
    _run(backend_name, chunk_size, noop, ins, outs, 0.37)
    assert noop.item() == 0
    for x, o in zip(ins, outs):
        ref = x.double() * 0.37
        assert_rel_close(o, ref, baseline=ref.to(out_dtype))


def test_scale_mixed_dtypes_in_place(backend_name):
    xs = mixed()
    before = [x.clone() for x in xs]
    noop = flag()
    _run(backend_name, 2048 * 32, noop, xs, xs, 2.0)
    for x, b in zip(xs, before):
        assert torch.equal(x, (b.double() * 2.0).to(x.dtype))


@pytest.mark.parametrize("bad", ["inf", "-inf", "nan"])
def test_scale_flags_nonfinite_and_keeps_finite_results(backend_name, bad):
    ins = ragged(torch.float32)
    ins[2][123] = float(bad)
    outs = [torch.empty_like(x) for x in ins]
    noop = flag()
    _run(backend_name, 2048 * 32, noop, ins, outs, 0.5)
    assert noop.item() == 1
    for i, (x, o) in enumerate(zip(ins, outs)):
        finite = torch.isfinite(x)
        assert torch.equal(o[finite], x[finite] * 0.5), i
    assert not torch.isfinite(outs[2][123])


def test_flag_is_sticky(backend_name):
    noop = torch.ones(1, dtype=torch.int32)
    ins = ragged(torch.float32, sizes=(10,))
    outs = [torch.empty_like(x) for x in ins]
    _run(backend_name, 2048 * 32, noop, ins, outs, 1.0)
    assert noop.item() == 1


def test_results_do_not_depend_on_chunk_size(backend_name):
    ins = ragged(torch.float16)
    results = []
    for cs in CHUNK_SIZES:
        outs = [torch.empty(x.shape, dtype=torch.float32) for x in ins]
        _run(backend_name, cs, flag(), ins, outs, 1.5)
        results.append(outs)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


def test_applier_calls_op_with_its_chunk_size(backend_name):
    ins = ragged(torch.float32, sizes=(3, 5))
    outs = [torch.empty_like(x) for x in ins]
    multi_tensor_applier(amp_C.multi_tensor_scale, flag(), [ins, outs], 4.0)
    assert all(torch.equal(o, x * 4.0) for x, o in zip(ins, outs))
    assert multi_tensor_applier.chunk_size == 2048 * 32
    assert multi_tensor_applier.available
    multi_tensor_applier.check_avail()


def test_empty_list_and_empty_tensor(backend_name):
    amp_C.multi_tensor_scale(2048, flag(), [[], []], 2.0)
    x, o = torch.empty(0), torch.empty(0)
    amp_C.multi_tensor_scale(2048, flag(), [[x], [o]], 2.0)


def test_bf16_outputs_round_like_pytorch(backend_name):
    ins = ragged(torch.float32, sizes=(4097,), seed=3)
    outs = [torch.empty(x.shape, dtype=torch.bfloat16) for x in ins]
    _run(backend_name, 2048 * 32, flag(), ins, outs, 1.0)
    assert torch.equal(outs[0], ins[0].to(torch.bfloat16))


@pytest.mark.parametrize("scale", [torch.tensor(0.25), torch.tensor([0.25]), torch.tensor([0.25], dtype=torch.float64)])
def test_scale_given_as_a_tensor(backend_name, scale):
    ins = ragged(torch.float16)
    outs = [torch.empty(x.shape, dtype=torch.float32) for x in ins]
    _run(backend_name, 2048 * 32, flag(), ins, outs, scale)
    for x, o in zip(ins, outs):
        assert torch.equal(o, x.float() * 0.25)


def test_scale_rejects_a_bad_scale():
    ins = ragged(torch.float32, sizes=(3,))
    with pytest.raises(ValueError, match="scale"):
        amp_C.multi_tensor_scale(2048, flag(), [ins, ins], torch.ones(2))
    with pytest.raises(TypeError, match="scale"):
        amp_C.multi_tensor_scale(2048, flag(), [ins, ins], "2")


def test_a_repeated_call_sees_other_sizes_at_the_same_addresses(backend_name):
    # A call with the addresses of an earlier call that passed the checks reuses what that call read
    # (apex._kernels._lists.checked): tensors of another size at those addresses must be read anew.
    src = torch.arange(1.0, 65.0)
    dst = torch.zeros(64)
    for _ in range(2):
        amp_C.multi_tensor_scale(2048 * 32, flag(), [[src[:16]], [dst[:16]]], 2.0)
    amp_C.multi_tensor_scale(2048 * 32, flag(), [[src], [dst]], 2.0)
    assert torch.equal(dst, src * 2)
