"""What a conversion checks before it starts, in the calling process: the HF model directory (config,
tensor names, shapes, dtypes), the target layout's divisibility and the destination. Each failure is a
``ConversionError`` with one clear message."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from rollhpc.checkpoint.safetensors_io import SafetensorsDir, SafetensorsError
from rollhpc.models.hf_weight_map import (
    Arch,
    HfConfigSource,
    _hf_dict,
    weight_map,
    check_hf_config,
)


class ConversionError(RuntimeError):
    """A conversion that cannot start or did not finish; the message says why."""


def expected_hf_shapes(hf_config: HfConfigSource) -> dict[str, tuple[int, ...]]:
    """Every tensor of an HF checkpoint of this config.json and its shape (``lm_head.weight`` only when
    untied)."""
    cfg = _hf_dict(hf_config)
    arch = check_hf_config(cfg)
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    fixed = _fixed_shapes(cfg, arch)
    ffn = {
        "": cfg.get("intermediate_size"),
        "experts": cfg.get("moe_intermediate_size"),
        "shared_expert": cfg.get("shared_expert_intermediate_size"),
    }
    shapes = {}
    for w in weight_map(arch):
        for name in w.hf:
            if name in ("model.embed_tokens.weight", "lm_head.weight"):
                shapes[name] = (v, h)
            elif name.endswith("norm.weight") and not name.endswith(
                ("q_norm.weight", "k_norm.weight")
            ):
                shapes[name] = (h,)
            elif (key := next((k for k in fixed if name.endswith(k)), None)) is not None:
                shapes[name] = fixed[key]
            else:  # gate_proj / up_proj / down_proj of the dense MLP, a routed expert or the shared expert
                kind = (
                    "experts"
                    if ".mlp.experts." in name
                    else "shared_expert"
                    if ".shared_expert." in name
                    else ""
                )
                f = ffn[kind]
                shapes[name] = (h, f) if name.endswith("down_proj.weight") else (f, h)
    return shapes


def _fixed_shapes(cfg: Mapping[str, Any], arch: Arch) -> dict[str, tuple[int, ...]]:
    """The shapes of the attention and router tensors, by the end of their names."""
    h, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    ng = cfg.get("num_key_value_heads") or nh
    d = cfg.get("head_dim") or h // nh
    return {
        "q_proj.weight": (nh * d, h),
        "k_proj.weight": (ng * d, h),
        "v_proj.weight": (ng * d, h),
        "q_proj.bias": (nh * d,),
        "k_proj.bias": (ng * d,),
        "v_proj.bias": (ng * d,),
        "q_norm.weight": (d,),
        "k_norm.weight": (d,),
        "o_proj.weight": (h, nh * d),
        "mlp.gate.weight": (arch.num_experts, h),
        "shared_expert_gate.weight": (1, h),
    }


def check_hf_dir(src: Path) -> tuple[dict[str, Any], SafetensorsDir, torch.dtype]:
    """(config, tensors, dtype) of an HF model directory after checking it can be converted: supported
    architecture, every tensor present with the shape config.json implies, nothing unexpected, one dtype."""
    cfg = _read_hf_config(src)
    try:
        expected = expected_hf_shapes(cfg)
    except NotImplementedError as e:
        raise ConversionError(f"unsupported architecture in {src / 'config.json'}: {e}") from e
    except KeyError as e:
        raise ConversionError(f"{src / 'config.json'} lacks {e}") from e
    try:
        tensors = SafetensorsDir(src)
    except SafetensorsError as e:
        raise ConversionError(f"cannot read the weights of {src}: {e}") from e
    _check_tensor_names(src, cfg, expected, tensors)
    return cfg, tensors, _one_dtype(src, expected, tensors)


def _read_hf_config(src: Path) -> dict[str, Any]:
    """``src``'s config.json, once ``src`` is known to be an HF model directory."""
    if not src.is_dir():
        raise ConversionError(f"{src}: no such directory")
    if not (src / "config.json").is_file():
        hint = (
            " (it looks like a megatron checkpoint: use mcore-to-hf)"
            if (src / "metadata.json").is_file()
            else ""
        )
        raise ConversionError(
            f"{src} is not a Hugging Face model directory: config.json is missing{hint}"
        )
    try:
        return json.loads((src / "config.json").read_text())
    except ValueError as e:
        raise ConversionError(f"{src / 'config.json'}: not valid JSON ({e})") from e


def _check_tensor_names(
    src: Path,
    cfg: Mapping[str, Any],
    expected: Mapping[str, tuple[int, ...]],
    tensors: SafetensorsDir,
) -> None:
    """Every expected tensor present with its shape, and no other (a tied model's lm_head and rotary
    buffers aside)."""
    tied = bool(cfg.get("tie_word_embeddings", False))
    missing = sorted(set(expected) - set(tensors.info))
    unexpected = sorted(
        n
        for n in tensors.info
        if n not in expected
        and not (tied and n == "lm_head.weight")
        and not n.endswith("rotary_emb.inv_freq")
    )
    if missing:
        raise ConversionError(
            f"{src}: missing {len(missing)} tensor(s) a {cfg.get('model_type')} model of this "
            f"config.json has: {_few(missing)}"
        )
    if unexpected:
        raise ConversionError(
            f"{src}: {len(unexpected)} unexpected tensor(s) (not part of a {cfg.get('model_type')} "
            f"model of this config.json): {_few(unexpected)}"
        )
    wrong = [
        f"{n}: checkpoint {list(tensors.info[n].shape)}, config.json implies {list(s)}"
        for n, s in expected.items()
        if tensors.info[n].shape != s
    ]
    if wrong:
        raise ConversionError(
            f"{src}: shape mismatch for {len(wrong)} tensor(s): {'; '.join(wrong[:4])}"
        )


def _one_dtype(
    src: Path, expected: Mapping[str, tuple[int, ...]], tensors: SafetensorsDir
) -> torch.dtype:
    dtypes = {tensors.info[n].dtype for n in expected}
    if len(dtypes) != 1:
        raise ConversionError(
            f"{src}: mixed dtypes {sorted(map(str, dtypes))}; convert the weights to one dtype first"
        )
    return dtypes.pop()


def _few(names: list[str], n: int = 6) -> str:
    return ", ".join(names[:n]) + (f" ... ({len(names) - n} more)" if len(names) > n else "")


def check_layout(hf_config: HfConfigSource, tp: int, pp: int, ep: int, etp: int | None) -> int:
    """The world size for this layout, after checking that the model divides over it."""
    cfg = _hf_dict(hf_config)
    arch = check_hf_config(cfg)
    etp = tp if etp is None else etp
    for name, value in (("tp", tp), ("pp", pp), ("ep", ep), ("etp", etp)):
        if not isinstance(value, int) or value < 1:
            raise ConversionError(f"--{name} must be a positive integer, got {value!r}")
    bad = [msg for ok, msg in _layout_checks(cfg, arch, tp, pp, ep, etp) if not ok]
    if bad:
        raise ConversionError(
            f"layout tp={tp} pp={pp} ep={ep} etp={etp} does not fit the model: {'; '.join(bad)}"
        )
    return pp * math.lcm(tp, etp * ep)


def _layout_checks(
    cfg: Mapping[str, Any], arch: Arch, tp: int, pp: int, ep: int, etp: int
) -> list[tuple[bool, str]]:
    """(holds, what fails otherwise) for every divisibility the layout needs."""
    nh = cfg["num_attention_heads"]
    ng = cfg.get("num_key_value_heads") or nh
    checks = [
        (nh % tp == 0, f"num_attention_heads={nh} is not divisible by tp={tp}"),
        (ng % tp == 0, f"num_key_value_heads={ng} is not divisible by tp={tp}"),
        (
            arch.num_layers % pp == 0,
            f"num_hidden_layers={arch.num_layers} is not divisible by pp={pp}",
        ),
    ]
    if arch.num_experts:
        f = cfg["moe_intermediate_size"]
        checks += [
            (
                arch.num_experts % ep == 0,
                f"num_experts={arch.num_experts} is not divisible by ep={ep}",
            ),
            (f % etp == 0, f"moe_intermediate_size={f} is not divisible by etp={etp}"),
        ]
        if arch.shared_expert:
            fs = cfg["shared_expert_intermediate_size"]
            checks.append(
                (fs % tp == 0, f"shared_expert_intermediate_size={fs} is not divisible by tp={tp}")
            )
    else:
        checks += [
            (
                ep == 1,
                f"ep={ep}: expert parallelism needs a MoE model ({cfg.get('model_type')} is dense)",
            ),
            (
                cfg["intermediate_size"] % tp == 0,
                f"intermediate_size={cfg['intermediate_size']} is not divisible by tp={tp}",
            ),
        ]
    if pp > 1 and arch.tie_word_embeddings and not torch.cuda.is_available():
        checks.append(
            (
                False,
                f"pp={pp} with tied embeddings needs CUDA (megatron copies the shared embedding to "
                "the GPU when it builds the last stage): use pp=1 (the checkpoint loads at any pp)",
            )
        )
    return checks


def check_dst(dst: Path, overwrite: bool) -> None:
    if dst.exists() and not overwrite:
        raise ConversionError(f"{dst} exists; pass --overwrite to replace it")
