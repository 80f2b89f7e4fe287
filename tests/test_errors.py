"""Error paths raise both this package's type and the type NVIDIA Apex raised (``apex._errors``).

Each row of ``CASES`` is a documented misuse of the public API: the call, the type this package promises
(``ValueError``/``TypeError``, or ``RuntimeError`` for misuse of state), the type Apex raised there
(``AssertionError`` from an ``assert``, or ``RuntimeError``), and a fragment of the message. Paths that need a
process group run in one single-rank Gloo spawn (``test_distributed_error_paths``).
"""

from __future__ import annotations

import importlib
import pickle
import warnings

import pytest
import torch
from torch import nn

from apex import _errors

VE, TE, RE, AE = ValueError, TypeError, RuntimeError, AssertionError


# ----------------------------------------------------------------------------------------- transformer
def _divide(mp):
    from apex.transformer.utils import divide
    divide(5, 2)


def _ensure_divisibility(mp):
    from apex.transformer.utils import ensure_divisibility
    ensure_divisibility(7, 3)


def _split_last_dim(mp):
    from apex.transformer.tensor_parallel.utils import split_tensor_along_last_dim
    split_tensor_along_last_dim(torch.zeros(2, 5), 2)


def _vocab_range(mp):
    from apex.transformer.tensor_parallel.utils import VocabUtility
    VocabUtility.vocab_range_from_global_vocab_size(10, 0, 3)


def _attributes_twice(mp):
    from apex.transformer.tensor_parallel import set_tensor_model_parallel_attributes
    t = torch.zeros(2)
    set_tensor_model_parallel_attributes(t, True, 0, 1)
    set_tensor_model_parallel_attributes(t, True, 0, 1)


def _sampler(*args, random=False):
    from apex.transformer._data import MegatronPretrainingRandomSampler, MegatronPretrainingSampler

    def call(mp):
        (MegatronPretrainingRandomSampler if random else MegatronPretrainingSampler)(*args)
    return call


def _sampler_set_size(mp):
    from apex.transformer._data import MegatronPretrainingSampler
    MegatronPretrainingSampler(10, 0, 2, 0, 1).local_minibatch_size = 0


def _softmax_module_3d(mp):
    from apex.transformer.enums import AttnMaskType
    from apex.transformer.functional import FusedScaleMaskSoftmax
    FusedScaleMaskSoftmax(False, False, AttnMaskType.padding, True, None, True, None)(torch.zeros(2, 3, 4), None)


def _causal_softmax_not_square(mp):
    from apex.transformer.functional.fused_softmax import scaled_upper_triang_masked_softmax
    scaled_upper_triang_masked_softmax(torch.zeros(1, 1, 2, 3), None, 1.0)


def _timer(action):
    def call(mp):
        from apex.transformer.pipeline_parallel._timers import _Timers
        timers = _Timers()
        if action == "start twice":
            timers("t").start()
            timers("t").start()
        elif action == "stop unstarted":
            timers("t").stop()
        else:
            timers.log(["t"], normalizer=0.0)
    return call


def _no_calculator(mp):
    from apex.transformer.pipeline_parallel import utils
    mp.setattr(utils, "_GLOBAL_NUM_MICROBATCHES_CALCULATOR", None)
    utils.get_micro_batch_size()


def _calculator_twice(mp):
    from apex.transformer.pipeline_parallel import utils
    mp.setattr(utils, "_GLOBAL_NUM_MICROBATCHES_CALCULATOR", None)
    utils.setup_microbatch_calculator(0, None, 4, 1, 1)
    utils.setup_microbatch_calculator(0, None, 4, 1, 1)


def _kth_microbatch_out_of_range(mp):
    from apex.transformer.microbatches import ConstantNumMicroBatches
    from apex.transformer.pipeline_parallel import utils
    mp.setattr(utils, "_GLOBAL_NUM_MICROBATCHES_CALCULATOR", ConstantNumMicroBatches(4, 1, 1))
    utils.get_kth_microbatch([torch.zeros(2, 1)], 3)


def _custom_backward(output):
    def call(mp):
        from apex.transformer.pipeline_parallel.schedules.common import custom_backward
        custom_backward(output() if callable(output) else output, None)
    return call


def _interleaved_not_a_list(mp):
    from apex.transformer.pipeline_parallel.schedules.fwd_bwd_pipelining_with_interleaving import (
        _forward_backward_pipelining_with_interleaving,
    )
    _forward_backward_pipelining_with_interleaving(None, None, nn.Linear(1, 1), forward_only=True,
                                                   tensor_shape=[1, 1, 1])


def _tensor_shapes_not_3d(mp):
    from apex.transformer.enums import ModelType
    from apex.transformer.pipeline_parallel.schedules.fwd_bwd_pipelining_without_interleaving import (
        get_tensor_shapes,
    )
    get_tensor_shapes(0, ModelType.encoder_or_decoder, tensor_shape=[4, 2])


def _label_smoothing_one(mp):
    from apex.transformer.tensor_parallel import vocab_parallel_cross_entropy
    vocab_parallel_cross_entropy(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), 1.0)


def _broadcast_data(data):
    def call(mp):
        from apex.transformer.tensor_parallel import data as tp_data
        mp.setattr(tp_data, "get_tensor_model_parallel_rank", lambda: 0)  # the source rank checks its inputs
        tp_data.broadcast_data(["x"], {"x": data}, torch.float32)
    return call


def _sequence_split(name):
    def call(mp):
        from apex.transformer.tensor_parallel import mappings
        mp.setattr(mappings, "get_tensor_model_parallel_world_size", lambda: 2)
        mp.setattr(mappings, "get_tensor_model_parallel_rank", lambda: 0)
        getattr(mappings, name)(torch.zeros(3, 2))
    return call


def _fresh_buffers(mp):
    from apex.transformer.tensor_parallel import memory
    mp.setattr(memory, "_REGISTRY", memory._Buffers())
    return memory


def _buffer(action):
    def call(mp):
        memory = _fresh_buffers(mp)
        if action == "allocate twice":
            memory.allocate_mem_buff("b", 4, torch.float32, False)
            memory.allocate_mem_buff("b", 4, torch.float32, False)
        elif action == "ring in use":
            ring = memory.RingMemBuffer("r", 1, 4, torch.float32, False)
            ring.get_next_buffer().add(torch.zeros(1))
            ring.get_next_buffer()
        else:
            buffer = memory.MemoryBuffer("b", 4, torch.float32, False)
            if action == "dtype":
                buffer.add(torch.zeros(2, dtype=torch.float64))
            elif action == "full":
                buffer.add(torch.zeros(5))
            else:
                buffer.print_average_usage()
    return call


def _checkpoint_buffer(twice):
    def call(mp):
        from apex.transformer.tensor_parallel import random as tp_random
        _fresh_buffers(mp)
        mp.setattr(tp_random._Tracker, "checkpointed_activations_buffer", None)
        if twice:
            tp_random.init_checkpointed_activations_memory_buffer(1, 1, 1, 2, 1, 1, False)
            tp_random.init_checkpointed_activations_memory_buffer(1, 1, 1, 2, 1, 1, False)
        else:
            tp_random.init_checkpointed_activations_memory_buffer(1, 1, 1, 3, 1, 2, False)
    return call


def _column_parallel_gather_and_sequence_parallel(mp):
    from apex.transformer.tensor_parallel import layers
    mp.setattr(layers, "get_tensor_model_parallel_world_size", lambda: 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "sequence_parallel_enabled with world_size 1"
        layers.ColumnParallelLinear(4, 4, gather_output=True, sequence_parallel_enabled=True)


def _linear_async_and_sequence_parallel(mp):
    from apex.transformer.tensor_parallel import linear_with_grad_accumulation_and_async_allreduce
    linear_with_grad_accumulation_and_async_allreduce(torch.zeros(2, 4), torch.zeros(3, 4), None, False, True, True)


def _parallel_state_uninitialized(mp):
    from apex.transformer import parallel_state
    parallel_state.get_tensor_model_parallel_group()


def _microbatch_config(mp):
    from apex.transformer.microbatches import build_num_microbatches_calculator
    build_num_microbatches_calculator(0, [1, 2], 4, 1, 1)


# --------------------------------------------------------------------------------------------- contrib
def _bottleneck(**kwargs):
    def call(mp):
        from apex.contrib.bottleneck import Bottleneck
        Bottleneck(4, 2, 4, **kwargs)
    return call


def _spatial_method(mp):
    from apex.contrib.bottleneck import HaloExchangerNoComm, SpatialBottleneck
    SpatialBottleneck(4, 2, 4, spatial_parallel_args=(2, 0, None, HaloExchangerNoComm([0, 1], 0), 4, False))


def _groupbn_z_without_relu(mp):
    from apex.contrib.groupbn import BatchNorm2d_NHWC
    BatchNorm2d_NHWC(4)(torch.zeros(1, 2, 2, 4), torch.zeros(1, 2, 2, 4))


def _group_norm_act(mp):
    from apex.contrib.group_norm import GroupNorm
    GroupNorm(2, 4, act="relu")


def _torchsched_backend(mp):
    import apex.contrib.torchsched as torchsched
    torchsched.set_default_backend("no-such-backend")


def _nccl_mem_cpu_device(mp):
    from apex.contrib.nccl_allocator import nccl_allocator
    nccl_allocator._cuda_device("cpu")  # nccl_mem's device check (nccl_mem itself needs CUDA first)


def _asp(action):
    def call(mp):
        from apex.contrib.sparsity import ASP
        model = nn.Sequential(nn.Linear(16, 16))
        ASP.reset()
        try:
            if action == "optimizer first":
                ASP.init_optimizer_for_pruning(torch.optim.SGD(model.parameters(), lr=0.1))
            elif action == "unknown layer":
                ASP.init_model_for_pruning(model, "m4n2_1d", whitelist=[nn.GRU])
            else:
                ASP.init_model_for_pruning(model, "m4n2_1d")
                ASP.init_model_for_pruning(model, "m4n2_1d")
        finally:
            ASP.reset()
    return call


def _index_mul_2d(in1, in2, idx1):
    def call(mp):
        from apex.contrib.index_mul_2d import index_mul_2d
        index_mul_2d(in1, in2, idx1)
    return call


def _adam_swa_two_groups(mp):
    from apex.contrib.openfold_triton.fused_adam_swa import FusedAdamSWA
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    adam = torch.optim.Adam([{"params": [a]}, {"params": [b]}])
    FusedAdamSWA.from_optim(adam, [a, b], [a, b], [a, b], 0.9)


# ------------------------------------------------------------------------- fused ops and compatibility modules
def _op(target, *args, **kwargs):
    """``module:attr.attr`` imported when the row runs, called with the given arguments (the compatibility
    modules, such as ``xentropy_cuda``, are top-level modules)."""
    def call(mp):
        module, _, name = target.partition(":")
        fn = importlib.import_module(module)
        for part in name.split("."):
            fn = getattr(fn, part)
        fn(*args, **kwargs)
    return call


def _module(target, init_args, *args, **kwargs):
    """``target(*init_args)(*args, **kwargs)``: a module's forward."""
    def call(mp):
        module, _, name = target.partition(":")
        getattr(importlib.import_module(module), name)(*init_args)(*args, **kwargs)
    return call


Z, F64 = torch.zeros, torch.float64


def L(*shape):  # noqa: N802 - integer labels, as Z
    return torch.zeros(*shape, dtype=torch.long)


_XENT = "apex.contrib.xentropy:SoftmaxCrossEntropyLoss.apply"
_FOCAL = "apex.contrib.focal_loss.focal_loss:focal_loss"
_TLOSS = "apex.contrib.transducer:TransducerLoss"
_JOINT = "apex.contrib.transducer:TransducerJoint"
_FLN = "apex.contrib.layer_norm:FastLayerNormFN.apply"
_SOFTMAX_CUDA = "scaled_masked_softmax_cuda"
_NOOP = torch.zeros(1, dtype=torch.int32)


CASES = [
    # (id, call, this package's type, Apex's type, message fragment)
    ("utils.divide", _divide, VE, AE, "5 is not divisible by 2"),
    ("utils.ensure_divisibility", _ensure_divisibility, VE, AE, "not divisible"),
    ("split_tensor_along_last_dim", _split_last_dim, VE, AE, "not divisible"),
    ("vocab_range_from_global_vocab_size", _vocab_range, VE, AE, "not divisible"),
    ("set_tensor_model_parallel_attributes twice", _attributes_twice, RE, AE, "already has"),
    ("MegatronPretrainingSampler total_samples=0", _sampler(0, 0, 1, 0, 1), VE, RE, "no sample to consume"),
    ("MegatronPretrainingSampler consumed>=total", _sampler(4, 4, 1, 0, 1), VE, RE, "no samples left"),
    ("MegatronPretrainingSampler local_minibatch_size=0", _sampler(10, 0, 0, 0, 1), VE, RE,
     "local_minibatch_size"),
    ("MegatronPretrainingSampler data_parallel_size=0", _sampler(10, 0, 1, 0, 0), VE, RE, "data_parallel_size"),
    ("MegatronPretrainingSampler rank>=size", _sampler(10, 0, 1, 1, 1), VE, RE, "data_parallel_rank"),
    ("MegatronPretrainingRandomSampler total_samples=0", _sampler(0, 0, 1, 0, 1, random=True), VE, RE,
     "no sample to consume"),
    ("MegatronPretrainingRandomSampler local_minibatch_size=0", _sampler(10, 0, 0, 0, 1, random=True), VE, RE,
     "local_minibatch_size"),
    ("sampler.local_minibatch_size = 0", _sampler_set_size, VE, RE, "local_minibatch_size"),
    ("FusedScaleMaskSoftmax 3-D input", _softmax_module_3d, VE, AE, "4-D"),
    ("scaled_upper_triang_masked_softmax sq!=sk", _causal_softmax_not_square, VE, AE, "sq == sk"),
    ("timer started twice", _timer("start twice"), RE, AE, "already been started"),
    ("timer stopped unstarted", _timer("stop unstarted"), RE, AE, "not started"),
    ("timers.log normalizer=0", _timer("log"), VE, AE, "normalizer"),
    ("get_micro_batch_size uninitialized", _no_calculator, RE, AE, "not initialized"),
    ("setup_microbatch_calculator twice", _calculator_twice, RE, AE, "already initialized"),
    ("get_kth_microbatch past the batch", _kth_microbatch_out_of_range, VE, AE, "microbatch 3"),
    ("custom_backward not pseudo-freed", _custom_backward(lambda: torch.zeros(2, requires_grad=True)), VE, AE,
     "pseudo-freed"),
    ("custom_backward non-tensor", _custom_backward([1.0]), TE, AE, "output must be a torch.Tensor"),
    ("interleaved schedule model not a list", _interleaved_not_a_list, TE, RE, "list"),
    ("get_tensor_shapes not 3-D", _tensor_shapes_not_3d, VE, AE, "tensor_shape"),
    ("vocab_parallel_cross_entropy label_smoothing=1", _label_smoothing_one, VE, AE, "label_smoothing"),
    ("broadcast_data dtype", _broadcast_data(torch.zeros(2, dtype=torch.long)), TE, AE, "different than"),
    ("broadcast_data too many dims", _broadcast_data(torch.zeros(1, 1, 1, 1, 1)), VE, AE, "dimensions"),
    ("scatter_to_sequence_parallel_region", _sequence_split("scatter_to_sequence_parallel_region"), VE, AE,
     "not divisible"),
    ("reduce_scatter_to_sequence_parallel_region", _sequence_split("reduce_scatter_to_sequence_parallel_region"),
     VE, AE, "not divisible"),
    ("allocate_mem_buff twice", _buffer("allocate twice"), RE, AE, "already allocated"),
    ("MemoryBuffer.add dtype", _buffer("dtype"), TE, AE, "different from buffer type"),
    ("MemoryBuffer.add full", _buffer("full"), RE, AE, "Not enough memory"),
    ("MemoryBuffer.print_average_usage untracked", _buffer("usage"), RE, AE, "track usage"),
    ("RingMemBuffer buffer in use", _buffer("ring in use"), RE, AE, "already in use"),
    ("init_checkpointed_activations_memory_buffer layers", _checkpoint_buffer(False), VE, AE, "not divisible"),
    ("init_checkpointed_activations_memory_buffer twice", _checkpoint_buffer(True), RE, AE, "already allocated"),
    ("ColumnParallelLinear gather_output + sequence parallel", _column_parallel_gather_and_sequence_parallel, RE,
     AE, "gather_output"),
    ("linear_with_grad_accumulation async + sequence parallel", _linear_async_and_sequence_parallel, VE, AE,
     "cannot both"),
    ("parallel_state getter uninitialized", _parallel_state_uninitialized, RE, AE, "not initialized"),
    ("build_num_microbatches_calculator rampup", _microbatch_config, VE, AE, "rampup_batch_size"),
    ("Bottleneck groups=2", _bottleneck(groups=2), VE, RE, "groups"),
    ("Bottleneck dilation=2", _bottleneck(dilation=2), VE, RE, "dilation"),
    ("Bottleneck norm_func", _bottleneck(norm_func=nn.BatchNorm2d), VE, RE, "frozen"),
    ("SpatialBottleneck spatial_method=4", _spatial_method, VE, AE, "spatial_method"),
    ("BatchNorm2d_NHWC z without fuse_relu", _groupbn_z_without_relu, VE, AE, "fuse_relu"),
    ("GroupNorm act", _group_norm_act, VE, AE, "act"),
    ("torchsched.set_default_backend unknown", _torchsched_backend, VE, AE, "Unknown backend"),
    ("nccl_mem device cpu", _nccl_mem_cpu_device, VE, AE, "CUDA device"),
    ("ASP optimizer before model", _asp("optimizer first"), RE, AE, "before ASP.init_model_for_pruning"),
    ("ASP model twice", _asp("twice"), RE, AE, "initialized already"),
    ("ASP whitelist unknown layer", _asp("unknown layer"), VE, AE, "sparsify"),
    ("FusedAdamSWA.from_optim two groups", _adam_swa_two_groups, VE, AE, "one param group"),
    ("index_mul_2d idx1 length", _index_mul_2d(torch.zeros(4, 2), torch.zeros(3, 2), torch.zeros(2, dtype=torch.long)),
     VE, AE, "idx1 must be 1-D"),
    ("index_mul_2d idx1 2-D", _index_mul_2d(torch.zeros(4, 2), torch.zeros(3, 2), torch.zeros(3, 1, dtype=torch.long)),
     VE, RE, "idx1 must be 1-D"),
    ("index_mul_2d in1 1-D", _index_mul_2d(torch.zeros(4), torch.zeros(3, 2), torch.zeros(3, dtype=torch.long)),
     VE, RE, "in1 must be a 2-D"),
    ("index_mul_2d dtypes differ", _index_mul_2d(torch.zeros(4, 2), torch.zeros(3, 2, dtype=torch.float64),
                                                 torch.zeros(3, dtype=torch.long)), TE, RE, "same dtype"),
    # Fused ops and the compatibility modules: where Apex's extensions raised RuntimeError (TORCH_CHECK, a
    # dispatch on the dtype) or its Python wrappers asserted.
    ("fused_layer_norm normalized_shape=[]", _op("apex.normalization.fused_layer_norm:fused_layer_norm", Z(2, 3), []),
     VE, RE, "at least one dimension"),
    ("SoftmaxCrossEntropyLoss integer logits", _op(_XENT, L(4, 5), L(4)), TE, RE, "floating-point"),
    ("SoftmaxCrossEntropyLoss float labels", _op(_XENT, Z(4, 5), Z(4)), TE, RE, "integer tensor"),
    ("SoftmaxCrossEntropyLoss labels shape", _op(_XENT, Z(4, 5), L(3)), VE, RE, "labels must have shape"),
    ("SoftmaxCrossEntropyLoss no classes", _op(_XENT, Z(4, 0), L(4)), VE, RE, "V > 0"),
    ("SoftmaxCrossEntropyLoss labels device", _op(_XENT, Z(4, 5), L(4).to("meta")), VE, RE, "is on meta"),
    ("xentropy_cuda.backward grad_loss shape", _op("xentropy_cuda:backward", Z(3), Z(4, 5), Z(4), L(4), 0.0), VE,
     RE, "grad_loss must have shape"),
    ("focal_loss integer logits", _op(_FOCAL, L(6, 4), L(6), Z(1), 4, 0.25, 2.0), TE, RE, "floating-point"),
    ("focal_loss int32 targets", _op(_FOCAL, Z(6, 4), L(6).int(), Z(1), 4, 0.25, 2.0), TE, RE, "int64"),
    ("focal_loss targets shape", _op(_FOCAL, Z(6, 4), L(5), Z(1), 4, 0.25, 2.0), VE, RE, "must have shape"),
    ("focal_loss num_positives_sum", _op(_FOCAL, Z(6, 4), L(6), Z(2), 4, 0.25, 2.0), VE, RE, "num_positives_sum"),
    ("focal_loss num_real_classes", _op(_FOCAL, Z(6, 4), L(6), Z(1), 5, 0.25, 2.0), VE, RE, "num_real_classes"),
    ("focal_loss device", _op(_FOCAL, Z(6, 4), L(6), Z(1, device="meta"), 4, 0.25, 2.0), VE, RE, "is on meta"),
    ("TransducerJoint opt=2", _op(_JOINT, opt=2), VE, RE, "opt must be"),
    ("TransducerJoint fwd_tile_size=3", _op(_JOINT, fwd_tile_size=3), VE, RE, "fwd_tile_size"),
    ("transducer_joint_cuda.forward opt=2", _op("transducer_joint_cuda:forward", Z(1, 2, 3), Z(1, 2, 3), L(1),
                                                 L(1), None, 0, 2, False, False, False, 0.0, 4), VE, RE, "opt"),
    ("TransducerJoint integer f", _module(_JOINT, (), L(1, 2, 3), Z(1, 2, 3), L(1), L(1)), TE, RE,
     "floating-point"),
    ("TransducerJoint g dtype", _module(_JOINT, (), Z(1, 2, 3), Z(1, 2, 3, dtype=F64), L(1), L(1)), VE, RE,
     "dtype"),
    ("transducer_loss_cuda.forward integer x", _op("transducer_loss_cuda:forward", L(1, 2, 3, 4), L(1, 2), L(1) + 1,
                                                    L(1) + 1, None, 2, 0, 1, False), TE, RE, "floating-point"),
    ("transducer_loss_cuda.forward opt=2", _op("transducer_loss_cuda:forward", Z(1, 2, 3, 4), L(1, 2), L(1) + 1,
                                               L(1) + 1, None, 2, 0, 2, False), VE, RE, "opt must be"),
    ("TransducerLoss opt=2", _module(_TLOSS, (True, 2), Z(1, 2, 3, 4), L(1, 2), L(1), L(1), 0), VE, RE,
     "opt must be"),
    ("TransducerLoss float label", _module(_TLOSS, (), Z(1, 2, 3, 4), Z(1, 2), L(1), L(1), 0), TE, RE,
     "integer tensor"),
    ("TransducerLoss blank_idx=V", _module(_TLOSS, (), Z(1, 2, 3, 4), L(1, 2), L(1), L(1), 4), VE, RE,
     "blank_idx"),
    ("transformer scaled_masked_softmax 3-D", _op("apex.transformer.functional:scaled_masked_softmax",
                                                  Z(2, 3, 3), None, 1.0), VE, RE, "4-D"),
    ("scaled_masked_softmax_cuda.forward 3-D", _op(f"{_SOFTMAX_CUDA}:forward", Z(2, 3, 3),
                                                   Z(2, 1, 3, 3, dtype=torch.bool), 1.0), VE, RE, "4-D"),
    ("scaled_masked_softmax_cuda.forward integer", _op(f"{_SOFTMAX_CUDA}:forward", L(2, 1, 3, 3),
                                                       Z(2, 1, 3, 3, dtype=torch.bool), 1.0), TE, RE,
     "floating-point"),
    ("scaled_masked_softmax_cuda.forward mask shape", _op(f"{_SOFTMAX_CUDA}:forward", Z(2, 1, 3, 3),
                                                          Z(2, 1, 2, 3, dtype=torch.bool), 1.0), VE, RE,
     "does not broadcast"),
    ("scaled_softmax_cuda.backward 3-D", _op("scaled_softmax_cuda:backward", Z(2, 3, 3), Z(2, 3, 3), 1.0), VE, RE,
     "4-D"),
    ("scaled_upper_triang_masked_softmax_cuda.backward sq!=sk",
     _op("scaled_upper_triang_masked_softmax_cuda:backward", Z(2, 2, 3), Z(2, 2, 3), 1.0), VE, RE, "sq == sk"),
    ("FastLayerNormFN beta dtype", _op(_FLN, Z(2, 4), Z(4), Z(4, dtype=F64), 1e-5), TE, RE, "gamma's dtype"),
    ("FastLayerNormFN beta size", _op(_FLN, Z(2, 4), Z(4), Z(3), 1e-5), VE, RE, "same size"),
    ("FastLayerNormFN epsilon < 0", _op(_FLN, Z(2, 4), Z(4), Z(4), -1e-5), VE, RE, "epsilon must be >= 0"),
    ("fast_layer_norm.ln_fwd epsilon < 0", _op("fast_layer_norm:ln_fwd", Z(2, 4), Z(4), Z(4), -1.0), VE, RE,
     "epsilon must be >= 0"),
    ("fast_layer_norm.ln_fwd hidden size", _op("fast_layer_norm:ln_fwd", Z(2, 3), Z(4), Z(4), 1e-5), VE, RE,
     "x must have shape"),
    ("contrib GroupNorm input channels", _module("apex.contrib.group_norm:GroupNorm", (2, 4), Z(1, 6, 2, 2)), VE,
     RE, "must have shape [6]"),
    ("group_norm_cuda.forward groups", _op("group_norm_cuda:forward", Z(1, 4, 2, 2), 3, Z(4), Z(4), 1e-5), VE, RE,
     "must divide"),
    ("cuda_group_norm_nhwc_one_pass act", _op("apex.contrib.group_norm.group_norm:cuda_group_norm_nhwc_one_pass",
                                              Z(1, 4, 2, 2), 2, Z(4), Z(4), 1e-5, "gelu"), VE, AE, "act"),
    ("FusedDense input dtype", _module("apex.fused_dense:FusedDense", (4, 3), Z(2, 4, dtype=F64)), TE, RE,
     "dtype"),
    ("fused_dense_cuda.linear_bias_forward integer input", _op("fused_dense_cuda:linear_bias_forward", L(2, 4),
                                                               Z(3, 4), Z(3)), TE, RE, "floating-point"),
    ("mlp_cuda.forward weight dtype", _op("mlp_cuda:forward", 1, 1, [Z(2, 4), Z(3, 4, dtype=F64), Z(3)]), TE, RE,
     "weight 0 has dtype"),
    ("FusedDenseGeluDense bias=False", _op("apex.fused_dense:FusedDenseGeluDense", 4, 4, 4, bias=False), VE, AE,
     "bias=False"),
    ("wgrad_gemm_accum_fp32 grad_output dtype", _op("fused_weight_gradient_mlp_cuda:wgrad_gemm_accum_fp32",
                                                    Z(2, 4), Z(2, 3, dtype=F64), Z(3, 4)), TE, RE, "share one dtype"),
    ("wgrad_gemm_accum_fp32 main_grad dtype", _op("fused_weight_gradient_mlp_cuda:wgrad_gemm_accum_fp32",
                                                  Z(2, 4), Z(2, 3), Z(3, 4, dtype=F64)), TE, RE, "main_grad"),
    ("syncbn.welford_mean_var integer", _op("syncbn:welford_mean_var", L(2, 3)), TE, RE, "float32"),
    ("fmhalib.fwd qkv shape", _op("fmhalib:fwd", Z(4, 2, 1, 8), torch.tensor([0, 4], dtype=torch.int32), 0.0, 4,
                                  False, False, False, None), VE, RE, "qkv must be"),
    ("FMHAFun cu_seqlens 2-D", _op("apex.contrib.fmha:FMHAFun.apply", Z(4, 3, 1, 8),
                                   torch.tensor([[0, 4]], dtype=torch.int32), 0.0, 4, False), VE, RE, "cu_seqlens"),
    ("FMHAFun p_dropout=1", _op("apex.contrib.fmha:FMHAFun.apply", Z(4, 3, 1, 8),
                                torch.tensor([0, 4], dtype=torch.int32), 1.0, 4, True), VE, RE, "p_dropout must be"),
    ("amp_C three lists for two", _op("amp_C:multi_tensor_scale", 2048, _NOOP, [[Z(3)], [Z(3)], [Z(3)]], 1.0), VE,
     RE, "must hold 2 lists"),
    ("amp_C list lengths", _op("amp_C:multi_tensor_scale", 2048, _NOOP, [[Z(3), Z(3)], [Z(3)]], 1.0), VE, RE,
     "same length"),
    ("amp_C integer tensor", _op("amp_C:multi_tensor_scale", 2048, _NOOP, [[L(3)], [Z(3)]], 1.0), TE, RE, "dtype"),
    ("amp_C devices", _op("amp_C:multi_tensor_scale", 2048, _NOOP, [[Z(3)], [Z(3, device="meta")]], 1.0), VE, RE,
     "one device"),
    ("amp_C sizes", _op("amp_C:multi_tensor_scale", 2048, _NOOP, [[Z(3)], [Z(4)]], 1.0), VE, RE, "has shape"),
    ("amp_C not contiguous", _op("amp_C:multi_tensor_scale", 2048, _NOOP, [[Z(4, 4).t()], [Z(4, 4)]], 1.0), VE, RE,
     "contiguous"),
    ("amp_C noop_flag dtype", _op("amp_C:multi_tensor_l2norm", 2048, Z(1), [[Z(3)]], False), VE, RE, "noop_flag"),
    ("amp_C noop_flag device", _op("amp_C:multi_tensor_l2norm", 2048, _NOOP.to("meta"), [[Z(3)]], False), VE, RE,
     "noop_flag is on meta"),
]


@pytest.mark.parametrize("call,ours,apex_type,fragment", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_error_is_both_types(monkeypatch, call, ours, apex_type, fragment):
    with pytest.raises(ours) as info:
        call(monkeypatch)
    assert isinstance(info.value, apex_type), f"{type(info.value).__mro__} is not a {apex_type.__name__}"
    assert fragment in str(info.value)


# ------------------------------------------------------------------------------------ process-group paths
def _distributed_cases():
    from apex.contrib.bottleneck import HaloExchangerSendRecv
    from apex.contrib.groupbn import BatchNorm2d_NHWC
    from apex.contrib.optimizers import DistributedFusedAdam
    from apex.contrib.peer_memory import PeerMemoryPool
    from apex.transformer import parallel_state

    p = nn.Parameter(torch.ones(4))
    p.grad = torch.ones(4)
    adam = DistributedFusedAdam([p])
    pool = PeerMemoryPool(64, 64, [0])
    return [
        ("initialize_model_parallel default_backend=3",
         lambda: parallel_state.initialize_model_parallel(1, 1, default_backend=3), TE, AE, "default_backend"),
        ("HaloExchangerSendRecv wrong rank", lambda: HaloExchangerSendRecv([3], 0), VE, AE, "ranks[0] is 3"),
        ("BatchNorm2d_NHWC bn_group not dividing the world", lambda: BatchNorm2d_NHWC(4, bn_group=2), VE, AE,
         "must divide the world size"),
        ("PeerMemoryPool peer rank outside", lambda: PeerMemoryPool(64, 64, [5]), VE, AE, "peer_ranks"),
        ("PeerMemoryPool dtype", lambda: pool.allocate_peer_tensors([2], torch.float64, False, False), TE, AE,
         "dtype"),
        ("PeerMemoryPool exhausted", lambda: pool.allocate_peer_tensors([1000], torch.float32, False, True), RE, AE,
         "exhausted"),
        ("DistributedFusedAdam device", lambda: DistributedFusedAdam([nn.Parameter(torch.ones(2))], device="meta"),
         VE, RE, "device"),
        ("DistributedFusedAdam.grad_norm norm_type=1", lambda: adam.grad_norm(norm_type=1.0), VE, AE, "norm_type"),
        ("DistributedFusedAdam.clip_grad_norm max_norm=0", lambda: adam.clip_grad_norm(0.0), VE, AE, "max_norm"),
        ("DistributedFusedAdam.grad_buffer_view", lambda: adam.grad_buffer_view(p), RE, AE, "contiguous_grad_buffer"),
    ]


def check_distributed_error_paths(rank: int, world_size: int) -> None:
    failures = []
    for name, call, ours, apex_type, fragment in _distributed_cases():
        try:
            call()
        except Exception as e:  # noqa: BLE001 - every outcome is recorded and compared below
            if not (isinstance(e, ours) and isinstance(e, apex_type) and fragment in str(e)):
                failures.append(f"{name}: {type(e).__name__}{type(e).__mro__[1:-2]}: {e}")
        else:
            failures.append(f"{name}: no error")
    assert not failures, "\n".join(failures)


def test_distributed_error_paths():
    from apex.testing import run_distributed
    run_distributed(check_distributed_error_paths, 1, timeout_s=60.0)


# --------------------------------------------------------------------------------------------- the classes
@pytest.mark.parametrize("cls,bases", [
    (_errors.AssertValueError, (ValueError, AssertionError)),
    (_errors.AssertTypeError, (TypeError, AssertionError)),
    (_errors.AssertRuntimeError, (RuntimeError, AssertionError)),
    (_errors.RuntimeValueError, (ValueError, RuntimeError)),
    (_errors.RuntimeTypeError, (TypeError, RuntimeError)),
    (_errors.ParallelStateError, (RuntimeError, AssertionError)),
    (_errors.MicroBatchConfigError, (ValueError, AssertionError)),
])
def test_each_class_is_both_types_and_says_which(cls, bases):
    assert all(issubclass(cls, b) for b in bases)
    assert all(b.__name__ in cls.__doc__ for b in bases), "the docstring names the pair it stands for"


def test_public_classes_keep_their_homes():
    from apex.transformer import microbatches, parallel_state

    assert parallel_state.ParallelStateError is _errors.ParallelStateError
    assert microbatches.MicroBatchConfigError is _errors.MicroBatchConfigError
    for cls in (_errors.ParallelStateError, _errors.MicroBatchConfigError):
        error = pickle.loads(pickle.dumps(cls("message")))
        assert type(error) is cls and str(error) == "message"
    assert parallel_state.ParallelStateError.__module__ == "apex.transformer.parallel_state"
    assert microbatches.MicroBatchConfigError.__module__ == "apex.transformer.microbatches"


def test_former_homes_name_the_shared_classes():
    """Classes that lived in other modules are apex._errors' own now; their former names still import."""
    from apex.ops import _norm
    from apex.optimizers import _lamb_common

    for old, cls in ((_norm.NormShapeError, _errors.RuntimeValueError),
                     (_norm.NormDtypeError, _errors.RuntimeTypeError),
                     (_lamb_common.ParamMismatchError, _errors.RuntimeValueError)):
        assert old is cls
        error = pickle.loads(pickle.dumps(old("message")))
        assert type(error) is cls and str(error) == "message"


def test_error_classes_have_one_home():
    """No module but apex._errors defines a class on two of the builtin types clients catch."""
    import ast
    import pathlib

    import apex

    builtin = {"ValueError", "TypeError", "RuntimeError", "AssertionError"}
    root = pathlib.Path(apex.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "_errors.py" and path.parent == root:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                bases = {b.id for b in node.bases if isinstance(b, ast.Name)} & builtin
                if len(bases) >= 2:
                    found.append(f"{path.relative_to(root.parent)}: {node.name}")
    assert not found, f"define these in apex/_errors.py: {found}"
