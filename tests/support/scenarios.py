"""Controller programs used by the MPI tests: each drives a real world and records what it saw."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

import numpy as np

from rollhpc.batch import Batch, TrainingBatch
from rollhpc.protocol.pipeline import Pipeline
from rollhpc.protocol.worker import Dispatch, Worker, register
from rollhpc.workers.diagnostic import DiagnosticWorker


class DispatchScenario(Pipeline):
    """Every dispatch/collect mode, futures, and payload kinds; results go to RUN_DIR/scenario.json."""

    def run(self) -> None:
        import torch

        g = self.workers["probe"]
        out: dict = {}
        out["ping"] = g.ping()
        out["env"] = {
            role: self.workers[role].environ("ROLLHPC_ROLE_ENV") for role in ("probe", "other")
        }
        out["echo"] = g.echo({"a": 1})
        out["whoami"] = g.whoami()
        out["whoami_at_2"] = g.at(2).whoami()  # one chosen rank, its dispatch mode bypassed
        out["echo_at_3"] = g.at(3).echo.submit("x").result()
        rows = Batch({"x": np.arange(11), "y": torch.arange(11.0)}, meta={"step": 3})
        tagged = g.tag_rows(rows)
        out["tagged_x"] = tagged["x"].tolist()
        out["tagged_y"] = tagged["y"].tolist()
        out["tagged_dp"] = tagged["dp_rank"].tolist()
        out["tagged_meta"] = tagged.meta
        out["count_items"] = g.count_items(list(range(10)), scale=2)
        out["leaders"] = g.echo_from_leaders("hi")
        out["allreduce"] = g.role_allreduce(3)
        big = np.random.default_rng(1).integers(0, 255, 64 << 20, dtype=np.uint8)
        out["checksum_ok"] = all(s == int(big.sum(dtype=np.uint64)) for s in g.checksum(big))
        t = torch.randn(300, 300, dtype=torch.bfloat16)
        back = g.echo(t)
        out["bf16_ok"] = all(torch.equal(b, t) for b in back)
        # large one-to-all payloads go out as broadcasts: several in flight at once, between small calls and
        # calls on another group, each rank joining them in the order sent
        arrays = [
            np.random.default_rng(i).integers(0, 255, (2 << 20) + i, dtype=np.uint8)
            for i in range(3)
        ]
        futs = [g.checksum.submit(a) for a in arrays[:2]]
        small = g.echo.submit("between")
        other = self.workers["other"].checksum.submit(arrays[2])
        futs.append(g.checksum.submit(arrays[2]))
        mixed = {"x": torch.randn(1024, 1024, dtype=torch.bfloat16), "n": 7, "y": arrays[0]}
        echoed = g.echo(mixed)
        out["fanout_ok"] = (
            [f.result() for f in futs] == [[int(a.sum(dtype=np.uint64))] * 4 for a in arrays]
            and small.result() == ["between"] * 4
            and other.result() == [int(arrays[2].sum(dtype=np.uint64))]
            and all(
                torch.equal(e["x"], mixed["x"])
                and e["n"] == 7
                and np.array_equal(e["y"], arrays[0])
                for e in echoed
            )
        )
        out["fanouts_sent"] = g.controller.channel.fanouts_sent  # the 64 MiB one and these four
        # non-blocking: two sleeps submitted together finish in about the time of one
        import time

        start = time.perf_counter()
        futs = [g.sleep.submit(1.5), self.workers["other"].sleep.submit(1.5)]
        out["sleep_results"] = [f.result() for f in futs]
        out["overlap_s"] = time.perf_counter() - start
        try:
            g.no_such_method
        except AttributeError as e:
            out["typo_error"] = str(e)
        out["residency"] = self._take_turns()
        (self.run_ctx.run_dir / "scenario.json").write_text(json.dumps(out))

    def _take_turns(self) -> dict:
        """Colocation's turns on ranks that share devices: probe ranks 2 and 3 share theirs with "other" (a
        partial overlap), ranks 0 and 1 hold theirs alone and must never be asked to move."""
        from rollhpc.controller.colocation import Colocation, Residency

        colocation = Colocation(
            (frozenset({"probe", "other"}),), {"probe": frozenset({2, 3}), "other": frozenset({0})}
        )
        stages = {
            "generate": {"probe": ("weights", "kv_cache")},
            "train": {"other": ("parameters", "optimizer")},
            "weight_sync": {"other": ("parameters",), "probe": ("weights",)},
        }
        turns = Residency(self.workers, stages, colocation)
        for stage in ("train", "generate", "weight_sync"):
            turns.enter(stage)
        return {
            "probe": self.workers["probe"].moves(),
            "other": self.workers["other"].moves(),
            "metrics": turns.step_metrics(),
        }


class ReplyTreeScenario(Pipeline):
    """Calls on a group larger than controller.reply_fan_in, whose replies come back along a reply tree: every
    dispatch mode, array payloads, shared-memory files released through bundles, a direct reply overtaking the
    relayed ones of an earlier call; what it saw goes to RUN_DIR/scenario.json."""

    def run(self) -> None:
        g = self.workers["probe"]
        ctl = g.controller
        out: dict = {}
        taken = ctl.messages_taken
        out["ping_ranks"] = [p["rank"] for p in g.ping()]
        out["ping_messages"] = ctl.messages_taken - taken
        taken = ctl.messages_taken
        out["echo"] = g.echo({"a": 1})
        out["echo_messages"] = ctl.messages_taken - taken
        # arrays that travel raw (>= 8 KiB) at odd sizes, beside inline ones: each lands aligned in its bundle
        payload = {
            "f64": np.arange(3 * 1001, dtype=np.float64).reshape(3, 1001),
            "i8": np.arange(9_999, dtype=np.int8),
            "small": np.ones(3, dtype=np.int32),
        }
        out["arrays_ok"] = all(
            all(np.array_equal(e[k], v) and e[k].flags.aligned for k, v in payload.items())
            for e in g.echo(payload)
        )
        out["tagged_dp"] = g.tag_rows(Batch({"x": np.arange(23)}))["dp_rank"].tolist()
        out["count_items"] = g.count_items(list(range(22)))
        big = [np.random.default_rng(i).integers(0, 255, 2 << 20, dtype=np.uint8) for i in range(3)]
        out["checksum_ok"] = all(
            g.checksum(a) == [int(a.sum(dtype=np.uint64))] * len(g) for a in big
        )
        # released files, reported inside bundles
        out["shared_reused"] = ctl.channel.segments.reused
        # group rank 0 (the top relay) sleeps: the last rank has answered the group call to its relay, then
        # answers a call of its own straight to the controller, before the group call's replies are in
        group_call = g.sleep_on.submit(0, 1.5)
        alone = g.at(len(g) - 1).whoami.submit()
        out["alone"] = alone.result()
        out["group_done_when_alone_was"] = group_call.done()
        out["group"] = group_call.result()
        (self.run_ctx.run_dir / "scenario.json").write_text(json.dumps(out))


class FailScenario(Pipeline):
    """Make one worker fail in the chosen way while a call is in flight on the whole group."""

    required_roles = ("probe",)

    @dataclass(kw_only=True)
    class Options:
        how: str  # raise | crash | hang | mpi_stall
        rank: int = 1
        timeout_s: float = 3.0
        # how: raise: the other ranks sleep this long in the failing call
        others_sleep_s: float = 0.0

    def run(self) -> None:
        g = self.workers["probe"]
        g.ping()
        (self.run_ctx.run_dir / "pids.json").write_text(json.dumps([p["pid"] for p in g.ping()]))
        if self.options.how == "raise":
            g.fail_on(
                self.options.rank, "deliberate failure for the test", self.options.others_sleep_s
            )
        elif self.options.how == "crash":
            g.crash_on(self.options.rank, 0.3)
        elif self.options.how == "hang":
            g.hang_on.submit(self.options.rank).result(timeout_s=self.options.timeout_s)
        elif self.options.how == "mpi_stall":  # an MPI call of the controller never returns
            channel = g.controller.channel
            channel.busy_since = time.monotonic()
            channel.comm.Recv(bytearray(8), source=1, tag=4242)  # nobody ever sends it
        raise AssertionError("the failure did not stop the run")


class BrokenWorker(Worker):
    """A role whose construction fails, as a worker with a bad model path would."""

    def __init__(self, ctx, options=None):
        raise FileNotFoundError("model weights not found at /nonexistent")


class VanishScenario(Pipeline):
    """The controller process leaves with status 0 in mid-run, reporting nothing (as when it is killed
    while writing its report): mpiexec.gforker's own status is 0 whatever its ranks did."""

    def run(self) -> None:
        self.workers["probe"].ping()
        os._exit(0)


class SleepScenario(Pipeline):
    def run(self) -> None:
        self.workers["probe"].sleep(600)


class SlowStartWorker(Worker):
    """A role whose construction never finishes, as a worker stuck loading a model would."""

    def __init__(self, ctx, options=None):
        import time

        time.sleep(3600)


class TrainerLayoutScenario(Pipeline):
    """The megatron train role on fixed random batches: log-probs, optimizer steps, optionally a
    checkpoint or a resume, then the full weights; everything goes to RUN_DIR/trainer.pt, so that a test
    compares what two parallel layouts (PP2 and PP1, ...) computed on the same data."""

    @dataclass(kw_only=True)
    class Options:
        vocab: int = 100
        rows: int = 6
        length: int = 12
        steps: int = 2
        # checkpoint the train role into RUN_DIR/ckpt after this step (0: never)
        save_after: int = 0
        resume_from: str = ""  # a train role dir an earlier run saved: load it, then run the steps after save_after
        on_policy: bool = False  # train without old_logprob (the step's own forward gives them)
        # this many rows of each batch get advantage 0 (a GRPO group that scored alike)
        zero_advantage_rows: int = 0
        entropy_coef: float = 0.01
        # > 0: random routes [rows, length, moe_layers, route_top_k] of route_experts experts go with every batch
        # (the train role's router_replay: r3 replays them)
        route_layers: int = 0
        route_experts: int = 4
        route_top_k: int = 2

    def run(self) -> None:
        import torch

        from rollhpc.algo.objective import LossConfig
        from rollhpc.weight_sync.buckets import unpack_bucket

        o, train = self.options, self.workers["train"]
        rng = np.random.default_rng(0)
        route_rng = np.random.default_rng(1)  # the batches' tokens as without routes
        out: dict = {
            "loss": [],
            "grad_norm": [],
            "logprob": [],
            "rows_skipped": [],
            "micro_batches": [],
        }
        if o.resume_from:
            train.load_checkpoint(o.resume_from)
        for step in range(1, o.steps + 1):
            tokens = rng.integers(0, o.vocab, (o.rows, o.length))
            # responses of several lengths, right-padded as RLVR's batches are (the trainer cuts each micro-batch
            # after its last loss token); the first row runs to the last column
            starts = rng.integers(2, o.length - 2, o.rows)
            ends = rng.integers(starts + 1, o.length)
            ends[0] = o.length - 1
            positions = np.arange(o.length - 1)[None, :]
            mask = ((positions >= starts[:, None]) & (positions < ends[:, None])).astype(np.float32)
            # padding after each row's response
            tokens[np.arange(o.length)[None, :] > ends[:, None]] = 0
            advantage = rng.standard_normal(o.rows).astype(np.float32)
            advantage[rng.permutation(o.rows)[: o.zero_advantage_rows]] = 0.0
            if o.resume_from and step <= o.save_after:
                continue  # the resumed run's batches are the ones after its checkpoint
            routes = None
            if o.route_layers:
                shape = (o.rows, o.length, o.route_layers, o.route_experts)
                routes = np.argsort(route_rng.random(shape), -1)[..., : o.route_top_k]
                routes = routes.astype(np.int16)  # distinct experts per token, as a top-k
            batch = TrainingBatch(tokens, mask, advantage, routes=routes)
            if not o.on_policy:
                inputs = (
                    {"tokens": tokens} if routes is None else {"tokens": tokens, "routes": routes}
                )
                batch.old_logprob = logp = train.compute_logprobs(Batch(inputs))["logprob"]
                out["logprob"].append(torch.as_tensor(logp))
            stats = train.train_step(batch, LossConfig(kl_coef=0.0, entropy_coef=o.entropy_coef))
            out["loss"].append(stats[0]["loss"])
            out["rows_skipped"].append(stats[0]["rows_skipped"])
            out["grad_norm"].append(stats[0]["grad_norm"])
            out["micro_batches"].append(stats[0]["micro_batches"])
            if "route_replay_differ_frac" in stats[0]:
                out.setdefault("route_differ", []).append(stats[0]["route_replay_differ_frac"])
            if step == o.save_after:
                train.save_checkpoint(str(self.run_ctx.run_dir / "ckpt"))
                out["saved_weights"] = {
                    n: t.clone() for b in train.export_weights() for n, t in unpack_bucket(b)
                }
        out["weights"] = {n: t.clone() for b in train.export_weights() for n, t in unpack_bucket(b)}
        torch.save(out, self.run_ctx.run_dir / "trainer.pt")


class TurnTakingProbe(DiagnosticWorker):
    """The diagnostic role with colocation's offload / reload calls: it records them and reports bytes."""

    moved: list

    @register(Dispatch.ONE_TO_ALL)
    def environ(self, name: str) -> str | None:
        """The variable as this rank's process has it (a role's ``env`` sets it)."""
        return os.environ.get(name)

    @register(Dispatch.ONE_TO_ALL)
    def offload_states(self, parts: list[str]) -> dict:
        self.__dict__.setdefault("moved", []).append(["offload", parts])
        return {"bytes": 1e9 * len(parts)}

    @register(Dispatch.ONE_TO_ALL)
    def reload_states(self, parts: list[str]) -> dict:
        self.__dict__.setdefault("moved", []).append(["reload", parts])
        return {"bytes": 1e9 * len(parts)}

    @register(Dispatch.ONE_TO_ALL)
    def moves(self) -> list:
        return self.__dict__.get("moved", [])


class PayloadProbe(DiagnosticWorker):
    """Writes into what it received: a rank's copy of a one-to-all payload must be its own."""

    @register(Dispatch.ONE_TO_ALL)
    def bump_and_sum(self, array: np.ndarray) -> int:
        array += np.uint8(self.ctx.group_rank + 1)
        return int(array.sum(dtype=np.uint64))


class SharedPayloadScenario(Pipeline):
    """One-to-all payloads of 1 MiB and more to a role on the controller's machine go through one
    shared-memory file (controller.one_to_all: auto): several in flight with a small call between, a torch
    tensor among numpy arrays, ranks writing into theirs; a file both ranks have released is written again for
    the next payload of its size (the test's fixture checks that none is left after the run)."""

    def run(self) -> None:
        import torch

        g = self.workers["probe"]
        arrays = [
            np.random.default_rng(i).integers(0, 255, (3 << 20) + i, dtype=np.uint8)
            for i in range(3)
        ]
        sums = [int(a.sum(dtype=np.uint64)) for a in arrays]
        futs = [g.bump_and_sum.submit(a) for a in arrays[:2]]
        small = g.echo.submit("between")
        futs.append(g.bump_and_sum.submit(arrays[2]))
        mixed = {"x": torch.randn(1024, 1024, dtype=torch.bfloat16), "n": 7, "y": arrays[0]}
        echoed = g.echo(mixed)
        want = [
            [int(((a.astype(np.uint64) + r + 1) % 256).sum()) for r in range(len(g))]
            for a in arrays
        ]
        bumped = [f.result() for f in futs]
        segments = g.controller.channel.segments
        reused_before = segments.reused
        # the file of the first arrays[1] call, released by both ranks
        again = g.bump_and_sum(arrays[1])
        out = {
            "bumped_ok": bumped == want and again == want[1],
            "controller_copies_intact": [int(a.sum(dtype=np.uint64)) for a in arrays] == sums,
            "small": small.result(),
            "echo_ok": all(
                torch.equal(e["x"], mixed["x"])
                and e["n"] == 7
                and np.array_equal(e["y"], arrays[0])
                for e in echoed
            ),
            "shared_sent": g.controller.channel.shared_sent,
            "reused": segments.reused - reused_before,
        }
        (self.run_ctx.run_dir / "scenario.json").write_text(json.dumps(out))
