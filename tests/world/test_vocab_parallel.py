"""Log-probs and entropy from vocab-parallel logits: values and gradients equal the unsplit ones."""

from __future__ import annotations


import torch
import torch.multiprocessing as mp

from rollhpc.models.vocab_parallel import token_logprobs

VOCAB, PADDED = 13, 16  # 3 padding columns, on the last rank's slice


def _data():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, PADDED, generator=g)
    logits[..., VOCAB:] = 7.0  # padding columns must not count, whatever their value
    targets = torch.randint(0, VOCAB, (2, 5), generator=g)
    return logits, targets


def _loss(logp, entropy):
    return -(logp * torch.arange(1.0, 11.0).view(2, 5)).sum() + 0.3 * entropy.sum()


def _rank(rank: int, rendezvous: str, out: dict) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=2)
    logits, targets = _data()
    local = logits.chunk(2, dim=-1)[rank].clone().requires_grad_()
    logp, entropy = token_logprobs(
        local, targets, VOCAB, tp_rank=rank, tp_size=2, tp_group=dist.group.WORLD, with_entropy=True
    )
    _loss(logp, entropy).backward()
    out[rank] = (logp.detach(), entropy.detach(), local.grad)
    dist.destroy_process_group()


def test_matches_log_softmax_and_tp2_gradients_equal_tp1(tmp_path):
    logits, targets = _data()
    full = logits.clone().requires_grad_()
    logp, entropy = token_logprobs(full, targets, VOCAB, with_entropy=True)
    ref = torch.log_softmax(logits[..., :VOCAB], -1)
    torch.testing.assert_close(logp, ref.gather(-1, targets[..., None]).squeeze(-1))
    torch.testing.assert_close(entropy, -(ref.exp() * ref).sum(-1))
    _loss(logp, entropy).backward()
    assert torch.all(full.grad[..., VOCAB:] == 0)  # padding columns get no gradient

    out = mp.Manager().dict()
    mp.spawn(_rank, args=(f"file://{tmp_path}/rendezvous", out), nprocs=2, join=True)
    for r in (0, 1):
        torch.testing.assert_close(out[r][0], logp.detach())
        torch.testing.assert_close(out[r][1], entropy.detach())
    # each rank's gradient is its slice of the single-rank gradient (not TP times it)
    torch.testing.assert_close(torch.cat([out[0][2], out[1][2]], dim=-1), full.grad)


def test_the_backward_keeps_one_float_logits_copy_and_matches_autograd():
    """What autograd keeps for the backward, counted with saved-tensor hooks: one float32 copy of the logits
    (two with the entropy), where the plain expressions keep two (four; 1.2 GB each per 2,048 tokens of
    Qwen's vocabulary: bench/logprob_head.py). Gradients equal autograd's through log_softmax; bf16 logits get bf16 gradients."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 7, 500, generator=g)  # 20 padding columns
    targets = torch.randint(0, 480, (3, 7), generator=g)
    weights = torch.rand(3, 7, generator=g)
    copy = logits.numel() * 4
    for with_entropy in (False, True):
        saved = []

        def pack(t, saved=saved):
            saved.append(t.numel() * t.element_size())
            return t

        x = logits.clone().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logp, entropy = token_logprobs(x, targets, 480, with_entropy=with_entropy)
        assert sum(saved) <= (2 if with_entropy else 1) * copy * 1.05, (sum(saved), copy)
        loss = -(logp * weights).sum() + (0.3 * entropy.sum() if with_entropy else 0)
        loss.backward()
        ref_x = logits.clone().requires_grad_()
        ref = torch.log_softmax(ref_x[..., :480], -1)
        ref_loss = -(ref.gather(-1, targets[..., None]).squeeze(-1) * weights).sum()
        if with_entropy:
            ref_loss = ref_loss + 0.3 * (-(ref.exp() * ref).sum(-1)).sum()
        ref_loss.backward()
        torch.testing.assert_close(x.grad, ref_x.grad)
    half = logits.to(torch.bfloat16).requires_grad_()
    token_logprobs(half, targets, 480)[0].sum().backward()
    assert half.grad.dtype == torch.bfloat16
