"""megatron -> HF: ``unshard_to_hf`` inverts ``shard_hf_weight`` bit for bit, for every tensor of tiny
Qwen2 checkpoints (tied and untied, MHA and GQA) at TP 1, 2 and 4. No processes: the distributed export
(``export_hf_weights``) is checked in tests/world/test_megatron_gpt.py, inside its spawned TP=2 world."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from rollhpc.models.hf_weight_map import (  # noqa: E402
    Arch,
    padded_vocab_size,
    shard_hf_weight,
    unshard_to_hf,
    weight_map,
)

VOCAB = 100


def _hf_state(
    tied: bool, kv_heads: int
) -> tuple[dict[str, torch.Tensor], transformers.Qwen2Config]:
    torch.manual_seed(kv_heads + 10 * tied)
    config = transformers.Qwen2Config(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        intermediate_size=64,
        num_hidden_layers=2,
        vocab_size=VOCAB,
        max_position_embeddings=32,
        tie_word_embeddings=tied,
    )
    hf = transformers.Qwen2ForCausalLM(config).float()
    # Distinct random values everywhere (norms init to ones, biases to zeros), so a mix-up shows.
    return {k: torch.randn_like(v) for k, v in hf.state_dict().items()}, config


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("kv_heads,tps", [(4, (1, 2, 4)), (2, (1, 2))], ids=["mha", "gqa"])
def test_unshard_inverts_shard_bitwise(tied: bool, kv_heads: int, tps: tuple[int, ...]) -> None:
    state, config = _hf_state(tied, kv_heads)
    table = weight_map(Arch(config.num_hidden_layers, tied))
    expected_names = set(state) - ({"lm_head.weight"} if tied else set())
    assert {
        n for w in table for n in w.hf
    } == expected_names  # the map covers the checkpoint exactly
    for tp in tps:
        vp = padded_vocab_size(VOCAB, tp)
        rebuilt: dict[str, torch.Tensor] = {}
        for w in table:
            src = [state[n] for n in w.hf]
            shards = [
                shard_hf_weight(w.layout, src, r, tp, num_query_groups=kv_heads, padded_vocab=vp)
                for r in range(tp)
            ]
            if w.layout == "vocab":
                assert shards[0].shape[0] == vp // tp
            out = unshard_to_hf(
                w.layout,
                shards,
                w.hf,
                num_query_groups=kv_heads,
                num_attention_heads=config.num_attention_heads,
                vocab_size=VOCAB,
            )
            assert set(out) == set(w.hf) and not set(out) & set(rebuilt)
            rebuilt.update(out)
        assert set(rebuilt) == expected_names
        for name, t in rebuilt.items():
            assert t.dtype == state[name].dtype and t.shape == state[name].shape, name
            assert torch.equal(t, state[name]), f"tp={tp}: {name} differs after shard -> unshard"


def test_unshard_checks() -> None:
    a = torch.ones(4)
    assert torch.equal(unshard_to_hf("replicated", [a, a.clone()], ["n"])["n"], a)
    with pytest.raises(ValueError, match="differ across TP ranks"):
        unshard_to_hf("replicated", [a, 2 * a], ["n"])
    with pytest.raises(ValueError, match="vocab_size"):
        unshard_to_hf("vocab", [torch.zeros(4, 2)], ["e"], vocab_size=5)
    with pytest.raises(ValueError, match="3 HF tensor"):
        unshard_to_hf("qkv", [torch.zeros(8, 2)], ["q"], num_query_groups=2, num_attention_heads=4)
    # labelled fused rows (see test_qkv_and_gate_up_layouts): per group [q q k v]
    fused = [torch.tensor([0.0, 1, 10, 20])[:, None], torch.tensor([2.0, 3, 11, 21])[:, None]]
    out = unshard_to_hf("qkv", fused, ["q", "k", "v"], num_query_groups=2, num_attention_heads=4)
    assert [out[n].flatten().tolist() for n in "qkv"] == [[0, 1, 2, 3], [10, 11], [20, 21]]
