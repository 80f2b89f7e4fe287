"""The GPT of ``train_gpt.py`` split for tensor × pipeline × data parallelism with ``apex.transformer``.

Layout (Megatron's): ``initialize_model_parallel(T, P)`` splits the world into tensor groups of ``T``
consecutive ranks, pipelines of ``P`` stages and ``D = world / (T P)`` data-parallel replicas.

* Tensor parallelism: attention heads and the MLP's hidden units are split over the ``T`` ranks
  (``ColumnParallelLinear`` for the query/key/value and the MLP's first matrix, ``RowParallelLinear`` for
  the attention output and the MLP's second matrix: two all-reduces forward, two backward per block); the
  byte embedding is a ``VocabParallelEmbedding`` whose vocabulary is split, and the tied output layer
  multiplies by the same shard, giving vocabulary-parallel logits for ``vocab_parallel_cross_entropy``.
  Norms and the position embedding are replicated (their gradients agree on every tensor rank).
* Pipeline parallelism: stage ``p`` holds blocks ``[p L / P, (p+1) L / P)``; the first stage the
  embeddings, the last the final norm and a copy of the byte embedding for the tied output layer, whose
  gradient is all-reduced with the first stage's over the embedding group (Megatron's scheme), so both
  copies take identical steps. Activations travel between stages as ``[sequence, micro-batch, hidden]``.
* Data parallelism: each replica gets ``--batch-size`` rows of the global batch; gradients are averaged
  over the data-parallel group with one all-reduce of a flat buffer per step.

Every rank first builds the one-process model with the run's seed and cuts its shard out of it, so a
parallel run starts from exactly the weights of the one-process run.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from _gpt_model import GPT, VOCAB, causal_attention

from apex.transformer import parallel_state
from apex.transformer.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from apex.transformer.tensor_parallel.layers import (
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
)
from apex.transformer.tensor_parallel.mappings import copy_to_tensor_model_parallel_region


def check_layout(world_size: int, tp: int, pp: int, n_layer: int, n_head: int) -> int:
    """The data-parallel size, or ValueError naming what does not divide."""
    if tp < 1 or pp < 1:
        raise ValueError(f"--tensor-parallel ({tp}) and --pipeline-parallel ({pp}) must be positive")
    if world_size % (tp * pp):
        raise ValueError(f"the world size ({world_size} ranks) is not divisible by --tensor-parallel ({tp}) x "
                         f"--pipeline-parallel ({pp}); start tp*pp*dp ranks with torchrun --nproc_per_node")
    if n_head % tp or VOCAB % tp:
        raise ValueError(f"--tensor-parallel ({tp}) must divide --n-head ({n_head}) and the vocabulary ({VOCAB})")
    if n_layer < pp:
        raise ValueError(f"--n-layer ({n_layer}) must be at least --pipeline-parallel ({pp}): one block per stage")
    return world_size // (tp * pp)


def stage_layers(n_layer: int, pp: int, rank: int) -> range:
    return range(rank * n_layer // pp, (rank + 1) * n_layer // pp)


class ParallelAttention(nn.Module):
    """Causal self-attention over this tensor rank's ``n_head / T`` heads."""

    def __init__(self, n_embd: int, n_head: int, block_size: int, attention: str, tp: int):
        super().__init__()
        self.heads, self.head_dim, self.attention = n_head // tp, n_embd // n_head, attention
        self.qkv = ColumnParallelLinear(n_embd, 3 * n_embd, bias=False, gather_output=False,
                                        use_cpu_initialization=True)
        self.proj = RowParallelLinear(n_embd, n_embd, bias=False, input_is_parallel=True,
                                      use_cpu_initialization=True)
        if attention == "math":
            self.register_buffer("future", torch.ones(block_size, block_size, dtype=torch.bool).triu(1),
                                 persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        qkv, _ = self.qkv(x)
        q, k, v = qkv.reshape(b, t, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        y = causal_attention(q, k, v, self.attention, getattr(self, "future", None))
        out, _ = self.proj(y.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))
        return out


class ParallelBlock(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int, norm: type[nn.Module], attention: str, tp: int):
        super().__init__()
        self.ln1 = norm(n_embd)
        self.attn = ParallelAttention(n_embd, n_head, block_size, attention, tp)
        self.ln2 = norm(n_embd)
        self.fc = ColumnParallelLinear(n_embd, 4 * n_embd, bias=False, gather_output=False,
                                       use_cpu_initialization=True)
        self.out = RowParallelLinear(4 * n_embd, n_embd, bias=False, input_is_parallel=True,
                                     use_cpu_initialization=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        h, _ = self.fc(self.ln2(x))
        return x + self.out(F.gelu(h))[0]


class GPTStage(nn.Module):
    """This rank's part of the GPT: its pipeline stage's blocks, with this tensor rank's shards.

    ``forward(idx, targets)`` returns the hidden states ``[sequence, batch, hidden]`` for the next stage, or
    on the last stage the per-byte cross-entropy ``[batch, sequence]`` (fp32). The input of a stage other
    than the first comes through ``set_input_tensor``, as the pipeline schedules require.
    """

    def __init__(self, n_layer: int, n_head: int, n_embd: int, block_size: int, norm: type[nn.Module],
                 attention: str, *, pre_process: bool, post_process: bool, layers: range):
        super().__init__()
        tp = parallel_state.get_tensor_model_parallel_world_size()
        self.pre_process, self.post_process, self.layers = pre_process, post_process, layers
        self.input_tensor: torch.Tensor | None = None
        if pre_process:
            self.wte = VocabParallelEmbedding(VOCAB, n_embd, use_cpu_initialization=True)
            self.wpe = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(ParallelBlock(n_embd, n_head, block_size, norm, attention, tp) for _ in layers)
        if post_process:
            self.ln_f = norm(n_embd)
            if not pre_process:
                # The last stage's copy of the tied byte embedding: "shared" keeps it out of the gradient
                # norm (the first stage counts it), as in Megatron.
                self.head_weight = nn.Parameter(torch.empty(VOCAB // tp, n_embd))
                set_tensor_model_parallel_attributes(self.head_weight, True, 0, 1)
                self.head_weight.shared = True
        for p in self.parameters():
            set_defaults_if_not_set_tensor_model_parallel_attributes(p)

    def set_input_tensor(self, input_tensor) -> None:
        self.input_tensor = input_tensor[0] if isinstance(input_tensor, (list, tuple)) else input_tensor

    def embedding_weight(self) -> nn.Parameter:
        return self.wte.weight if self.pre_process else self.head_weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if self.pre_process:
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        else:
            x = self.input_tensor.transpose(0, 1)
        for block in self.blocks:
            x = block(x)
        if not self.post_process:
            return x.transpose(0, 1).contiguous()
        # Megatron's parallel_lm_logits: identity forward, all-reduce of the input gradient backward.
        h = copy_to_tensor_model_parallel_region(self.ln_f(x))
        logits = F.linear(h, self.embedding_weight())
        return vocab_parallel_cross_entropy(logits.float(), targets)


@torch.no_grad()
def load_from_full(stage: GPTStage, full: GPT) -> None:
    """Copy this rank's shards of the one-process model ``full`` into ``stage``."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    r = parallel_state.get_tensor_model_parallel_rank()

    def rows(w: torch.Tensor) -> torch.Tensor:
        return w.chunk(tp, dim=0)[r]

    def cols(w: torch.Tensor) -> torch.Tensor:
        return w.chunk(tp, dim=1)[r]

    if stage.pre_process:
        stage.wte.weight.copy_(rows(full.wte.weight))
        stage.wpe.weight.copy_(full.wpe.weight)
    if stage.post_process:
        stage.ln_f.load_state_dict(full.ln_f.state_dict())
        if not stage.pre_process:
            stage.head_weight.copy_(rows(full.wte.weight))
    for mine, ref in zip(stage.blocks, (full.blocks[i] for i in stage.layers)):
        mine.ln1.load_state_dict(ref.ln1.state_dict())
        mine.ln2.load_state_dict(ref.ln2.state_dict())
        c = ref.attn.qkv.weight.shape[1]
        heads = ref.attn.n_head
        # The fused qkv matrix is [3, heads, head_dim] x hidden: each rank takes its heads of q, k and v.
        qkv = ref.attn.qkv.weight.view(3, heads, c // heads, c)
        mine.attn.qkv.weight.copy_(qkv.chunk(tp, dim=1)[r].reshape(-1, c))
        mine.attn.proj.weight.copy_(cols(ref.attn.proj.weight))
        mine.fc.weight.copy_(rows(ref.fc.weight))
        mine.out.weight.copy_(cols(ref.out.weight))
