"""The sizes of a tiny Qwen2-style model (``TinyModelConfig``) and of Qwen2.5-0.5B: light, so a
config that names them loads without transformers (the model and tokenizer are built by
``rollhpc.warm_start.tiny``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import Qwen2Config, Qwen2MoeConfig

__all__ = ["MIN_HEAD_DIM", "QWEN2_5_0_5B", "QWEN2_5_0_5B_VOCAB", "TinyModelConfig"]

MIN_HEAD_DIM = 32  # vLLM's attention backends refuse smaller heads (16 is rejected on CPU)


@dataclass(kw_only=True)
class TinyModelConfig:
    """Sizes of a Qwen2 decoder (or Qwen2-MoE when ``moe``); the vocabulary comes from the
    tokenizer."""

    hidden_size: int = 128
    num_attention_heads: int = 4  # head_dim = hidden_size / num_attention_heads = 32
    num_key_value_heads: int = 2  # grouped-query attention, as in the real Qwen2 models
    num_hidden_layers: int = 2
    intermediate_size: int = 352  # dense MLP width (~2.75 x hidden, Qwen2's ratio)
    max_position_embeddings: int = 512
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True  # halves the parameters spent on a small vocabulary
    initializer_range: float = 0.02
    # Mixture of experts (Qwen2-MoE: routed experts plus one always-on shared expert per layer).
    moe: bool = False
    num_experts: int = 4
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 128
    shared_expert_intermediate_size: int = 128

    def __post_init__(self) -> None:
        positive = [
            "hidden_size",
            "num_attention_heads",
            "num_key_value_heads",
            "num_hidden_layers",
            "intermediate_size",
            "max_position_embeddings",
        ]
        if self.moe:
            positive += [
                "num_experts",
                "num_experts_per_tok",
                "moe_intermediate_size",
                "shared_expert_intermediate_size",
            ]
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"TinyModelConfig.{name} must be a positive int, got {value!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                f"{self.num_attention_heads}"
            )
        if self.head_dim < MIN_HEAD_DIM:
            raise ValueError(
                f"head_dim = hidden_size / num_attention_heads = {self.head_dim} but vLLM needs "
                f">= {MIN_HEAD_DIM}: use fewer heads or a larger hidden_size"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary embeddings")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not divisible by "
                f"num_key_value_heads {self.num_key_value_heads} (each KV head serves a whole group)"
            )
        if self.moe and self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"num_experts_per_tok {self.num_experts_per_tok} exceeds num_experts {self.num_experts}"
            )
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
            raise ValueError(
                f"rope_theta ({self.rope_theta}) and rms_norm_eps ({self.rms_norm_eps}) must be > 0"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def hf_config(
        self, vocab_size: int, eos_token_id: int, pad_token_id: int
    ) -> Qwen2Config | Qwen2MoeConfig:
        """The transformers config (Qwen2Config, or Qwen2MoeConfig when ``moe``)."""
        # imported here: configs name this class, and loading one must not load transformers
        from transformers import Qwen2Config, Qwen2MoeConfig

        common = dict(
            vocab_size=vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            max_position_embeddings=self.max_position_embeddings,
            # transformers 5 takes rope_theta inside rope_parameters (not at the top level).
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings,
            initializer_range=self.initializer_range,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            bos_token_id=None,
            dtype="float32",
        )
        if not self.moe:
            return Qwen2Config(**common)
        return Qwen2MoeConfig(
            **common,
            num_experts=self.num_experts,
            num_experts_per_tok=self.num_experts_per_tok,
            moe_intermediate_size=self.moe_intermediate_size,
            shared_expert_intermediate_size=self.shared_expert_intermediate_size,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
        )


# Qwen2.5-0.5B's published config.json shape (Qwen/Qwen2.5-0.5B and -Instruct: 494M parameters, the
# 151936 x 896 embedding tied to the output layer); with build_tokenizer(...,
# pad_to=QWEN2_5_0_5B_VOCAB) a random model of its size
QWEN2_5_0_5B = TinyModelConfig(
    hidden_size=896,
    num_attention_heads=14,
    num_key_value_heads=2,
    num_hidden_layers=24,
    intermediate_size=4864,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
QWEN2_5_0_5B_VOCAB = 151936
