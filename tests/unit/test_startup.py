"""Start-up in turns (rollhpc.controller.startup): which roles build when, read from the shipped configs. The
sequencing itself is checked on a real world (tests/world/test_slurm_submit.py: colocated roles on fake GPUs)."""

from __future__ import annotations

import pytest

from rollhpc.cli.experiment import load_experiment
from rollhpc.controller.startup import startup_turns


@pytest.mark.parametrize(
    "name, turns",
    [
        # vLLM sizes its KV cache from free memory: it builds alone on its GPUs, then the trainer, then the reference
        ("qwen2.5-7b_grpo", [["generate", "reward"], ["train"], ["reference"]]),
        ("qwen3-30b-a3b_grpo", [["generate", "reward"], ["train"], ["reference"]]),
        ("qwen2.5-0.5b_gsm8k", [["generate", "reward"], ["train"]]),
        (
            "quickstart",
            [["train", "generate", "reward"]],
        ),  # no GPUs: nothing shared, everything at once
    ],
)
def test_roles_sharing_gpus_build_in_turns_free_memory_measurers_first(name, turns):
    assert startup_turns(load_experiment(name, []).roles) == turns


def test_roles_on_gpus_of_their_own_build_in_the_first_turn():
    cfg = load_experiment("qwen2.5-7b_grpo", ["roles.reference.devices=null", "cluster.nodes=3"])
    assert startup_turns(cfg.roles) == [["reference", "generate", "reward"], ["train"]]
