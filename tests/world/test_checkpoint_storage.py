"""Checkpoint storage on real files: commit, prune, crash mid-write, corruption, `rollhpc ckpt`, RNG state."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from rollhpc.checkpoint.run_state import restore_rng_states, save_json, save_rng_states
from rollhpc.checkpoint.storage import LATEST, MANIFEST, CheckpointStorageError, CheckpointStore
from rollhpc.cli import main
from tests.support.processes import rollhpc


def write_checkpoint(store: CheckpointStore, step: int, ranks: int = 2, meta: dict | None = None):
    """What a save looks like: every trainer rank writes its own shard, the controller its state."""
    pending = store.begin(step)
    for rank in range(ranks):
        (pending.path / "model").mkdir(exist_ok=True)
        (pending.path / "model" / f"rank_{rank}.bin").write_bytes(
            bytes([step % 256, rank]) * (100 + rank)
        )
    (pending.path / "controller.json").write_text(json.dumps({"step": step}))
    return store.commit(pending, meta if meta is not None else {"step": step})


def hidden(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("."))


def test_commit_writes_manifest_moves_into_place_and_points_latest(tmp_path):
    store = CheckpointStore(tmp_path / "checkpoints")
    first = write_checkpoint(store, 5, meta={"lr": 0.001, "policy_version": 5})
    second = write_checkpoint(store, 7)
    assert [c.step for c in store.list()] == [5, 7]
    assert (store.root / LATEST).read_text() == "step_000007\n" and store.latest_step() == 7
    assert second.path == store.root / "step_000007" and hidden(store.root) == []
    manifest = json.loads((first.path / MANIFEST).read_text())
    assert manifest["step"] == 5 and manifest["meta"] == {"lr": 0.001, "policy_version": 5}
    assert sorted(manifest["files"]) == ["controller.json", "model/rank_0.bin", "model/rank_1.bin"]
    rank1 = first.path / "model" / "rank_1.bin"
    assert manifest["files"]["model/rank_1.bin"] == {
        "size": 202,
        "sha256": hashlib.sha256(rank1.read_bytes()).hexdigest(),
    }
    assert store.get(5).meta["policy_version"] == 5
    assert store.verify(5) == [] and store.verify(7) == []
    assert store.latest_good(deep=True).step == 7
    with pytest.raises(CheckpointStorageError, match="no committed checkpoint for step 6"):
        store.get(6)


def test_commit_refuses_foreign_or_repeated_pendings_and_writer_manifests(tmp_path):
    store = CheckpointStore(tmp_path)
    pending = store.begin(1)
    store.commit(pending, {})
    with pytest.raises(CheckpointStorageError, match="not a pending checkpoint"):
        store.commit(pending, {})
    pending = store.begin(2)
    (pending.path / MANIFEST).write_text("{}")
    with pytest.raises(CheckpointStorageError, match="reserved"):
        store.commit(pending, {})
    (pending.path / MANIFEST).unlink()
    with pytest.raises(CheckpointStorageError, match="JSON"):
        store.commit(pending, {"bad": object()})
    store.abort(pending)
    assert not pending.path.exists() and store.latest_step() == 1
    with pytest.raises(CheckpointStorageError, match="not a pending checkpoint"):
        store.commit(pending, {})


def test_keep_last_prunes_and_a_rewind_drops_the_abandoned_future(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=2)
    for step in range(1, 6):
        write_checkpoint(store, step)
    assert [c.step for c in store.list()] == [4, 5] and hidden(tmp_path) == []
    # step 5 is found corrupt, the run resumes from 4 and commits 5 again: the new one replaces it
    (tmp_path / "step_000005" / "controller.json").write_text("garbage")
    assert store.latest_good().step == 4
    write_checkpoint(store, 5, meta={"again": True})
    assert store.get(5).meta == {"again": True} and store.verify(5) == []
    # an operator resumes the run from an older checkpoint: once it commits step 3, steps 4 and 5 belong
    # to a trajectory the run left, and must not be what the next restart resumes from
    write_checkpoint(store, 3)
    assert (
        [c.step for c in store.list()] == [3]
        and store.latest_step() == 3
        and hidden(tmp_path) == []
    )
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointStore(tmp_path, keep_last=0)


WRITER = textwrap.dedent("""
    import sys
    path = sys.argv[1]
    with open(path, "wb") as f:
        f.write(b"x" * 65536); f.flush()
        print("writing", flush=True)
        while True:
            f.write(b"x" * 65536)
""")


def test_a_writer_killed_mid_write_leaves_latest_on_the_previous_checkpoint(tmp_path, caplog):
    store = CheckpointStore(tmp_path / "checkpoints")
    write_checkpoint(store, 10)
    pending = store.begin(20)
    (pending.path / "model").mkdir()
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(pending.path / "model" / "rank_0.bin")],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert writer.stdout.readline().strip() == "writing"
    finally:
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait(timeout=30)
    assert writer.returncode == -signal.SIGKILL
    assert (pending.path / "model" / "rank_0.bin").stat().st_size >= 65536

    # the job is requeued: a new session's store, the controller process of the previous one is gone
    store = CheckpointStore(tmp_path / "checkpoints")
    assert store.latest_step() == 10
    with caplog.at_level(logging.WARNING, logger="rollhpc.checkpoint.storage"):
        good = store.latest_good(deep=True)
    assert good is not None and good.step == 10 and good.meta == {"step": 10}
    assert f"ignoring {pending.path.name} (a write that never committed)" in caplog.text
    assert [(r.step, r.status) for r in store.statuses()] == [(10, "ok"), (20, "partial")]
    # the new session cleans up the dead write when it starts its own
    assert store.recover() == [pending.path]
    assert not pending.path.exists()
    write_checkpoint(store, 20)
    assert store.latest_good().step == 20


def test_truncation_and_bit_flips_are_detected_and_latest_good_falls_back(tmp_path, caplog):
    store = CheckpointStore(tmp_path)
    write_checkpoint(store, 1)
    write_checkpoint(store, 2)
    shard = tmp_path / "step_000002" / "model" / "rank_1.bin"
    data = shard.read_bytes()

    shard.write_bytes(data[:-10])  # truncated by a full disk or a killed copy
    assert store.verify(2, deep=False) == [
        "model/rank_1.bin: 192 bytes, the manifest says 202 (truncated)"
    ]
    with caplog.at_level(logging.WARNING, logger="rollhpc.checkpoint.storage"):
        assert store.latest_good().step == 1
    assert (
        "skipping step_000002: model/rank_1.bin: 192 bytes, the manifest says 202 (truncated)"
        in caplog.text
    )
    assert "using step_000001 although latest names step_000002" in caplog.text

    # one bit flipped, same size
    shard.write_bytes(data[:50] + bytes([data[50] ^ 0x01]) + data[51:])
    assert store.verify(2, deep=False) == []
    assert store.verify(2, deep=True) == [
        "model/rank_1.bin: sha256 differs from the manifest (corrupt)"
    ]
    assert store.latest_good(deep=False).step == 2
    assert store.latest_good(deep=True).step == 1

    shard.unlink()
    (tmp_path / "step_000002" / "extra.bin").write_bytes(b"?")
    assert store.verify(2) == [
        "model/rank_1.bin: missing",
        "extra.bin: not in the manifest (added after the commit)",
    ]

    manifest = tmp_path / "step_000001" / MANIFEST
    manifest.write_bytes(manifest.read_bytes()[:40])
    assert store.verify(1)[0].startswith("manifest.json: unreadable")
    assert store.latest_good() is None
    assert [r.status for r in store.statuses()] == ["corrupt", "corrupt"]


def test_cli_list_inspect_verify(tmp_path, capsys):
    from safetensors.torch import save_file

    run = tmp_path / "run"
    store = CheckpointStore(run / "checkpoints")
    write_checkpoint(store, 1)
    pending = store.begin(2)
    save_file(
        {"embed.weight": torch.zeros(16, 4), "head.bias": torch.zeros(3, dtype=torch.bfloat16)},
        pending.path / "model.safetensors",
    )
    torch.save({"exp_avg": {"w": torch.zeros(2, 3)}, "step": 7}, pending.path / "optim.pt")
    store.commit(pending, {"kl_coef": 0.05})
    stale = store.begin(3)
    (stale.path / "half.bin").write_bytes(b"x" * 10)

    assert main(["ckpt", "list", str(run)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"checkpoints in {run / 'checkpoints'}"
    assert out[1].split() == ["STEP", "NAME", "WRITTEN", "SIZE", "FILES", "STATUS"]
    assert out[2].split()[:2] == ["1", "step_000001"] and out[2].split()[-1] == "ok"
    assert out[3].split()[:2] == ["2", "step_000002"] and out[3].split()[-2:] == ["ok", "latest"]
    assert out[4].split()[:2] == ["3", stale.path.name] and out[4].split()[-1] == "partial"
    assert (
        out[-1]
        == "latest names step_000002; a resume would use step_000002 (sizes checked; --deep also checks sha256)"
    )

    assert main(["ckpt", "inspect", str(run)]) == 0
    text = capsys.readouterr().out
    assert "(showing step_000002, the one latest names" in text
    assert '"kl_coef": 0.05' in text
    assert (
        "model.safetensors: 2 tensor(s)\n    embed.weight  float32  [16, 4]\n    head.bias  bfloat16  [3]"
        in text
    )
    assert "optim.pt: 1 tensor(s)\n    exp_avg.w  float32  [2, 3]" in text

    assert main(["ckpt", "verify", str(run), "--deep"]) == 0
    assert capsys.readouterr().out.strip() == (
        "ok: 2 checkpoint(s) (step_000001 .. step_000002), latest step_000002; "
        "sizes and sha256 checked"
    )
    shard = run / "checkpoints" / "step_000001" / "model" / "rank_0.bin"
    shard.write_bytes(shard.read_bytes()[:-1] + b"!")
    assert main(["ckpt", "verify", str(run / "checkpoints" / "step_000001")]) == 0
    capsys.readouterr()
    (run / "checkpoints" / "step_000002" / "optim.pt").write_bytes(b"")
    assert main(["ckpt", "verify", str(run), "--deep"]) == 1
    assert capsys.readouterr().out.splitlines() == [
        "step_000001: model/rank_0.bin: sha256 differs from the manifest (corrupt)",
        "step_000002: optim.pt: 0 bytes, the manifest says "
        f"{store.get(2).manifest.files['optim.pt'].size} (truncated)",
    ]
    assert main(["ckpt", "list", str(run)]) == 0
    assert (
        capsys.readouterr()
        .out.splitlines()[-1]
        .startswith("latest names step_000002; a resume would use step_000001")
    )

    # the installed entry point, as a user runs it: exit codes 1 and 2
    res = rollhpc("ckpt", "verify", str(run / "checkpoints" / "step_000002"), cwd=tmp_path)
    assert res.returncode == 1 and res.stdout.startswith("step_000002: optim.pt: 0 bytes"), (
        res.stderr
    )
    res = rollhpc("ckpt", "verify", str(tmp_path / "nope"), cwd=tmp_path)
    assert res.returncode == 2 and "no such directory" in res.stderr


def test_inspect_names_the_optimizer_of_each_trainer_role(tmp_path, capsys):
    """Rank files as trainer_state writes them (numpy's RNG state included, which a tensors-only load refuses
    unless allowed): a torch-AdamW role (optimizer=torch, of older runs) is one line, a megatron role saved before
    its first step says it holds no optimizer state. The megatron state itself is checked on a real checkpoint in
    test_pipeline_parallel."""
    store = CheckpointStore(tmp_path / "checkpoints")
    pending = store.begin(3)
    megatron = {"megatron_optimizer": {"stepped": False, "distributed": True}}
    for role, world, extra in (("critic", 2, {}), ("train", 1, megatron)):
        (pending.path / role / "ranks").mkdir(parents=True)
        for rank in range(world):
            torch.save(
                {
                    "rank": rank,
                    "world": world,
                    "optimizer_steps": 3 if role == "critic" else 0,
                    "rng": save_rng_states(),
                    **extra,
                },
                pending.path / role / "ranks" / f"rank_{rank:05d}.pt",
            )
    store.commit(pending, {})
    assert main(["ckpt", "inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert (
        "optimizer:\n  critic: torch AdamW (optimizer=torch of older runs, removed), saved by 2 ranks, step 3: "
        "this rollhpc does not resume it; its model/ converts (rollhpc convert mcore-to-hf)\n"
        "  train: megatron distributed optimizer, saved by 1 rank, step 0: no optimizer state (saved before the "
        "first optimizer step)\nfiles,"
    ) in out


def test_rng_states_restore_the_same_draws(tmp_path):
    def draws(gen: np.random.Generator, tgen: torch.Generator) -> list:
        return [
            random.random(),
            np.random.rand(3).tolist(),
            gen.integers(0, 1 << 30, 4).tolist(),
            torch.rand(3).tolist(),
            torch.randint(0, 1 << 30, (4,), generator=tgen).tolist(),
        ]

    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    gen, tgen = np.random.default_rng(4), torch.Generator().manual_seed(5)
    draws(gen, tgen)  # the run has been going for a while
    state = pickle.loads(pickle.dumps(save_rng_states({"sampler": gen, "dropout": tgen})))
    expected = draws(gen, tgen)

    random.seed(99)  # a fresh process after a requeue seeds everything as at the start
    np.random.seed(99)
    torch.manual_seed(99)
    gen2, tgen2 = np.random.default_rng(99), torch.Generator().manual_seed(99)
    restore_rng_states(state, {"sampler": gen2, "dropout": tgen2})
    assert draws(gen2, tgen2) == expected
    with pytest.raises(
        ValueError, match=r"generators \['dropout', 'sampler'\], given \['sampler'\]"
    ):
        restore_rng_states(state, {"sampler": gen2})


def test_save_json_replaces_atomically(tmp_path):
    path = tmp_path / "run_state.json"
    save_json(path, {"restarts": 1})
    save_json(path, {"restarts": 2, "excluded_nodes": ["node3"]})
    assert json.loads(path.read_text()) == {"restarts": 2, "excluded_nodes": ["node3"]}
    assert [p.name for p in tmp_path.iterdir()] == ["run_state.json"]


@pytest.mark.parametrize(
    "umask, file_mode, dir_mode", [(0o022, 0o644, 0o755), (0o027, 0o640, 0o750)]
)
def test_checkpoints_and_atomic_writes_follow_the_umask(tmp_path, umask, file_mode, dir_mode):
    """mkstemp/mkdtemp would leave 0600 files and a 0700 step folder whatever the umask (a colleague could not
    read the run); what is renamed into place has the modes open() and mkdir() would have given it."""
    import os
    import stat

    from rollhpc.rundir import atomic_write_bytes

    old = os.umask(umask)
    try:
        store = CheckpointStore(tmp_path / "checkpoints")
        ckpt = write_checkpoint(store, 3)
        atomic_write_bytes(tmp_path / "report.txt", b"x")
    finally:
        os.umask(old)
    made = [ckpt.path, *ckpt.path.rglob("*"), store.root / LATEST, tmp_path / "report.txt"]
    modes = {str(p.relative_to(tmp_path)): stat.S_IMODE(p.stat().st_mode) for p in made}
    assert modes == {k: dir_mode if (tmp_path / k).is_dir() else file_mode for k in modes}, modes


def test_a_file_written_through_a_name_is_whole_or_not_there(tmp_path):
    """rundir.atomic_file (for writers that need a file name, e.g. h5py): a failed write leaves the old file and
    no temporary behind; a finished one replaces it."""
    from rollhpc.rundir import atomic_file

    target = tmp_path / "record.h5"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="writer failed"):
        with atomic_file(target) as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("writer failed")
    assert target.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == [
        "record.h5"
    ]
    with atomic_file(target) as tmp:
        tmp.write_bytes(b"new")
    assert target.read_bytes() == b"new" and sorted(p.name for p in tmp_path.iterdir()) == [
        "record.h5"
    ]
