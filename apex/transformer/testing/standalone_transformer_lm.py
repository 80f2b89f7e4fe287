"""A Megatron-LM transformer language model built from apex.transformer's tensor-parallel layers, for
tests and examples (upstream's ``standalone_transformer_lm``, encoder/decoder-only part).

Activations are ``[sequence, batch, hidden]``; with ``args.sequence_parallel`` they are split along the
sequence between the tensor-parallel layers. Attention uses PyTorch's softmax (upstream used the fused
kernels); encoder-decoder (T5) cross attention is not provided. All hyper-parameters come from
``global_vars.get_args()``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from apex.transformer import parallel_state, tensor_parallel
from apex.transformer.enums import AttnMaskType, AttnType, LayerType, ModelType
from apex.transformer.layers import FusedLayerNorm as LayerNorm
from apex.transformer.testing.global_vars import get_args
from apex.transformer.utils import divide


def param_is_not_shared(param: torch.Tensor) -> bool:
    """True unless the parameter is marked ``shared`` (tied embeddings)."""
    return not getattr(param, "shared", False)


class MegatronModule(torch.nn.Module):
    """Module with Megatron's shared word embeddings across the first and last pipeline stages."""

    def __init__(self, share_word_embeddings: bool = True) -> None:
        super().__init__()
        self.share_word_embeddings = share_word_embeddings

    def word_embeddings_weight(self):
        if self.pre_process:
            return self.language_model.embedding.word_embeddings.weight
        if not self.share_word_embeddings:
            raise Exception("word_embeddings_weight() called for last stage, but share_word_embeddings is false")
        return self.word_embeddings.weight

    def initialize_word_embeddings(self, init_method_normal):
        """Give the last pipeline stage a copy of the word embeddings, equal to the first stage's."""
        args = get_args()
        if not self.share_word_embeddings:
            raise Exception("initialize_word_embeddings() was called but share_word_embeddings is false")
        if args.pipeline_model_parallel_size == 1:
            return
        if parallel_state.is_pipeline_last_stage() and not self.pre_process:
            self._word_embeddings_for_head_key = "word_embeddings_for_head"
            self.word_embeddings = tensor_parallel.VocabParallelEmbedding(
                args.padded_vocab_size, args.hidden_size, init_method=init_method_normal(args.init_method_std))
            self.word_embeddings.weight.data.fill_(0)
            self.word_embeddings.weight.shared = True
        if not parallel_state.is_pipeline_first_stage(ignore_virtual=True) and self.pre_process:
            self.language_model.embedding.zero_parameters()
        if parallel_state.is_rank_in_embedding_group():
            torch.distributed.all_reduce(self.word_embeddings_weight().data,
                                         group=parallel_state.get_embedding_group())
        if parallel_state.is_rank_in_position_embedding_group() and args.pipeline_model_parallel_split_rank is not None:
            torch.distributed.all_reduce(self.language_model.embedding.position_embeddings.weight.data,
                                         group=parallel_state.get_position_embedding_group())


def get_linear_layer(rows, columns, init_method):
    """An ``nn.Linear(rows, columns)`` with ``init_method`` weights and a zero bias."""
    layer = torch.nn.Linear(rows, columns)
    init_method(layer.weight)
    with torch.no_grad():
        layer.bias.zero_()
    return layer


def attention_mask_func(attention_scores: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Fill masked attention scores (``attention_mask`` True) with -10000."""
    return attention_scores.masked_fill(attention_mask, -10000.0)


def init_method_normal(sigma):
    """An initialiser drawing from ``N(0, sigma²)``."""
    def init_(tensor):
        return torch.nn.init.normal_(tensor, mean=0.0, std=sigma)
    return init_


def scaled_init_method_normal(sigma, num_layers):
    """An initialiser drawing from ``N(0, (sigma / sqrt(2 num_layers))²)`` (output layers)."""
    return init_method_normal(sigma / math.sqrt(2.0 * num_layers))


def openai_gelu(x):
    """GELU, tanh approximation: ``0.5 x (1 + tanh(sqrt(2/π) (x + 0.044715 x³)))``."""
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))


def erf_gelu(x):
    """GELU, exact: ``x Φ(x)`` through ``erf``."""
    return x * 0.5 * (torch.erf(x / 1.41421) + torch.ones_like(x))


class ParallelMLP(MegatronModule):
    """h -> ffn (column parallel) -> GELU -> h (row parallel); returns (output, bias)."""

    def __init__(self, init_method, output_layer_init_method):
        super().__init__()
        args = get_args()
        self.dense_h_to_4h = tensor_parallel.ColumnParallelLinear(
            args.hidden_size, args.ffn_hidden_size, gather_output=False, init_method=init_method, skip_bias_add=True,
            no_async_tensor_model_parallel_allreduce=not args.async_tensor_model_parallel_allreduce,
            use_cpu_initialization=args.use_cpu_initialization, params_dtype=args.params_dtype,
            sequence_parallel_enabled=args.sequence_parallel)
        self.activation_func = openai_gelu if args.openai_gelu else erf_gelu if args.onnx_safe else F.gelu
        self.dense_4h_to_h = tensor_parallel.RowParallelLinear(
            args.ffn_hidden_size, args.hidden_size, input_is_parallel=True, init_method=output_layer_init_method,
            skip_bias_add=True, use_cpu_initialization=args.use_cpu_initialization, params_dtype=args.params_dtype,
            sequence_parallel_enabled=args.sequence_parallel)

    def forward(self, hidden_states):
        intermediate, bias = self.dense_h_to_4h(hidden_states)
        return self.dense_4h_to_h(self.activation_func(intermediate + bias))


class CoreAttention(MegatronModule):
    """softmax(Q K^T / sqrt(d) masked) V over this rank's heads; dropout in the tracker's fork."""

    def __init__(self, layer_number, attn_mask_type=AttnMaskType.padding):
        super().__init__()
        args = get_args()
        self.attn_mask_type = attn_mask_type
        self.layer_number = max(1, layer_number)
        self.attention_softmax_in_fp32 = args.attention_softmax_in_fp32 or args.apply_query_key_layer_scaling
        self.sequence_parallel = args.sequence_parallel
        world_size = parallel_state.get_tensor_model_parallel_world_size()
        projection_size = args.kv_channels * args.num_attention_heads
        self.hidden_size_per_partition = divide(projection_size, world_size)
        self.hidden_size_per_attention_head = divide(projection_size, args.num_attention_heads)
        self.num_attention_heads_per_partition = divide(args.num_attention_heads, world_size)
        self.norm_factor = math.sqrt(self.hidden_size_per_attention_head)
        self.attention_dropout = torch.nn.Dropout(args.attention_dropout)

    def forward(self, query_layer, key_layer, value_layer, attention_mask):
        # [s, b, np, hn] -> [b, np, s, hn]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query_layer, key_layer, value_layer))
        scores = torch.matmul(q, k.transpose(-1, -2)) / self.norm_factor
        if self.attention_softmax_in_fp32:
            scores = scores.float()
        if self.attn_mask_type == AttnMaskType.causal:
            sq, sk = scores.shape[-2:]
            causal = torch.ones(sq, sk, dtype=torch.bool, device=scores.device).triu(1)
            attention_mask = causal if attention_mask is None else (attention_mask | causal)
        if attention_mask is not None:
            scores = attention_mask_func(scores, attention_mask)
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        if self.sequence_parallel:
            probs = self.attention_dropout(probs)
        else:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                probs = self.attention_dropout(probs)
        context = torch.matmul(probs, v)  # [b, np, s, hn]
        return context.permute(2, 0, 1, 3).reshape(context.size(2), context.size(0), self.hidden_size_per_partition)


class ParallelAttention(MegatronModule):
    """Self attention: fused QKV (column parallel, heads split over ranks), core attention, output
    projection (row parallel); returns (output, bias)."""

    def __init__(self, init_method, output_layer_init_method, layer_number, attention_type=AttnType.self_attn,
                 attn_mask_type=AttnMaskType.padding):
        super().__init__()
        if attention_type != AttnType.self_attn:
            raise NotImplementedError("the standalone model provides self attention only")
        args = get_args()
        projection_size = args.kv_channels * args.num_attention_heads
        world_size = parallel_state.get_tensor_model_parallel_world_size()
        self.num_attention_heads_per_partition = divide(args.num_attention_heads, world_size)
        self.hidden_size_per_attention_head = divide(projection_size, args.num_attention_heads)
        common = dict(use_cpu_initialization=args.use_cpu_initialization, params_dtype=args.params_dtype,
                      sequence_parallel_enabled=args.sequence_parallel)
        self.query_key_value = tensor_parallel.ColumnParallelLinear(
            args.hidden_size, 3 * projection_size, gather_output=False, init_method=init_method,
            no_async_tensor_model_parallel_allreduce=not args.async_tensor_model_parallel_allreduce, **common)
        self.core_attention = CoreAttention(layer_number, attn_mask_type)
        self.dense = tensor_parallel.RowParallelLinear(
            projection_size, args.hidden_size, input_is_parallel=True, init_method=output_layer_init_method,
            skip_bias_add=True, **common)

    def forward(self, hidden_states, attention_mask, encoder_output=None, inference_params=None):
        mixed, _ = self.query_key_value(hidden_states)
        # [s, b, np * 3 * hn] -> [s, b, np, 3 * hn]: each head's q, k, v are contiguous
        mixed = mixed.view(*mixed.shape[:-1], self.num_attention_heads_per_partition,
                           3 * self.hidden_size_per_attention_head)
        q, k, v = torch.split(mixed, self.hidden_size_per_attention_head, dim=-1)
        return self.dense(self.core_attention(q, k, v, attention_mask))


def bias_dropout_add(x, bias, residual, prob: float, training: bool):
    """``residual + dropout(x + bias)``."""
    return residual + F.dropout(x + bias, p=prob, training=training)


def get_bias_dropout_add(training):
    """``bias_dropout_add`` with ``training`` bound."""
    def _bias_dropout_add(x, bias, residual, prob):
        return bias_dropout_add(x, bias, residual, prob, training)
    return _bias_dropout_add


class ParallelTransformerLayer(MegatronModule):
    """Pre-LayerNorm transformer block: x + Attn(LN(x)), then + MLP(LN(.))."""

    def __init__(self, init_method, output_layer_init_method, layer_number, layer_type=LayerType.encoder,
                 self_attn_mask_type=AttnMaskType.padding, drop_path_rate=0.0):
        super().__init__()
        args = get_args()
        self.layer_number = layer_number
        self.layer_type = layer_type
        self.apply_residual_connection_post_layernorm = args.apply_residual_connection_post_layernorm
        self.hidden_dropout = args.hidden_dropout
        ln = dict(eps=args.layernorm_epsilon, sequence_parallel_enabled=args.sequence_parallel)
        self.input_layernorm = LayerNorm(args.hidden_size, **ln)
        self.self_attention = ParallelAttention(init_method, output_layer_init_method, layer_number,
                                                attention_type=AttnType.self_attn, attn_mask_type=self_attn_mask_type)
        self.post_attention_layernorm = LayerNorm(args.hidden_size, **ln)
        self.mlp = ParallelMLP(init_method, output_layer_init_method)

    def forward(self, hidden_states, attention_mask, encoder_output=None, enc_dec_attn_mask=None,
                inference_params=None):
        bda = get_bias_dropout_add(self.training)
        ln_out = self.input_layernorm(hidden_states)
        attn, attn_bias = self.self_attention(ln_out, attention_mask)
        residual = ln_out if self.apply_residual_connection_post_layernorm else hidden_states
        ln_input = bda(attn, attn_bias.expand_as(residual), residual, self.hidden_dropout)
        ln_out = self.post_attention_layernorm(ln_input)
        mlp, mlp_bias = self.mlp(ln_out)
        residual = ln_out if self.apply_residual_connection_post_layernorm else ln_input
        return bda(mlp, mlp_bias.expand_as(residual), residual, self.hidden_dropout)


def get_num_layers(args, is_encoder_and_decoder_model):
    """Number of transformer layers on this pipeline stage."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return args.num_layers
    stages = args.transformer_pipeline_model_parallel_size
    if args.num_layers % stages:
        raise ValueError(f"num_layers ({args.num_layers}) must be divisible by the pipeline size ({stages})")
    if args.standalone_embedding_stage and parallel_state.get_pipeline_model_parallel_rank() == 0:
        return 0
    return args.num_layers // stages


class NoopTransformerLayer(MegatronModule):
    def __init__(self, layer_number):
        super().__init__()
        self.layer_number = layer_number

    def forward(self, hidden_states, attention_mask, encoder_output=None, enc_dec_attn_mask=None,
                inference_params=None):
        return hidden_states.clone()


class ParallelTransformer(MegatronModule):
    """This pipeline stage's transformer layers (and the final LayerNorm on the last stage)."""

    def __init__(self, init_method, output_layer_init_method, layer_type=LayerType.encoder,
                 self_attn_mask_type=AttnMaskType.padding, post_layer_norm=True, pre_process=True,
                 post_process=True, drop_path_rate=0.0):
        super().__init__()
        args = get_args()
        self.layer_type = layer_type
        self.pre_process, self.post_process = pre_process, post_process
        self.post_layer_norm = post_layer_norm
        self.input_tensor = None
        self.recompute_granularity = args.recompute_granularity
        self.recompute_num_layers = args.recompute_num_layers
        self.distribute_saved_activations = args.distribute_saved_activations and not args.sequence_parallel
        self.num_layers = get_num_layers(args, args.model_type == ModelType.encoder_and_decoder)
        offset = parallel_state.get_pipeline_model_parallel_rank() * self.num_layers
        if self.num_layers == 0:
            self.num_layers = 1
            self.layers = torch.nn.ModuleList([NoopTransformerLayer(1)])
        else:
            self.layers = torch.nn.ModuleList([
                ParallelTransformerLayer(init_method, output_layer_init_method, i + 1 + offset, layer_type=layer_type,
                                         self_attn_mask_type=self_attn_mask_type)
                for i in range(self.num_layers)])
        if post_process and post_layer_norm:
            self.final_layernorm = LayerNorm(args.hidden_size, eps=args.layernorm_epsilon,
                                             sequence_parallel_enabled=args.sequence_parallel)

    def _get_layer(self, layer_number):
        return self.layers[layer_number]

    def set_input_tensor(self, input_tensor):
        """Input of this stage when it is not the first one (set by the pipeline schedule)."""
        self.input_tensor = input_tensor

    def forward(self, hidden_states, attention_mask, encoder_output=None, enc_dec_attn_mask=None,
                inference_params=None):
        if not self.pre_process:
            hidden_states = self.input_tensor
        if self.recompute_granularity == "full":
            step = self.recompute_num_layers
            for start in range(0, self.num_layers, step):
                chunk = self.layers[start:start + step]

                def run(x, mask, _chunk=chunk):
                    for layer in _chunk:
                        x = layer(x, mask)
                    return x
                hidden_states = tensor_parallel.checkpoint(run, self.distribute_saved_activations, hidden_states,
                                                           attention_mask)
        else:
            for layer in self.layers:
                hidden_states = layer(hidden_states, attention_mask, inference_params=inference_params)
        if self.post_process and self.post_layer_norm:
            hidden_states = self.final_layernorm(hidden_states)
        return hidden_states


def parallel_lm_logits(input_, word_embeddings_weight, parallel_output, bias=None):
    """Logits ``input_ @ E^T`` against the vocabulary-parallel word embeddings (split over the vocabulary
    unless ``parallel_output`` is False)."""
    args = get_args()
    if args.async_tensor_model_parallel_allreduce or args.sequence_parallel:
        input_parallel = input_
        async_grad_allreduce = (args.async_tensor_model_parallel_allreduce and not args.sequence_parallel
                                and parallel_state.get_tensor_model_parallel_world_size() > 1)
    else:
        input_parallel = tensor_parallel.copy_to_tensor_model_parallel_region(input_)
        async_grad_allreduce = False
    logits_parallel = tensor_parallel.linear_with_grad_accumulation_and_async_allreduce(
        input_parallel, word_embeddings_weight, bias, False, async_grad_allreduce, args.sequence_parallel)
    if parallel_output:
        return logits_parallel
    return tensor_parallel.gather_from_tensor_model_parallel_region(logits_parallel)


from apex.transformer.testing._standalone_lm_parts import (  # noqa: E402  (the second half of this module)
    Embedding,
    Pooler,
    TransformerLanguageModel,
    get_language_model,
    module_size,
    post_language_model_processing,
)

__all__ = [
    "AttnMaskType", "CoreAttention", "Embedding", "MegatronModule", "NoopTransformerLayer", "ParallelAttention",
    "ParallelMLP", "ParallelTransformer", "ParallelTransformerLayer", "Pooler", "TransformerLanguageModel",
    "attention_mask_func", "bias_dropout_add", "erf_gelu", "get_bias_dropout_add", "get_language_model",
    "get_linear_layer", "get_num_layers", "init_method_normal", "module_size", "openai_gelu", "param_is_not_shared",
    "parallel_lm_logits", "post_language_model_processing", "scaled_init_method_normal",
]
