"""LoRA adapters on the megatron GPT model (rollhpc.models.lora) at TP=1 and TP=2, against Hugging Face.

Two real processes (torch.multiprocessing.spawn, gloo) build a tiny Qwen2 (GQA, biases, untied) at TP=1 then
TP=2, attach adapters to q/k/v, o, gate/up and down, and take two AdamW steps on the adapters only. Checked:
- only the adapters take gradients, and the base weights are bit for bit the checkpoint's after the steps;
- before any step the adapted model is the base model (B starts at zero), and with the adapters disabled it
  is the base model after the steps too (the reference policy of a LoRA run);
- TP=2 gives TP=1's losses, and the adapters, gathered to PEFT's names, are the same;
- the exported adapters merged into the HF weights (W + alpha/r B A) give the trained megatron model's logits.
"""

from __future__ import annotations

import os
import socket
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip("megatron.core")

from rollhpc.models.lora import LoraConfig  # noqa: E402

VOCAB = 100
WORLD = 2
CONFIG = LoraConfig(rank=4, alpha=8.0, seed=3)


def _batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (3, 12), generator=torch.Generator().manual_seed(0))


def _loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits[:, :-1, :VOCAB].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def _worker(rank: int, port: int, model_dir: str, out_dir: str) -> None:
    import torch.distributed as dist

    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from safetensors.torch import load_file

    from rollhpc.models import megatron_cpu
    from rollhpc.models.lora import adapter_parameters, adapters_disabled, attach_lora, export_lora_hf
    from rollhpc.models.megatron_gpt import build_gpt_model, export_hf_weights, load_hf_weights

    megatron_cpu.enable_cpu_megatron()
    hf_state = load_file(str(Path(model_dir) / "model.safetensors"))
    ids = _batch()
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    results = {}
    for tp in (1, 2):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        model_parallel_cuda_manual_seed(1234)
        tp_rank, tp_group = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_group()
        model = build_gpt_model(model_dir, parallel_output=False)
        load_hf_weights(model, hf_state, tp_rank, tp)
        with torch.no_grad():
            base_logits = model(ids, positions, None)[..., :VOCAB].clone()
        attach_lora(model, CONFIG, tp_rank, tp, tp_group)
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        assert trainable == set(adapter_parameters(model)) and trainable, sorted(trainable)[:4]
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0)
        losses, logits0 = [], None
        for _ in range(2):
            logits = model(ids, positions, None)
            logits0 = logits.detach()[..., :VOCAB] if logits0 is None else logits0
            loss = _loss(logits, ids)
            losses.append(loss.item())
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            trained = model(ids, positions, None)[..., :VOCAB]
            with adapters_disabled(model):
                disabled = model(ids, positions, None)[..., :VOCAB]
            losses.append(_loss(trained, ids).item())
        base = {n: t.clone() for n, t in export_hf_weights(model, VOCAB)}
        adapters = export_lora_hf(model, tp_group)
        results[tp] = dict(losses=losses, base_unchanged=tp_rank != 0 or all(torch.equal(base[n], hf_state[n])
                                                                             for n in base),
                           start_is_base=(logits0 - base_logits).abs().max().item(),
                           disabled_is_base=(disabled - base_logits).abs().max().item(),
                           trained=trained, adapters=adapters)
        parallel_state.destroy_model_parallel()
    if rank == 0:
        torch.save(results, Path(out_dir) / "results.pt")
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_lora_tp1_tp2_match_and_merge_into_hf(tmp_path: Path) -> None:
    from rollhpc.models.lora import merge_into_hf

    torch.manual_seed(0)
    config = transformers.Qwen2Config(hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=256, num_hidden_layers=2, vocab_size=VOCAB,
                                      max_position_embeddings=64, tie_word_embeddings=False)
    hf = transformers.Qwen2ForCausalLM(config).float().eval()
    hf.save_pretrained(tmp_path / "model")
    torch.multiprocessing.spawn(_worker, args=(_free_port(), str(tmp_path / "model"), str(tmp_path)), nprocs=WORLD)
    results = torch.load(tmp_path / "results.pt")
    for tp in (1, 2):
        r = results[tp]
        assert r["base_unchanged"], f"tp={tp}: the frozen base weights moved"
        assert r["start_is_base"] == 0.0 and r["disabled_is_base"] < 1e-5, (tp, r["start_is_base"],
                                                                               r["disabled_is_base"])
        assert r["losses"][2] < r["losses"][0]  # the adapters learn
        # 7 HF modules a layer (q, k, v, o, gate, up, down), A and B each
        assert len(r["adapters"]) == 2 * 7 * config.num_hidden_layers
        merged = merge_into_hf(hf.state_dict(), r["adapters"], CONFIG.scaling)
        fresh = transformers.Qwen2ForCausalLM(config).float().eval()
        fresh.load_state_dict(merged, strict=True)
        with torch.no_grad():
            diff = (fresh(_batch()).logits - r["trained"]).abs().max().item()
        assert diff < 1e-4, f"tp={tp}: HF with the merged adapters is off the trained model by {diff}"
    assert results[2]["losses"] == pytest.approx(results[1]["losses"], abs=1e-5)
    for key, t in results[1]["adapters"].items():
        torch.testing.assert_close(results[2]["adapters"][key], t, atol=1e-5, rtol=1e-4, msg=key)
