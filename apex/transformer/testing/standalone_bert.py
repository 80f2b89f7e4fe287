"""BERT (bidirectional encoder with masked-LM and binary heads) built on the standalone language model."""

from __future__ import annotations

import contextlib

import torch

from apex.transformer import tensor_parallel
from apex.transformer.enums import AttnMaskType
from apex.transformer.layers import FusedLayerNorm as LayerNorm
from apex.transformer.testing.global_vars import get_args
from apex.transformer.testing.standalone_transformer_lm import (
    MegatronModule,
    erf_gelu,
    get_language_model,
    get_linear_layer,
    init_method_normal,
    openai_gelu,
    parallel_lm_logits,
    scaled_init_method_normal,
)


def bert_extended_attention_mask(attention_mask):
    """[b, s] padding mask (1 = keep) -> [b, 1, s, s] boolean mask (True = masked)."""
    mask_bss = attention_mask.unsqueeze(1) * attention_mask.unsqueeze(2)
    return mask_bss.unsqueeze(1) < 0.5


def bert_position_ids(token_ids):
    """Position ids ``0..s-1`` for each row of ``token_ids`` ``[b, s]``."""
    seq_length = token_ids.size(1)
    return torch.arange(seq_length, dtype=torch.long, device=token_ids.device).unsqueeze(0).expand_as(token_ids)


class BertLMHead(MegatronModule):
    """dense -> GELU -> LayerNorm -> logits against the word embeddings (+ bias)."""

    def __init__(self, mpu_vocab_size, hidden_size, init_method, layernorm_epsilon, parallel_output):
        super().__init__()
        args = get_args()
        self.bias = torch.nn.Parameter(torch.zeros(mpu_vocab_size))
        self.parallel_output = parallel_output
        self.dense = get_linear_layer(hidden_size, hidden_size, init_method)
        self.dense.weight.sequence_parallel = args.sequence_parallel
        self.dense.bias.sequence_parallel = args.sequence_parallel
        self.layernorm = LayerNorm(hidden_size, eps=layernorm_epsilon, sequence_parallel_enabled=args.sequence_parallel)
        self.gelu = openai_gelu if args.openai_gelu else erf_gelu if args.onnx_safe else torch.nn.functional.gelu

    def forward(self, hidden_states, word_embeddings_weight):
        hidden_states = self.layernorm(self.gelu(self.dense(hidden_states)))
        return parallel_lm_logits(hidden_states, word_embeddings_weight, self.parallel_output, bias=self.bias)


def post_language_model_processing(lm_output, pooled_output, lm_head, binary_head, lm_labels, logit_weights,
                                   fp16_lm_cross_entropy):
    """BERT's heads: LM logits (and the loss when ``lm_labels`` is given) and the binary-head logits."""
    lm_logits = lm_head(lm_output, logit_weights)
    binary_logits = binary_head(pooled_output) if binary_head is not None else None
    if lm_labels is None:
        return lm_logits.transpose(0, 1).contiguous(), binary_logits
    lm_labels = lm_labels.transpose(0, 1).contiguous()
    if fp16_lm_cross_entropy:
        lm_loss = tensor_parallel.vocab_parallel_cross_entropy(lm_logits, lm_labels)
    else:
        lm_loss = tensor_parallel.vocab_parallel_cross_entropy(lm_logits.float(), lm_labels)
    return lm_loss, binary_logits


class BertModel(MegatronModule):
    """BERT language model."""

    def __init__(self, num_tokentypes=2, add_binary_head=True, parallel_output=True, pre_process=True,
                 post_process=True, cpu_offload=False):
        super().__init__()
        args = get_args()
        self.fp16_lm_cross_entropy = args.fp16_lm_cross_entropy
        self.add_binary_head = add_binary_head
        self.parallel_output = parallel_output
        self.pre_process = pre_process
        self.post_process = post_process
        init_method = init_method_normal(args.init_method_std)
        scaled_init_method = scaled_init_method_normal(args.init_method_std, args.num_layers)
        self.language_model, self._language_model_key = get_language_model(
            num_tokentypes=num_tokentypes, add_pooler=add_binary_head, encoder_attn_mask_type=AttnMaskType.padding,
            init_method=init_method, scaled_init_method=scaled_init_method, pre_process=pre_process,
            post_process=post_process)
        self.initialize_word_embeddings(init_method_normal)
        if post_process:
            self.lm_head = BertLMHead(self.word_embeddings_weight().size(0), args.hidden_size, init_method,
                                      args.layernorm_epsilon, parallel_output)
            self._lm_head_key = "lm_head"
            self.binary_head = None
            if add_binary_head:
                self.binary_head = get_linear_layer(args.hidden_size, 2, init_method)
                self._binary_head_key = "binary_head"
        self.forward_context = torch.autograd.graph.save_on_cpu if cpu_offload else contextlib.nullcontext

    def set_input_tensor(self, input_tensor):
        self.language_model.set_input_tensor(input_tensor)

    def forward(self, bert_model_input, attention_mask, tokentype_ids=None, lm_labels=None):
        with self.forward_context():
            extended_attention_mask = bert_extended_attention_mask(attention_mask)
            position_ids = bert_position_ids(bert_model_input)
            lm_output = self.language_model(bert_model_input, position_ids, extended_attention_mask,
                                            tokentype_ids=tokentype_ids)
            pooled_output = None
            if self.post_process and self.add_binary_head:
                lm_output, pooled_output = lm_output
            if not self.post_process:
                return lm_output
            return post_language_model_processing(lm_output, pooled_output, self.lm_head, self.binary_head,
                                                  lm_labels, self.word_embeddings_weight(),
                                                  self.fp16_lm_cross_entropy)


def bert_model_provider(pre_process=True, post_process=True, cpu_offload=False):
    """Build the standalone :class:`BertModel` from the global test arguments."""
    args = get_args()
    return BertModel(num_tokentypes=2 if args.bert_binary_head else 0, add_binary_head=args.bert_binary_head,
                     parallel_output=True, pre_process=pre_process, post_process=post_process,
                     cpu_offload=cpu_offload)
