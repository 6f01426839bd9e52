"""Run megatron-core on CPU (gloo): the few ``torch.cuda`` calls it hard-codes, pointed at the CPU.

megatron-core 0.16 builds, trains and checkpoints a ``GPTModel`` (local, non-Transformer-Engine layer
spec, ``use_cpu_initialization=True``, optimizer: torch's AdamW, on its fused CPU kernel) on CPU once these
calls stop asking for a CUDA device. Checked one at a time (megatron-core 0.16.1, torch 2.13 CPU): without
``current_device``, ``get_rng_state``, ``_get_cuda_rng_state`` or ``get_default_causal_mask`` the seed
or the forward raises "Torch not compiled with CUDA enabled"; without ``manual_seed`` or
``_set_cuda_rng_state`` nothing raises (torch queues the call for a CUDA init that never comes) but the
RNG tracker's streams are silently never seeded / never switched.

* ``torch.cuda.current_device()`` -> ``torch.device("cpu")``. megatron passes it as ``device=`` when it
  creates tensors at run time (rotary frequencies in every forward, vocab-parallel embedding and cross
  entropy buffers, DDP gradient buffers).
* ``torch.cuda.synchronize()`` -> no-op. Not needed by forward/backward/step; ``dist_checkpointing``
  save/load and ``parallel_state`` timeout updates call it around collectives; CPU work is synchronous.
* ``torch.cuda.get_rng_state()`` -> ``torch.get_rng_state()`` and ``torch.cuda.manual_seed(s)`` ->
  ``torch.manual_seed(s)``: ``model_parallel_cuda_manual_seed`` seeds the "CUDA" generator and its RNG
  tracker snapshots it once per tracked stream (data-, tensor- and expert-parallel). On CPU the CPU
  generator is the one dropout draws from, so it stands in for the device generator.
* ``megatron.core.tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state`` -> get/set the
  CPU generator's state: the RNG tracker's ``fork()`` (entered by every forward around the embedding
  and attention dropout) and activation recomputation swap streams through these two. With dropout > 0
  inside a fork the tracker logs "CPU RNG state changed within GPU RNG context": expected on CPU,
  where the CPU generator *is* the forked one.
* ``megatron.core.fusions.fused_softmax.get_default_causal_mask(sq)`` -> the same upper-triangular mask
  built on the CPU: the unfused softmax builds it with ``device="cuda"`` whenever the model is called
  with ``attention_mask=None`` (plain causal attention).

* Pipeline schedules (``megatron.core.pipeline_parallel.schedules``): every schedule starts its token
  count with ``torch.zeros([], device="cuda")``. The module's ``torch`` is replaced by a view of torch
  whose ``zeros`` reads ``device="cuda"`` as the CPU; everything else is torch itself. Their
  point-to-point sends are plain ``isend``/``irecv`` (gloo has them); leave ``batch_p2p_comm`` off on
  CPU (gloo has no coalesced batches). ``p2p_communication`` only needs ``current_device`` and
  ``synchronize`` above.
* ``LanguageModule.setup_embeddings_and_output_layer``: with tied embeddings and pp > 1 the last stage's
  copy of the embedding is zeroed and all-reduced from the first stage after ``weight.data.cuda()``;
  during that call ``Tensor.cuda`` returns the tensor itself.

* megatron's optimizers (``get_megatron_optimizer``: mixed precision with fp32 main parameters, the
  distributed optimizer, gradient clipping) and its DDP wrapper. Their tensors made with ``device='cuda'``
  (the loss-scale constants, the overflow flag, the grad-norm reductions of ``optimizer``, ``clip_grads``
  and the local multi-tensor fallbacks in ``megatron.core.utils``) come from a view of torch like the
  schedules'. They sort parameters by ``Tensor.type()`` names ("torch.cuda.BFloat16Tensor", ...), which
  CPU tensors do not have: while the optimizer is built, and while gradients are clipped, ``Tensor.type()``
  without arguments gives a CPU tensor its CUDA type's name (``_cuda_type_names``). While the optimizer is
  built, ``torch.optim.AdamW`` is ``_FusedAdamW`` (the fused CPU kernel: no per-parameter temporaries).
  DDP's buckets run on gloo as they are; its reduce-scatter and the distributed optimizer's all-gather
  (``param_and_grad_buffer``'s ``dist_reduce_scatter_func`` / ``dist_all_gather_func``) become gloo's
  in-place all-reduce: gloo's own reduce-scatter and all-gather copy the whole bucket first, and without
  overlap megatron makes the whole model one bucket (Qwen2.5-0.5B's shape at DP=2: +1.84 GiB per rank at
  every step). Checked end to end with megatron-core 0.16.1: DDP + distributed optimizer at DP=2 match
  DP=1, bf16 parameters with fp32 main parameters (tests/world/test_megatron_optimizer.py). Its checkpoint gathers
  each DP group's shards (``DistributedOptimizer.get_parameter_state_dp_zero``) after ``send_tensor.cuda()``:
  during that call ``Tensor.cuda`` returns the tensor itself, as for the embeddings above.

Not patched (GPU only): CUDA graphs, sliding-window attention masks, Transformer Engine / apex fused kernels
(keep the ``*_fusion`` options off), DDP's overlapped communication (``overlap_grad_reduce`` and
``overlap_param_gather`` use CUDA streams: keep them off on CPU).

``enable_cpu_megatron()`` is idempotent and does nothing where ``torch.cuda.is_available()``. Call it
before ``model_parallel_cuda_manual_seed``; no other module needs to know about these patches.
"""

from __future__ import annotations

import functools
import sys

import torch
import torch.distributed as dist

_ENABLED = False


def _current_device() -> torch.device:
    return torch.device("cpu")


def _synchronize(device: object = None) -> None:
    return None


def _get_rng_state(device: object = "cuda") -> torch.Tensor:
    return torch.get_rng_state()


def _manual_seed(seed: int) -> None:
    torch.manual_seed(seed)


def _get_tracked_rng_state(
    device: object = "cuda", clone: bool = False, graph_safe: bool = False
) -> torch.Tensor:
    return torch.get_rng_state()


def _set_tracked_rng_state(
    new_state: torch.Tensor, device: object = -1, graph_safe: bool = False
) -> None:
    torch.set_rng_state(new_state)


def _on_cpu(device: object) -> object:
    return (
        "cpu"
        if device == "cuda" or (isinstance(device, torch.device) and device.type == "cuda")
        else device
    )


class _TorchOnCpu:
    """torch, except that ``zeros``, ``empty`` and ``tensor`` given ``device="cuda"`` make a CPU tensor (for
    the pipeline schedules and the optimizers)."""

    def __getattr__(self, name: str) -> object:
        return getattr(torch, name)

    @staticmethod
    def zeros(*size: object, device: object = None, **kw: object) -> torch.Tensor:
        return torch.zeros(*size, device=_on_cpu(device), **kw)

    @staticmethod
    def empty(*size: object, device: object = None, **kw: object) -> torch.Tensor:
        return torch.empty(*size, device=_on_cpu(device), **kw)

    @staticmethod
    def tensor(data: object, device: object = None, **kw: object) -> torch.Tensor:
        return torch.tensor(data, device=_on_cpu(device), **kw)


_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}
_real_tensor_type = torch.Tensor.type


def _type_as_on_cuda(self: torch.Tensor, *args: object, **kw: object) -> object:
    name = _real_tensor_type(self, *args, **kw)
    return _CUDA_TYPE_NAMES.get(name, name) if not args and not kw else name


def _with_attribute(owner: object, name: str, replacement: object):  # noqa: ANN202 - a function wrapper
    """A decorator: ``owner.<name>`` is ``replacement`` while the wrapped function runs, then the real one."""

    def wrap(fn):  # noqa: ANN001, ANN202
        @functools.wraps(fn)
        def wrapped(*args, **kw):  # noqa: ANN002, ANN003, ANN202
            real = getattr(owner, name)
            setattr(owner, name, replacement)
            try:
                return fn(*args, **kw)
            finally:
                setattr(owner, name, real)

        return wrapped

    return wrap


def _with_tensor_method(name: str, replacement):  # noqa: ANN001, ANN202 - a function wrapper
    """A decorator: ``torch.Tensor.<name>`` is ``replacement`` while the wrapped function runs, then the real one."""
    return _with_attribute(torch.Tensor, name, replacement)


class _FusedAdamW(torch.optim.AdamW):
    """torch's AdamW on its fused CPU kernel. Without Transformer Engine or apex megatron builds a plain
    ``torch.optim.AdamW``, which on CPU tensors runs the per-parameter loop: two temporaries the size of each
    parameter (the largest, the embedding's shard, is the step's memory peak) and ~6x slower than the fused
    kernel (bench/cpu_collectives.py: 68M parameters, one thread, 0.64 s and +519 MiB against 0.11 s and
    nothing). The fused kernel updates in place, to within float32 rounding of the loop. A checkpoint's
    parameter groups (``fused`` among their keys) do not turn it off."""

    def __init__(self, params: object, *args: object, **kw: object) -> None:
        kw["fused"] = True
        super().__init__(params, *args, **kw)

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            group["fused"], group["foreach"] = True, False


def _tensor_stays(t: torch.Tensor, *args: object, **kw: object) -> torch.Tensor:
    return t


# ``fn`` with ``Tensor.type()`` naming CPU float tensors by their CUDA types while it runs
_cuda_type_names = _with_tensor_method("type", _type_as_on_cuda)
# ``fn`` with ``Tensor.cuda()`` returning the tensor itself while it runs
_without_cuda_copies = _with_tensor_method("cuda", _tensor_stays)


def _all_reduce_in_place(tensor: torch.Tensor, op: object, group: object, async_op: bool) -> object:
    """An all-reduce of ``tensor`` in place, issued on the process group itself: inside megatron's
    ``_coalescing_manager`` torch would defer ``dist.all_reduce`` to the block's end, after the copies here."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    work = pg.allreduce([tensor], opts)
    if async_op:
        return work
    work.wait()
    return None


def _own_range(shard: int, group: object) -> tuple[int, int]:
    """Where this rank's shard of ``shard`` elements lies in a bucket the group shares out in rank order."""
    rank = dist.get_rank(group)
    return rank * shard, (rank + 1) * shard


def _reduce_scatter_by_all_reduce(
    output: torch.Tensor,
    input: torch.Tensor,
    op: object = None,
    group: object = None,
    async_op: bool = False,
) -> object:
    """DDP's reduce-scatter of a gradient bucket (``output``: this rank's shard of ``input``) as gloo's
    in-place all-reduce of the whole bucket: the shard gets the same sums, the rest of the bucket (which the
    distributed optimizer does not read) gets them too. gloo's own reduce-scatter copies its whole input
    first and is slower than its all-reduce: a 1 GiB fp32 bucket over 2 ranks, +1.0 GiB and 1.7-2.9 s against
    nothing and 0.8-1.5 s (bench/cpu_collectives.py, torch 2.13)."""
    work = _all_reduce_in_place(input, op if op is not None else dist.ReduceOp.SUM, group, async_op)
    lo, hi = _own_range(output.numel(), group)
    mine = input.view(-1)[lo:hi]
    if mine.data_ptr() != output.data_ptr():
        if work is not None:
            work.wait()
            work = None
        output.copy_(mine)
    return work


def _all_gather_by_all_reduce(
    output: torch.Tensor, input: torch.Tensor, group: object = None, async_op: bool = False
) -> object:
    """The distributed optimizer's all-gather of a parameter bucket (``input``: this rank's shard of
    ``output``) as an in-place sum of the bucket with every other rank's shard zeroed: x + 0 is exact in any
    float dtype, so every rank ends with each rank's shard bit for bit. gloo's all-gather copies the bucket's
    other shards first (a 512 MiB bf16 bucket over 2 ranks: +512 MiB, 0.7 s; the sum: nothing, 0.55-0.6 s)."""
    flat = output.view(-1)
    lo, hi = _own_range(input.numel(), group)
    if flat[lo:hi].data_ptr() != input.data_ptr():
        flat[lo:hi].copy_(input)
    flat[:lo].zero_()
    flat[hi:].zero_()
    return _all_reduce_in_place(output, dist.ReduceOp.SUM, group, async_op)


@functools.lru_cache(maxsize=32)
def _default_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _identity_compile(model=None, **_options):
    """``torch.compile``'s signature, compiling nothing (both ``@torch.compile`` and ``@torch.compile(...)``)."""
    return model if model is not None else (lambda fn: fn)


def import_megatron() -> None:
    """Import megatron-core; on a machine without CUDA, with its jit fuser off from the first module on.

    megatron wraps its fusions (bias-GeLU, bias-SwiGLU, ...) in ``torch.compile`` as its modules load
    (``megatron.core.jit.jit_fuser``), and the first such wrap imports torch's dynamo and inductor: about
    half of megatron's import time (2.6 s of 5.6 s measured here, on each trainer rank at every start). On
    CPU those fusions stay off (``*_fusion`` options), so nothing compiled would run. megatron's own switch,
    ``megatron.core.jit.disable_jit_fuser()``, can only be called once the import has paid, so the import
    runs with ``torch.compile`` as the identity (what that switch makes of ``jit_fuser``), then the switch
    keeps it so for modules imported later. Nothing changes where CUDA is available or megatron is loaded."""
    if "megatron.core" in sys.modules or torch.cuda.is_available():
        import megatron.core  # noqa: F401

        return
    real = torch.compile
    torch.compile = _identity_compile
    try:
        import megatron.core  # noqa: F401
        from megatron.core.jit import disable_jit_fuser
    finally:
        torch.compile = real
    disable_jit_fuser()


def enable_cpu_megatron() -> bool:
    """Patch megatron-core's hard-coded CUDA calls onto the CPU; True where the patches are in place
    (now or from an earlier call), False on a CUDA machine, where nothing is touched. Its megatron modules are
    imported here, after ``import_megatron``: this module is what makes megatron's first import on CPU."""
    global _ENABLED
    if _ENABLED:
        return True
    if torch.cuda.is_available():
        return False
    import_megatron()
    import megatron.core.optimizer as mcore_optimizer
    from megatron.core import utils as mcore_utils
    from megatron.core.fusions import fused_softmax
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.distributed import param_and_grad_buffer
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as mcore_random

    torch.cuda.current_device = _current_device
    torch.cuda.synchronize = _synchronize
    torch.cuda.get_rng_state = _get_rng_state
    torch.cuda.manual_seed = _manual_seed
    mcore_random._get_cuda_rng_state = _get_tracked_rng_state
    mcore_random._set_cuda_rng_state = _set_tracked_rng_state
    fused_softmax.get_default_causal_mask = _default_causal_mask
    for module in (schedules, optimizer, distrib_optimizer, clip_grads, mcore_utils):
        module.torch = _TorchOnCpu()
    mcore_optimizer.get_megatron_optimizer = _cuda_type_names(
        _with_attribute(torch.optim, "AdamW", _FusedAdamW)(mcore_optimizer.get_megatron_optimizer)
    )
    dist_opt = distrib_optimizer.DistributedOptimizer
    dist_opt.get_parameter_state_dp_zero = _without_cuda_copies(
        dist_opt.get_parameter_state_dp_zero
    )
    optimizer.clip_grad_by_total_norm_fp32 = _cuda_type_names(
        optimizer.clip_grad_by_total_norm_fp32
    )
    param_and_grad_buffer.dist_reduce_scatter_func = _reduce_scatter_by_all_reduce
    param_and_grad_buffer.dist_all_gather_func = _all_gather_by_all_reduce
    LanguageModule.setup_embeddings_and_output_layer = _without_cuda_copies(
        LanguageModule.setup_embeddings_and_output_layer
    )
    _ENABLED = True
    return True
