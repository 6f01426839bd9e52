"""The controller's side of run checkpoints: one call saves the whole run, one call finds and loads it.

A run checkpoint (``RUN_DIR/checkpoints/step_N/``, committed by ``storage.CheckpointStore``)::

    train/ ...           every role whose worker has ``save_checkpoint`` (trainer, critic) writes its
    critic/ ...          part collectively (``checkpoint.trainer_state``)
    controller/state.pkl the pipeline's own state: step, policy version, data cursor, rollout scheduler
                         buffers and partial samples, KL controller, reward moments, RNG of the
                         controller, restart count
    controller/state.json a readable summary of it (for ``rollhpc ckpt inspect``)

Roles without state of their own are rebuilt, not saved: the reference policy reloads its starting
checkpoint, the generators receive the restored trainer's weights, reward workers are stateless.

Resume takes ``latest_good``: the newest checkpoint whose files all match their manifest (sha256 by
default), so a checkpoint cut short by a crash or damaged later is skipped with a warning and the
previous good one is used.
"""

from __future__ import annotations

import json
import logging
import pickle
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

from rollhpc.checkpoint.disk_space import check_room, out_of_space, raised_out_of_space
from rollhpc.checkpoint.storage import Checkpoint, CheckpointStore, human_bytes
from rollhpc.rundir import RunPaths
from rollhpc.testing import fault_injection

log = logging.getLogger("rollhpc.checkpoint")

CONTROLLER_DIR = "controller"
STATE_FILE = "state.pkl"
SUMMARY_FILE = "state.json"


@dataclass(kw_only=True)
class CheckpointConfig:
    every: int = 0  # save every this many steps (0: only at the end and when asked to stop)
    keep_last: int = 2  # committed checkpoints kept (older ones are deleted after a commit)
    # start from the newest good checkpoint in RUN_DIR/checkpoints when there is one
    resume: bool = True
    at_end: bool = True  # save after the last step
    # how a checkpoint is checked before a resume uses it
    verify: Literal["sha256", "sizes"] = "sha256"

    def __post_init__(self) -> None:
        if self.every < 0 or self.keep_last < 1:
            raise ValueError(
                f"checkpoint.every must be >= 0 and keep_last >= 1 (got {self.every}, {self.keep_last})"
            )


class RunCheckpointer:
    """Saves and restores a run: the stateful worker groups' parts and the controller's state."""

    def __init__(self, run_dir: Path, workers: dict[str, Any], options: CheckpointConfig):
        self.options = options
        self.store = CheckpointStore(RunPaths(run_dir).checkpoints, keep_last=options.keep_last)
        self.workers = workers  # role -> its WorkerGroup
        self.roles = sorted(
            r for r, g in workers.items() if hasattr(g.worker_cls, "save_checkpoint")
        )
        self._searched = False
        self._found: tuple[Checkpoint, dict[str, Any]] | None = None
        # called before each save: a pipeline whose colocated roles take turns brings the saved state back onto
        # its devices here (rollhpc.controller.colocation)
        self.before_save: Callable[[], None] | None = None

    def due(self, step: int, last_step: int) -> bool:
        o = self.options
        return bool(o.every and step % o.every == 0) or (o.at_end and step == last_step)

    def save(self, step: int, state: dict[str, Any], summary: dict[str, Any]) -> Checkpoint:
        """Write checkpoint ``step``: every stateful role at once, then the controller's ``state`` (pickled)
        and ``summary`` (JSON, also the manifest's meta). Nothing is visible until the commit."""
        if self.before_save is not None:
            self.before_save()
        run_dir = self.store.root.parent
        check_room(self.store, run_dir, step)  # a save that cannot fit is not started
        t0 = time.perf_counter()
        pending = self.store.begin(step)
        try:
            saving = [
                self.workers[r].save_checkpoint.submit(str(pending.path / r)) for r in self.roles
            ]
            ctl = pending.path / CONTROLLER_DIR
            ctl.mkdir()
            with open(ctl / STATE_FILE, "wb") as f:
                pickle.dump(state, f, protocol=pickle.HIGHEST_PROTOCOL)
            (ctl / SUMMARY_FILE).write_text(json.dumps(summary, indent=1) + "\n")
            role_stats = {r: s.result() for r, s in zip(self.roles, saving)}
            stop_file = RunPaths(self.store.root.parent).stop_request
            fault_injection.checkpoint_commit(
                step, summary.get("restarts", 0), stop_file, self._watch_workers
            )
            checkpoint = self.store.commit(pending, {**summary, "roles": self.roles})
        except BaseException as e:
            self.store.abort(pending)
            if raised_out_of_space(e):
                raise out_of_space(self.store, run_dir, f"checkpoint {step}") from e
            raise
        fault_injection.checkpoint_committed(step, stop_file, self._watch_workers)
        seconds = time.perf_counter() - t0
        log.info(
            "checkpoint %s saved in %.2f s (%s; %s)",
            checkpoint.path,
            seconds,
            ", ".join(f"{r} {s['seconds']:.2f} s" for r, s in role_stats.items())
            or "no stateful roles",
            human_bytes(checkpoint.manifest.nbytes),
        )
        return checkpoint

    def _watch_workers(self) -> None:
        """Move the controller's messages once; raises when a worker is gone (its liveness check)."""
        for workers in self.workers.values():
            workers.controller.pump()
            return

    def find(self) -> tuple[Checkpoint, dict[str, Any]] | None:
        """The checkpoint a resume will use (the newest good one) and the controller's state in it, or None
        when there is nothing to resume from (or ``resume`` is off). Calls no worker, so the controller does
        it while they start (checking the files' sha256 reads the whole checkpoint: minutes for a large
        model's); looked for once, ``restore`` loads what was found."""
        if not self._searched:
            self._found = self._find()
            self._searched = True
        return self._found

    def _find(self) -> tuple[Checkpoint, dict[str, Any]] | None:
        if not self.options.resume:
            return None
        self.store.recover()  # half-written checkpoints of a killed run
        checkpoint = self.store.latest_good(deep=self.options.verify == "sha256")
        if checkpoint is None:
            return None
        saved_roles = checkpoint.meta.get("roles", [])
        if sorted(saved_roles) != self.roles:
            raise RuntimeError(
                f"{checkpoint.path} holds the state of roles {saved_roles}, this run has stateful "
                f"roles {self.roles}: resume with the configuration it was saved with"
            )
        with open(checkpoint.path / CONTROLLER_DIR / STATE_FILE, "rb") as f:
            state = pickle.load(f)
        return checkpoint, state

    def restore(self) -> tuple[Checkpoint, dict[str, Any]] | None:
        """Load the checkpoint ``find`` names into the stateful roles; returns it and the controller's state,
        or None when there is nothing to resume from (or ``resume`` is off)."""
        found = self.find()
        if found is None:
            return None
        checkpoint, state = found
        t0 = time.perf_counter()
        loading = [
            self.workers[r].load_checkpoint.submit(str(checkpoint.path / r)) for r in self.roles
        ]
        for f in loading:
            f.result()
        log.info(
            "resumed from %s (step %d) in %.2f s",
            checkpoint.path,
            checkpoint.step,
            time.perf_counter() - t0,
        )
        return checkpoint, state
