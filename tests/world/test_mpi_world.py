"""Real MPI worlds started through `rollhpc train`: dispatch modes and every kind of failure."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.processes import assert_no_orphans, cli_env, rank_processes, rollhpc

PROBE = "rollhpc.workers.diagnostic:DiagnosticWorker"


def fail_world(how: str, **extra) -> dict:
    return {
        "pipeline": {
            "entry": "tests.support.scenarios:FailScenario",
            "options": {"how": how, **extra},
        },
        "roles": {"probe": {"worker": PROBE, "procs": 3}},
        "controller": {"call_timeout_s": 60.0, "stack_dump_timeout_s": 5.0},
    }


def test_dispatch_modes_futures_and_payloads(experiment, tmp_path):
    path, run_dir = experiment(
        {
            "pipeline": {"entry": "tests.support.scenarios:DispatchScenario"},
            "roles": {
                "probe": {
                    "worker": "tests.support.scenarios:TurnTakingProbe",
                    "procs": 4,
                    "parallel": {"tp": 2},
                },
                "other": {
                    "worker": "tests.support.scenarios:TurnTakingProbe",
                    "procs": 1,
                    "env_vars": {"ROLLHPC_ROLE_ENV": 7},
                },
            },
            "controller": {"one_to_all": "broadcast"},  # "auto" broadcasts only to other machines
        }
    )
    res = rollhpc("train", str(path), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    out = json.loads((run_dir / "scenario.json").read_text())
    assert [p["rank"] for p in out["ping"]] == [1, 2, 3, 4]
    assert len({p["pid"] for p in out["ping"]}) == 4  # separate processes
    # a role's env_vars reach its ranks only
    assert out["env"] == {
        "probe": [None] * 4,
        "other": ["7"],
    }
    assert out["echo"] == [{"a": 1}] * 4  # one-to-all, collect all
    assert out["whoami"] == 0  # rank-zero only
    assert out["whoami_at_2"] == 2 and out["echo_at_3"] == "x"  # a single chosen rank
    # split by dp rank (tp=2 -> dp=2): rows keep their order, first half on dp 0
    assert out["tagged_x"] == list(range(11))
    assert out["tagged_y"] == [float(i) for i in range(11)]
    assert out["tagged_dp"] == [0] * 6 + [1] * 5
    assert out["tagged_meta"] == {"step": 3}
    # lists split, scalars replicated, leaders gathered
    assert out["count_items"] == [
        [0, 10],
        [1, 10],
    ]
    assert out["leaders"] == [[0, "hi"], [1, "hi"]]
    assert out["allreduce"] == [12] * 4  # the role communicator spans the role's ranks only
    assert out["checksum_ok"] and out["bf16_ok"]  # 64 MiB numpy and bf16 torch payloads intact
    # payloads >= 1 MiB to all 4 ranks went as broadcasts
    assert out["fanout_ok"] and out["fanouts_sent"] == 5
    assert out["sleep_results"] == [[1.5] * 4, [1.5]]
    # two groups' non-blocking calls ran concurrently: one after the other would take >= 3 s
    assert out["overlap_s"] < 2.9
    assert "no remote method 'no_such_method'" in out["typo_error"] and "echo" in out["typo_error"]
    # colocation's turns reach only the ranks that share devices (a partial overlap: probe ranks 2 and 3)
    turns = out["residency"]
    both = [
        ["offload", ["kv_cache", "weights"]],
        ["reload", ["kv_cache", "weights"]],
        ["offload", ["kv_cache"]],
    ]
    # the weight sync frees the KV cache for the trainer's parameters
    assert turns["probe"] == [
        [],
        [],
        both,
        both,
    ]
    assert turns["other"] == [
        [["offload", ["optimizer", "parameters"]], ["reload", ["parameters"]]]
    ]
    assert turns["metrics"]["residency/stages"] == "train>generate>weight_sync"
    assert turns["metrics"]["residency/generate/offloaded_gb"] == 2  # the two parts of other
    # two parts on each of two probe ranks
    assert turns["metrics"]["residency/generate/reloaded_gb"] == 2 * 2
    assert_no_orphans(run_dir)


def test_one_to_all_payloads_on_one_machine_go_through_one_shared_file(experiment, tmp_path):
    path, run_dir = experiment(
        {
            "pipeline": {"entry": "tests.support.scenarios:SharedPayloadScenario"},
            "roles": {"probe": {"worker": "tests.support.scenarios:PayloadProbe", "procs": 2}},
        }
    )
    res = rollhpc("train", str(path), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    out = json.loads((run_dir / "scenario.json").read_text())
    # each rank wrote into a copy of its own
    assert out["bumped_ok"] and out["controller_copies_intact"]
    assert out["small"] == ["between"] * 2 and out["echo_ok"]
    # a released file written again; all gone at the end
    assert out["shared_sent"] == 5 and out["reused"] == 1
    assert_no_orphans(run_dir)


def test_worker_exception_reaches_controller_with_rank_role_traceback(experiment, tmp_path):
    path, run_dir = experiment(fail_world("raise", rank=1))
    start = time.monotonic()
    res = rollhpc("train", str(path), cwd=tmp_path, timeout=60)
    assert res.returncode == 1, res.stderr[-4000:]
    assert time.monotonic() - start < 30
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("rollhpc: run failed: worker rank 2 (role 'probe', group rank 1")
    assert "RuntimeError in 'fail_on': deliberate failure for the test" in last
    assert "raise RuntimeError(message)" in res.stderr  # the worker's traceback is shown
    err = json.loads((run_dir / "error.json").read_text())
    assert err["type"] == "WorkerError" and "diagnostic.py" in err["details"]
    assert_no_orphans(run_dir)


def test_killed_worker_mid_call_is_named_and_nothing_hangs(experiment, tmp_path):
    path, run_dir = experiment(fail_world("crash", rank=2))
    start = time.monotonic()
    res = rollhpc("train", str(path), cwd=tmp_path, timeout=60)
    elapsed = time.monotonic() - start
    assert res.returncode == 1, res.stderr[-4000:]
    assert elapsed < 30, f"took {elapsed:.1f} s to notice a dead worker"
    last = res.stderr.strip().splitlines()[-1]
    assert "worker rank 3 (role 'probe', group rank 2" in last
    assert "died while running 'crash_on'" in last
    # the controller's words after a rank died reach the console: mpiexec.gforker stops forwarding output at a
    # rank's exit, so they come through the console the launcher handed the ranks (rollhpc.launch.console)
    assert "failure classified as lost_worker" in res.stderr, res.stderr[-4000:]
    assert json.loads((run_dir / "error.json").read_text())["type"] == "WorkerDied"
    assert_no_orphans(run_dir)


def test_controller_stuck_in_an_mpi_call_ends_the_run_with_a_report(experiment, tmp_path):
    """A real MPI call on the controller that never returns (here a receive nobody answers; on Slurm, an
    Isend to a rank that died, which OFI's tcp provider retries forever): the stall watch reports and ends
    the run (with a dead worker, Controller.dead_worker names it from the sideband)."""
    world = fail_world("mpi_stall")
    world["controller"]["mpi_stall_s"] = 2.0
    path, run_dir = experiment(world)
    res = rollhpc("train", str(path), cwd=tmp_path, timeout=60)
    assert res.returncode == 1, res.stderr[-4000:]
    last = res.stderr.strip().splitlines()[-1]
    assert re.search(r"an MPI call on the controller has not returned for [234] s", last), last
    # a lost peer's verdict
    assert json.loads((run_dir / "error.json").read_text())["type"] == "StalledCall"
    assert (
        json.loads((run_dir / "controller-exit.json").read_text())["failure"]["kind"] == "lost_peer"
    )
    assert_no_orphans(run_dir)


def test_controller_that_ends_without_a_report_is_a_failed_run(experiment, tmp_path):
    path, run_dir = experiment(
        {
            "pipeline": {"entry": "tests.support.scenarios:VanishScenario"},
            "roles": {"probe": {"worker": PROBE, "procs": 1}},
        }
    )
    res = rollhpc("train", str(path), cwd=tmp_path, timeout=60)
    assert res.returncode == 1, res.stderr[-4000:]
    assert "before the controller reported how" in res.stderr.strip().splitlines()[-1]
    assert_no_orphans(run_dir)


def test_hung_call_times_out_with_stacks_of_every_rank(experiment, tmp_path):
    path, run_dir = experiment(fail_world("hang", rank=0, timeout_s=2.0))
    res = rollhpc("train", str(path), cwd=tmp_path, timeout=60)
    assert res.returncode == 1, res.stderr[-4000:]
    last = res.stderr.strip().splitlines()[-1]
    assert (
        "call 'hang_on' on role 'probe': no reply within 2 s from rank 1 (role 'probe', group rank 0"
        in last
    )
    (stacks,) = (run_dir / "logs").glob("stacks-*.txt")
    text = stacks.read_text()
    for rank in (1, 2, 3):
        assert f"=== rank {rank} (role 'probe'" in text
    assert "in hang_on" in text  # the hung rank's main thread is caught in the act
    assert_no_orphans(run_dir)


def test_worker_that_cannot_start_is_reported(experiment, tmp_path):
    path, run_dir = experiment(
        {
            "pipeline": {"entry": "tests.support.scenarios:SleepScenario"},
            "roles": {
                "probe": {"worker": PROBE, "procs": 1},
                "broken": {"worker": "tests.support.scenarios:BrokenWorker"},
            },
        }
    )
    res = rollhpc("train", str(path), cwd=tmp_path, timeout=60)
    assert res.returncode == 1, res.stderr[-4000:]
    assert "role 'broken'" in res.stderr and "FileNotFoundError in '__init__'" in res.stderr
    assert_no_orphans(run_dir)


def start_sleeping_world(experiment, tmp_path) -> tuple[subprocess.Popen, Path, list]:
    """Launch a 3-rank world whose controller sleeps inside a call; return once it is running."""
    path, run_dir = experiment(
        {
            "pipeline": {"entry": "tests.support.scenarios:SleepScenario"},
            "roles": {"probe": {"worker": PROBE, "procs": 2}},
        }
    )
    # a terminal user's launcher: SIGINT at its default, also when the suite itself runs in the background
    # (`cmd &` in a script starts it with SIGINT ignored, inherited by every child: Ctrl-C would never arrive)
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollhpc.cli", "train", str(path)],
        cwd=tmp_path,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    log = run_dir / "logs" / "rank0-controller.log"
    deadline = time.monotonic() + 60
    while (
        not (log.exists() and "world of 3 ranks up" in log.read_text())
        and time.monotonic() < deadline
    ):
        time.sleep(0.2)
    ranks = rank_processes(run_dir)
    assert len(ranks) >= 3, "world did not start"
    from rollhpc.launch.local import shm_segments

    # the leak check counts the segments launch.json names: those must be the ones MPICH really created
    launch = json.loads((run_dir / "launch.json").read_text())
    assert (
        launch["world_shm"] and set(launch["world_shm"] + launch["launcher_shm"]) <= shm_segments()
    ), launch
    return proc, run_dir, ranks


def test_interrupting_the_launcher_ends_the_run_cleanly(experiment, tmp_path):
    proc, run_dir, _ = start_sleeping_world(experiment, tmp_path)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode != 0, err[-4000:]
    assert (
        "run interrupted: the controller received signal SIGINT" in err.strip().splitlines()[-1]
    ), err[-4000:]
    assert_no_orphans(run_dir)


@pytest.mark.leaves_shm  # a SIGKILLed launcher cannot clean up: the next launch sweeps what it left
def test_killing_the_launcher_takes_the_world_with_it(experiment, tmp_path):
    from rollhpc.launch.local import remove_leaked_segments, shm_segments

    before = shm_segments()
    proc, run_dir, _ = start_sleeping_world(experiment, tmp_path)
    proc.kill()
    proc.communicate(timeout=30)
    assert_no_orphans(run_dir)
    remove_leaked_segments(before)


def test_world_with_killed_controller_cleans_up(experiment, tmp_path):
    """If the controller itself dies, every worker notices through the sideband and exits."""
    proc, run_dir, ranks = start_sleeping_world(experiment, tmp_path)
    (controller,) = [p for p in ranks if p.info["cmdline"][-1] == "controller"]
    controller.kill()
    proc.communicate(timeout=30)
    assert proc.returncode != 0
    assert_no_orphans(run_dir)


def test_worker_stuck_in_start_up_hits_the_start_up_timeout(experiment, tmp_path):
    path, run_dir = experiment(
        {
            "pipeline": {"entry": "tests.support.scenarios:SleepScenario"},
            "roles": {
                "probe": {"worker": PROBE, "procs": 1},
                "slow": {"worker": "tests.support.scenarios:SlowStartWorker"},
            },
            "controller": {"startup_timeout_s": 4.0, "stack_dump_timeout_s": 3.0},
        }
    )
    res = rollhpc("train", str(path), cwd=tmp_path, timeout=60)
    assert res.returncode == 1, res.stderr[-4000:]
    last = res.stderr.strip().splitlines()[-1]
    assert "worker start-up: no reply within 4 s from rank 2 (role 'slow'" in last
    (stacks,) = (run_dir / "logs").glob("stacks-*.txt")
    assert "in __init__" in stacks.read_text() and "time.sleep(3600)" in stacks.read_text()
    assert_no_orphans(run_dir)


def run_stalled_world(
    experiment, tmp_path: Path, stall: str
) -> tuple[subprocess.CompletedProcess, Path]:
    """A 3-rank world with a 5 s controller.world_timeout_s in which one rank stalls (ROLLHPC_TEST_STALL_MPI_INIT);
    returns once it ended, which must be well before the test's own limit."""
    path, run_dir = experiment(
        {
            "pipeline": {"entry": "tests.support.scenarios:SleepScenario"},
            "roles": {"probe": {"worker": PROBE, "procs": 2}},
            "controller": {"world_timeout_s": 5.0},
        }
    )
    t0 = time.monotonic()
    res = subprocess.run(
        [sys.executable, "-m", "rollhpc.cli", "train", str(path)],
        cwd=tmp_path,
        text=True,
        capture_output=True,
        timeout=90,
        env={**cli_env(), "ROLLHPC_TEST_STALL_MPI_INIT": stall},
    )
    assert res.returncode == 1 and time.monotonic() - t0 < 60, res.stderr[-2000:]
    return res, run_dir


def test_mpi_init_that_never_finishes_hits_the_world_timeout(experiment, tmp_path):
    """A rank stalled before its MPI_Init keeps the others inside theirs (MPI_Init waits for every rank):
    each is ended by its guard (a forked watcher, started before anything imports mpi4py: a Python timer
    cannot fire while MPI_Init holds the interpreter), which records the failure for the batch script's
    requeue decision."""
    res, run_dir = run_stalled_world(experiment, tmp_path, "2")
    # the first guard to fire ends its rank; the launcher then interrupts the others, which go quietly
    assert re.search(
        r"rollhpc: MPI_Init did not finish within 5 s \(role '(probe|controller)', pid ", res.stderr
    ), res.stderr[-2000:]
    assert "MPI_Init did not finish within 5 s (role '" in res.stderr.strip().splitlines()[-1]
    assert "Traceback" not in res.stderr, res.stderr[-2000:]  # an interrupted start-up ends quietly
    record = json.loads((run_dir / "startup-failed.json").read_text())
    assert "MPI_Init did not finish" in record["why"] and record["job_id"] is None
    assert_no_orphans(run_dir)


def test_rank_missing_from_the_first_collectives_hits_the_world_timeout(experiment, tmp_path):
    """Every rank got through MPI_Init but one never reaches the first collective: the others wait in it,
    where nothing inside a rank can end the wait; their guards end every rank at the same limit."""
    res, run_dir = run_stalled_world(experiment, tmp_path, "2:collectives")
    assert "MPI_Init did not finish" not in res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert (
        "the MPI world did not form within 5 s (" in last
        and "finished MPI_Init, not the first collectives" in last
    )
    record = json.loads((run_dir / "startup-failed.json").read_text())
    assert "the MPI world did not form" in record["why"] and not record["culprit"]
    assert_no_orphans(run_dir)


def own_segments(tmp_path: Path, before: set[str]) -> set[str] | None:
    """The /dev/shm files in use or left by the runs this test launched: the segments each launch recorded
    (launch.json: its world's, the launcher's own) and the one-to-all payload files of its ranks
    (``rollhpc_fanout_<pid>_``, new since ``before``); None if a launch could not name its world's segment."""
    from rollhpc.launch.local import FANOUT_PREFIX, shm_segments

    names, pids = set(), set()
    for path in tmp_path.rglob("launch.json"):
        launch = json.loads(path.read_text())
        if "mpiexec_pid" in launch:  # (not: the launch failed before mpiexec started)
            if not launch["world_shm"]:
                return None
            names.update(launch["world_shm"], launch["launcher_shm"])
    for world in tmp_path.rglob("world.json"):
        pids.update(rank["pid"] for rank in json.loads(world.read_text()))
    fanout = tuple(f"{FANOUT_PREFIX}{pid}_" for pid in pids)
    return names | {name for name in shm_segments() - before if fanout and name.startswith(fanout)}


@pytest.fixture(autouse=True)
def no_leaked_shared_memory(request, tmp_path):
    """Every world above ends by a crash or an abort on purpose; none may leave its MPICH segments in /dev/shm.
    Only this test's own count: on a busy machine other MPI jobs (another test run, a Slurm job, any process that
    imported mpi4py: an MPI singleton, ``mpich_shm_<its pid in hex>_0``) create and leave segments meanwhile, and
    pids wrap, so a test's world may even reuse the name of a segment that was there before it."""
    from rollhpc.launch.local import shm_segments

    before = shm_segments()
    yield
    if not request.node.get_closest_marker("leaves_shm"):
        ours = own_segments(tmp_path, before)
        left = shm_segments() & ours if ours is not None else shm_segments() - before
        assert left == set()


def test_a_rank_adopts_only_the_console_descriptors_it_really_inherited(tmp_path):
    """``adopt_console`` takes over stdout/stderr from ``ROLLHPC_CONSOLE`` only where the named descriptor is the
    same file (device, inode): a stale or foreign entry leaves the rank's own streams alone."""
    from rollhpc.launch.console import ENV

    code = (
        "import os, sys; from rollhpc.launch.console import adopt_console; "
        "print(adopt_console(), os.environ.get('ROLLHPC_CONSOLE')); print('to stderr', file=sys.stderr)"
    )
    console = tmp_path / "console"
    with open(console, "w") as f:
        out, err = os.dup(f.fileno()), os.dup(f.fileno())
        st = os.fstat(out)
        try:
            runs = {}
            for name, ino in (("same", st.st_ino), ("foreign", st.st_ino + 1)):
                spec = f"1={out}:{st.st_dev}:{ino},2={err}:{st.st_dev}:{ino}"
                runs[name] = subprocess.run(
                    [sys.executable, "-c", code],
                    pass_fds=(out, err),
                    capture_output=True,
                    text=True,
                    env={**cli_env(), ENV: spec},
                    timeout=60,
                )
        finally:
            os.close(out)
            os.close(err)
    assert runs["same"].stdout == runs["same"].stderr == ""
    assert console.read_text() == "True None\nto stderr\n"
    assert runs["foreign"].stdout == "False None\n" and runs["foreign"].stderr == "to stderr\n"
