"""Second half of :mod:`apex.transformer.testing.standalone_transformer_lm`: embeddings, pooler and the
language model."""

from __future__ import annotations

import torch

from apex.transformer import tensor_parallel
from apex.transformer.enums import AttnMaskType, LayerType
from apex.transformer.testing.global_vars import get_args
from apex.transformer.testing.standalone_transformer_lm import (
    MegatronModule,
    ParallelTransformer,
    get_linear_layer,
    init_method_normal,
    parallel_lm_logits,
    scaled_init_method_normal,
)


class Pooler(MegatronModule):
    """tanh(W h[sequence_index] + b)."""

    def __init__(self, hidden_size, init_method):
        super().__init__()
        args = get_args()
        self.dense = get_linear_layer(hidden_size, hidden_size, init_method)
        self.sequence_parallel = args.sequence_parallel

    def forward(self, hidden_states, sequence_index=0):
        if self.sequence_parallel:
            hidden_states = tensor_parallel.mappings.gather_from_sequence_parallel_region(
                hidden_states, to_model_parallel=False)
        return torch.tanh(self.dense(hidden_states[sequence_index, :, :]))


class Embedding(MegatronModule):
    """Word (vocabulary parallel) + position (+ token type) embeddings, ``[b, s] -> [s, b, h]``."""

    def __init__(self, hidden_size, vocab_size, max_sequence_length, embedding_dropout_prob, init_method,
                 num_tokentypes=0):
        super().__init__()
        args = get_args()
        self.hidden_size = hidden_size
        self.init_method = init_method
        self.num_tokentypes = num_tokentypes
        self.word_embeddings = tensor_parallel.VocabParallelEmbedding(
            vocab_size, hidden_size, init_method=init_method, params_dtype=args.params_dtype,
            use_cpu_initialization=args.use_cpu_initialization)
        self._word_embeddings_key = "word_embeddings"
        self.position_embeddings = torch.nn.Embedding(max_sequence_length, hidden_size, dtype=args.params_dtype)
        self._position_embeddings_key = "position_embeddings"
        init_method(self.position_embeddings.weight)
        self._tokentype_embeddings_key = "tokentype_embeddings"
        self.tokentype_embeddings = None
        if num_tokentypes > 0:
            self.tokentype_embeddings = torch.nn.Embedding(num_tokentypes, hidden_size, dtype=args.params_dtype)
            init_method(self.tokentype_embeddings.weight)
        self.fp32_residual_connection = args.fp32_residual_connection
        self.sequence_parallel = args.sequence_parallel
        self.embedding_dropout = torch.nn.Dropout(embedding_dropout_prob)

    def zero_parameters(self):
        for emb in (self.word_embeddings, self.position_embeddings, self.tokentype_embeddings):
            if emb is not None:
                emb.weight.data.fill_(0)
                emb.weight.shared = True

    def add_tokentype_embeddings(self, num_tokentypes):
        if self.tokentype_embeddings is not None:
            raise Exception("tokentype embeddings is already initialized")
        self.num_tokentypes = num_tokentypes
        self.tokentype_embeddings = torch.nn.Embedding(num_tokentypes, self.hidden_size)
        self.init_method(self.tokentype_embeddings.weight)

    def forward(self, input_ids, position_ids, tokentype_ids=None):
        embeddings = self.word_embeddings(input_ids) + self.position_embeddings(position_ids)
        if tokentype_ids is not None:
            if self.tokentype_embeddings is None:
                raise ValueError("tokentype_ids given but the embedding has no token types")
            embeddings = embeddings + self.tokentype_embeddings(tokentype_ids)
        embeddings = embeddings.transpose(0, 1).contiguous()
        if self.fp32_residual_connection:
            embeddings = embeddings.float()
        if self.sequence_parallel:
            embeddings = tensor_parallel.scatter_to_sequence_parallel_region(embeddings)
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return self.embedding_dropout(embeddings)
        return self.embedding_dropout(embeddings)


class TransformerLanguageModel(MegatronModule):
    """Embedding (first stage), transformer encoder, optional pooler (last stage)."""

    def __init__(self, init_method, output_layer_init_method, encoder_attn_mask_type, num_tokentypes=0,
                 add_encoder=True, add_decoder=False, decoder_attn_mask_type=AttnMaskType.causal, add_pooler=False,
                 pre_process=True, post_process=True):
        super().__init__()
        if add_decoder:
            raise NotImplementedError("the standalone language model is encoder/decoder-only (no T5 decoder)")
        args = get_args()
        self.pre_process, self.post_process = pre_process, post_process
        self.hidden_size = args.hidden_size
        self.num_tokentypes = num_tokentypes
        self.init_method = init_method
        self.add_encoder, self.add_decoder = add_encoder, add_decoder
        self.encoder_attn_mask_type = encoder_attn_mask_type
        self.add_pooler = add_pooler
        self.encoder_hidden_state = None
        if pre_process:
            self.embedding = Embedding(self.hidden_size, args.padded_vocab_size, args.max_position_embeddings,
                                       args.hidden_dropout, init_method, num_tokentypes)
            self._embedding_key = "embedding"
        self.encoder = None
        if add_encoder:
            self.encoder = ParallelTransformer(init_method, output_layer_init_method,
                                               self_attn_mask_type=encoder_attn_mask_type, pre_process=pre_process,
                                               post_process=post_process, layer_type=LayerType.encoder)
            self._encoder_key = "encoder"
        if post_process and add_pooler:
            self.pooler = Pooler(self.hidden_size, init_method)
            self._pooler_key = "pooler"

    def set_input_tensor(self, input_tensor):
        if not isinstance(input_tensor, list):
            input_tensor = [input_tensor]
        if len(input_tensor) != 1:
            raise ValueError(f"input_tensor should only be length 1 for the encoder, got {len(input_tensor)}")
        if self.encoder is not None:
            self.encoder.set_input_tensor(input_tensor[0])
        else:
            self.encoder_hidden_state = input_tensor[0]

    def forward(self, enc_input_ids, enc_position_ids, enc_attn_mask, dec_input_ids=None, dec_position_ids=None,
                dec_attn_mask=None, enc_dec_attn_mask=None, tokentype_ids=None, inference_params=None,
                pooling_sequence_index=0, enc_hidden_states=None, output_enc_hidden=False):
        encoder_input = self.embedding(enc_input_ids, enc_position_ids, tokentype_ids=tokentype_ids) \
            if self.pre_process else None
        if enc_hidden_states is None:
            encoder_output = self.encoder(encoder_input, enc_attn_mask, inference_params=inference_params) \
                if self.encoder is not None else self.encoder_hidden_state
        else:
            encoder_output = enc_hidden_states
        if self.post_process and self.add_pooler:
            return encoder_output, self.pooler(encoder_output, pooling_sequence_index)
        return encoder_output


def get_language_model(num_tokentypes, add_pooler, encoder_attn_mask_type, init_method=None, scaled_init_method=None,
                       add_encoder=True, add_decoder=False, decoder_attn_mask_type=AttnMaskType.causal,
                       pre_process=True, post_process=True):
    """(language model, its checkpoint key)."""
    args = get_args()
    init_method = init_method or init_method_normal(args.init_method_std)
    scaled_init_method = scaled_init_method or scaled_init_method_normal(args.init_method_std, args.num_layers)
    model = TransformerLanguageModel(init_method, scaled_init_method, encoder_attn_mask_type,
                                     num_tokentypes=num_tokentypes, add_encoder=add_encoder, add_decoder=add_decoder,
                                     decoder_attn_mask_type=decoder_attn_mask_type, add_pooler=add_pooler,
                                     pre_process=pre_process, post_process=post_process)
    return model, "language_model"


def post_language_model_processing(lm_output, labels, logit_weights, parallel_output, fp16_lm_cross_entropy):
    """Logits, or the per-token vocabulary-parallel cross-entropy when ``labels`` (``[s, b]``) are given."""
    output = parallel_lm_logits(lm_output, logit_weights, parallel_output)
    if labels is None:
        return output
    if fp16_lm_cross_entropy:
        if output.dtype != torch.half:
            raise TypeError(f"fp16_lm_cross_entropy needs half logits, got {output.dtype}")
        return tensor_parallel.vocab_parallel_cross_entropy(output, labels)
    return tensor_parallel.vocab_parallel_cross_entropy(output.float(), labels)


def module_size(m: torch.nn.Module, only_trainable: bool = False) -> int:
    """Number of (trainable) elements of ``m``'s parameters."""
    return sum(p.numel() for p in m.parameters() if p.requires_grad or not only_trainable)
