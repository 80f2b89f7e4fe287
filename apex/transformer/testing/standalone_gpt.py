"""GPT (decoder-only, causal attention) built on the standalone transformer language model."""

from __future__ import annotations

import contextlib

import torch

from apex.transformer.enums import AttnMaskType
from apex.transformer.testing.global_vars import get_args
from apex.transformer.testing.standalone_transformer_lm import (
    MegatronModule,
    get_language_model,
    init_method_normal,
    post_language_model_processing,
    scaled_init_method_normal,
)


def gpt_model_provider(pre_process: bool = True, post_process: bool = True, cpu_offload: bool = False) -> GPTModel:
    """Build the standalone :class:`GPTModel` from the global test arguments."""
    args = get_args()
    return GPTModel(num_tokentypes=0, parallel_output=True, pre_process=pre_process, post_process=post_process,
                    cpu_offload=args.cpu_offload)


class GPTModel(MegatronModule):
    """GPT-2 language model; ``forward`` returns per-token losses ``[b, s]`` when labels are given, else
    the (vocabulary-parallel) logits ``[s, b, V/T]``."""

    def __init__(self, num_tokentypes: int = 0, parallel_output: bool = True, pre_process: bool = True,
                 post_process: bool = True, cpu_offload: bool = False):
        super().__init__()
        args = get_args()
        self.forward_context = torch.autograd.graph.save_on_cpu if cpu_offload else contextlib.nullcontext
        self.parallel_output = parallel_output
        self.pre_process = pre_process
        self.post_process = post_process
        self.fp16_lm_cross_entropy = args.fp16_lm_cross_entropy
        self.language_model, self._language_model_key = get_language_model(
            num_tokentypes=num_tokentypes, add_pooler=False, encoder_attn_mask_type=AttnMaskType.causal,
            init_method=init_method_normal(args.init_method_std),
            scaled_init_method=scaled_init_method_normal(args.init_method_std, args.num_layers),
            pre_process=pre_process, post_process=post_process)
        self.initialize_word_embeddings(init_method_normal)

    def set_input_tensor(self, input_tensor):
        self.language_model.set_input_tensor(input_tensor)

    def forward(self, input_ids, position_ids, attention_mask, labels=None, tokentype_ids=None,
                inference_params=None):
        with self.forward_context():
            lm_output = self.language_model(input_ids, position_ids, attention_mask, inference_params=inference_params)
            if not self.post_process:
                return lm_output
            loss = post_language_model_processing(
                lm_output, labels.t().contiguous() if labels is not None else None, self.word_embeddings_weight(),
                self.parallel_output, self.fp16_lm_cross_entropy)
            return loss.t().contiguous() if labels is not None else loss
