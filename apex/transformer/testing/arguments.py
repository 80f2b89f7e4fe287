"""Megatron-LM's command-line arguments, reduced to those apex.transformer's standalone models and tests
read (names and defaults as upstream's ``apex.transformer.testing.arguments``)."""

from __future__ import annotations

import argparse
import os

import torch


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(title="network size")
    g.add_argument("--num-layers", type=int, default=None)
    g.add_argument("--hidden-size", type=int, default=None)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--num-attention-heads", type=int, default=None)
    g.add_argument("--kv-channels", type=int, default=None)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--layernorm-epsilon", type=float, default=1e-5)
    g.add_argument("--apply-residual-connection-post-layernorm", action="store_true")
    g.add_argument("--openai-gelu", action="store_true")
    g.add_argument("--onnx-safe", type=bool, required=False)
    g.add_argument("--bert-no-binary-head", action="store_false", dest="bert_binary_head")
    g.add_argument("--num-experts", type=int, default=None)
    g.add_argument("--padded-vocab-size", type=int, default=None)
    g.add_argument("--vocab-size", type=int, default=None)
    g = p.add_argument_group(title="regularization")
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--seed", type=int, default=1234)


def _add_training_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(title="training")
    g.add_argument("--micro-batch-size", type=int, default=None)
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--rampup-batch-size", nargs="*", default=None)
    g.add_argument("--seq-length", type=int, default=None)
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--recompute-granularity", type=str, default=None, choices=["full", "selective"])
    g.add_argument("--recompute-method", type=str, default=None, choices=["uniform", "block"])
    g.add_argument("--recompute-num-layers", type=int, default=1)
    g.add_argument("--distribute-saved-activations", action="store_true")
    g.add_argument("--no-masked-softmax-fusion", action="store_false", dest="masked_softmax_fusion")
    g.add_argument("--no-bias-gelu-fusion", action="store_false", dest="bias_gelu_fusion")
    g.add_argument("--no-bias-dropout-fusion", action="store_false", dest="bias_dropout_fusion")
    g.add_argument("--no-persist-layer-norm", action="store_true")
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--no-gradient-accumulation-fusion", action="store_false", dest="gradient_accumulation_fusion")
    g.add_argument("--no-async-tensor-model-parallel-allreduce", action="store_false",
                   dest="async_tensor_model_parallel_allreduce")
    g.add_argument("--cpu-offload", action="store_true", default=False)
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp32-residual-connection", action="store_true")
    g.add_argument("--apply-query-key-layer-scaling", action="store_true")
    g.add_argument("--attention-softmax-in-fp32", action="store_true")
    g.add_argument("--fp16-lm-cross-entropy", action="store_true")


def _add_distributed_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(title="distributed")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-split-rank", type=int, default=None)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g.add_argument("--distributed-backend", default="nccl", choices=["nccl", "gloo", "ucc"])
    g.add_argument("--local_rank", type=int, default=None)
    g.add_argument("--standalone-embedding-stage", action="store_true", default=False)
    g.add_argument("--use-cpu-initialization", action="store_true", default=None)


def parse_args(extra_args_provider=None, defaults={}, override_args={}, ignore_unknown_args=False):  # noqa: B006
    """Parse ``sys.argv`` (unknown ones ignored with ``ignore_unknown_args``); ``defaults`` fill arguments
    left at None, ``override_args`` replace any value. Derived values follow Megatron."""
    parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
    _add_model_args(parser)
    _add_training_args(parser)
    _add_distributed_args(parser)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    args = parser.parse_known_args()[0] if ignore_unknown_args else parser.parse_args()
    args.rank = int(os.getenv("RANK", "0"))
    args.world_size = int(os.getenv("WORLD_SIZE", "1"))
    for key, value in defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    for key, value in override_args.items():
        setattr(args, key, value)
    args.tensor_model_parallel_size = min(args.tensor_model_parallel_size, args.world_size)
    args.pipeline_model_parallel_size = min(args.pipeline_model_parallel_size,
                                            args.world_size // args.tensor_model_parallel_size)
    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    if args.world_size % model_parallel:
        raise ValueError(f"world size ({args.world_size}) is not divisible by tensor model parallel size "
                         f"({args.tensor_model_parallel_size}) times pipeline model parallel size "
                         f"({args.pipeline_model_parallel_size})")
    args.data_parallel_size = args.world_size // model_parallel
    args.transformer_pipeline_model_parallel_size = (
        args.pipeline_model_parallel_size - 1 if args.standalone_embedding_stage else args.pipeline_model_parallel_size)
    args.virtual_pipeline_model_parallel_size = None
    if args.num_layers_per_virtual_pipeline_stage is not None:
        args.virtual_pipeline_model_parallel_size = (
            args.num_layers // args.transformer_pipeline_model_parallel_size
        ) // args.num_layers_per_virtual_pipeline_stage
    if args.global_batch_size is None and args.micro_batch_size is not None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    args.params_dtype = torch.half if args.fp16 else torch.bfloat16 if args.bf16 else torch.float
    if args.fp16 and args.bf16:
        raise ValueError("--fp16 and --bf16 are mutually exclusive")
    if args.bf16:
        args.accumulate_allreduce_grads_in_fp32 = True
    if args.ffn_hidden_size is None and args.hidden_size is not None:
        args.ffn_hidden_size = 4 * args.hidden_size
    if args.kv_channels is None and args.hidden_size is not None and args.num_attention_heads:
        if args.hidden_size % args.num_attention_heads:
            raise ValueError(f"hidden size ({args.hidden_size}) is not divisible by the number of attention heads "
                             f"({args.num_attention_heads})")
        args.kv_channels = args.hidden_size // args.num_attention_heads
    if args.padded_vocab_size is None and args.vocab_size is not None:
        multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
        args.padded_vocab_size = -(-args.vocab_size // multiple) * multiple
    if args.sequence_parallel and args.tensor_model_parallel_size == 1:
        args.sequence_parallel = False
    if args.sequence_parallel:
        args.async_tensor_model_parallel_allreduce = False
    if args.use_cpu_initialization is None:
        args.use_cpu_initialization = False
    args.model_type = getattr(args, "model_type", None)
    return args
