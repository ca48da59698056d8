"""transformers models built from small configs (random init, nothing
downloaded), split by fxsplit at changing sequence lengths.

Each model is a pipeline stage fed hidden states that require grad
(``inputs_embeds``): a *middle* stage is the base model returning its last
hidden state, a *last* stage is the model with its LM head returning the
loss for random labels. Every case runs through
:func:`real_stage_check.check_stage` with ``compiler="eager"`` and
``fallback="error"``, at three sequence lengths in a row: gradients of B then
W and of ordinary backward equal eager autograd, FLOPs(B) + FLOPs(W) ==
FLOPs(ordinary backward), and B does no weight-gradient matmuls. How the
changing length is compiled is part of each test's id.

On CPU, transformers' MoE experts compile through its custom op
``transformers::grouped_mm_fallback`` (``F.grouped_mm`` compiles only in
bfloat16), whose backward ``grouped_mm_fallback_backward`` returns the input
and weight gradients in one tuple; fxsplit's shipped split rule computes the
input gradients in B and the weight gradients in W.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import pytest
import torch
import torch.nn as nn
import transformers
from real_stage_check import Ops, check_stage

import zoo

DIM, VOCAB, BATCH = 32, 40, 2
# Odd lengths: no token count equals a weight dimension (see real_stage_check).
SEQS = (7, 11, 5)

_DECODER = dict(
    hidden_size=DIM, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
    max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0,
)


def _configs() -> dict[str, tuple[Any, type[nn.Module], type[nn.Module]]]:
    """name -> (config, base model class, model-with-loss class)."""
    t = transformers
    return {
        "gpt2": (
            t.GPT2Config(n_layer=1, n_embd=DIM, n_head=4, vocab_size=VOCAB, n_positions=64, attn_pdrop=0.0,
                         resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0),
            t.GPT2Model, t.GPT2LMHeadModel,
        ),
        "llama": (t.LlamaConfig(intermediate_size=48, **_DECODER), t.LlamaModel, t.LlamaForCausalLM),
        # a window shorter than every sequence length, so the sliding-window layer masks
        "gemma2": (t.Gemma2Config(intermediate_size=48, head_dim=8, sliding_window=4, **_DECODER), t.Gemma2Model,
                   t.Gemma2ForCausalLM),
        "falcon": (t.FalconConfig(hidden_size=DIM, num_hidden_layers=1, num_attention_heads=4, vocab_size=VOCAB,
                                  new_decoder_architecture=True, num_kv_heads=2, bos_token_id=0, eos_token_id=0,
                                  pad_token_id=0), t.FalconModel, t.FalconForCausalLM),
        "bert": (
            t.BertConfig(hidden_size=DIM, num_hidden_layers=1, num_attention_heads=4, intermediate_size=48,
                         vocab_size=VOCAB, max_position_embeddings=64, hidden_dropout_prob=0.0,
                         attention_probs_dropout_prob=0.0, pad_token_id=0),
            t.BertModel, t.BertForMaskedLM,
        ),
        "mixtral": (
            t.MixtralConfig(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0,
                            **_DECODER),
            t.MixtralModel, t.MixtralForCausalLM,
        ),
        # Experts in attention (mixture of attention heads) and in the MLP, each a
        # 3-D parameter the model slices per expert in a Python loop.
        "jetmoe": (t.JetMoeConfig(vocab_size=VOCAB, hidden_size=DIM, num_hidden_layers=1, num_key_value_heads=2,
                                  kv_channels=8, intermediate_size=48, max_position_embeddings=64,
                                  num_local_experts=4, num_experts_per_tok=2, bos_token_id=0, eos_token_id=0,
                                  pad_token_id=0), t.JetMoeModel, t.JetMoeForCausalLM),
        "qwen2_moe": (
            t.Qwen2MoeConfig(intermediate_size=48, moe_intermediate_size=24, shared_expert_intermediate_size=48,
                             num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                             **_DECODER),
            t.Qwen2MoeModel, t.Qwen2MoeForCausalLM,
        ),
    }


class Middle(nn.Module):
    """The base model as a middle stage: hidden states in, last hidden state out."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(inputs_embeds=x).last_hidden_state


class Last(nn.Module):
    """The model with its LM head as a last stage: hidden states and labels in, loss out."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(inputs_embeds=x, labels=labels).loss


@dataclasses.dataclass(frozen=True)
class HFCase:
    """A transformers model as a pipeline stage (the interface of :class:`zoo.StageCase`)."""

    model: str
    stage: str
    seqs: tuple[int, ...] = SEQS
    region_calls: int = 1  # the most times one region runs per forward (see real_stage_check)

    @property
    def name(self) -> str:
        return f"{self.model}-{self.stage}"

    def make(self) -> nn.Module:
        torch.manual_seed(0)
        config, base, with_loss = _configs()[self.model]
        return Middle(base(config)) if self.stage == "middle" else Last(with_loss(config))

    def inputs(self, seq: int) -> tuple[torch.Tensor, ...]:
        return zoo.stage_inputs(self.stage, seq, dim=DIM, vocab=VOCAB, batch=BATCH)

    def context(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def assert_close(self, got: torch.Tensor, want: torch.Tensor, msg: str) -> None:
        scale = float(want.detach().abs().max()) if want.numel() else 0.0
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * max(scale, 1e-3), msg=lambda m: f"{msg}: {m}")

    def __str__(self) -> str:
        return self.name


def _ops() -> Ops:
    """The zoo's op accounting plus transformers' grouped-mm custom ops (same
    signatures as the zoo's expert ops; registered when this module imports)
    and the two ops of fxsplit's shipped rule that splits its backward (their
    FLOP formulas are in torch's registry)."""
    importlib.import_module("transformers.integrations.moe")
    fallback = torch.ops.transformers.grouped_mm_fallback
    backward = torch.ops.transformers.grouped_mm_fallback_backward
    input_half, weight_half = torch.ops.fxsplit.grouped_mm_input_grad, torch.ops.fxsplit.grouped_mm_weight_grad
    formulas: dict[Any, Callable[..., int]] = {
        **zoo.FLOP_FORMULAS, fallback: zoo.expert_mm_flops, backward: zoo.expert_mm_backward_flops,
    }
    share = {fallback: Fraction(0), backward: Fraction(1, 2), input_half: Fraction(0), weight_half: Fraction(1)}
    return Ops(formulas, {**zoo.WEIGHT_SHARE, **share},
               {**zoo.RULE_HALVES, input_half: backward, weight_half: backward})


# One stage per model, to keep the suite fast; together they cover a tied LM
# head with its loss (GPT-2), grouped-query attention (Llama), bidirectional
# attention with learned position and token-type embeddings (BERT), top-k
# routed experts, with a shared expert and an LM head (Qwen2-MoE), soft-capped
# attention, a sliding window and a norm on each side of every block (Gemma 2),
# and attention and MLP on one input, summed (Falcon), and experts looped
# over in Python, each a slice of a 3-D parameter, in attention and the MLP
# (JetMoE). The middle stages take automatic dynamic shapes (a static compile,
# then a dynamic recompile at the second length, as a training run meets
# them); the last stages, whose loss code costs the most to trace, mark the
# sequence dimension dynamic from the first length (one compile). JetMoE is
# compiled with dynamic=True (its backward then has a size that divides
# another, see test_cut), and runs one region twice per forward.
CASES = {
    HFCase("gpt2", "last"): "mark", HFCase("llama", "middle"): "automatic", HFCase("bert", "middle"): "automatic",
    HFCase("mixtral", "middle"): "automatic", HFCase("qwen2_moe", "last"): "mark",
    HFCase("gemma2", "middle"): "automatic", HFCase("falcon", "last"): "mark",
    HFCase("jetmoe", "middle", region_calls=2): "always",
}


@pytest.mark.parametrize("c,dynamic", [pytest.param(c, d, id=f"{c.name}-{d}") for c, d in CASES.items()])
def test_transformers_stage_at_three_sequence_lengths(c: HFCase, dynamic: str) -> None:
    check_stage(c, "eager", _ops(), dynamic=dynamic)
