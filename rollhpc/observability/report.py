"""``rollhpc report``: the figures and summary a person reads instead of metrics.jsonl.

From one run directory (or several, drawn on the same axes to compare them) it writes, atomically,
into the output folder:

* ``learning.png``: reward and held-out accuracy against step and against wall time;
* ``throughput.png``: generated tokens/s and the generators' idle fraction against step;
* ``stages.png``: where each step's time went (rollout, old log-probs, reference, critic, train, weight
  sync, evaluation, the rest), one panel per run;
* ``training.png``: what the trainer saw, a panel per quantity any of the runs logged (loss, gradient norm,
  clip fraction, response length, entropy, KL to the reference), each raw (faint) under a smoothed line;
  not written when none was logged;
* ``summary.txt``: steps, wall time, accuracy (first, best, last), throughput, time shares, restarts.

Wall time comes from each metrics record's ``time`` (written by ``RunLog``); for records without it,
from the summed step times. Restarts and requeues (RUN_DIR/restarts.jsonl) are drawn as vertical lines
on the wall-time axes. A run in progress is read as far as it has got (a torn last line is skipped).
Each PNG records its axes count in its ``Description`` text chunk (``axes=N``), for tests and tools.
"""

from __future__ import annotations

import datetime as dt
import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from rollhpc.rundir import RunPaths, atomic_write_bytes, read_jsonl
from rollhpc.rundir.records import read_events

# step timings in metrics.jsonl (seconds), in the order they happen within a step, and their labels
STAGES = (
    ("rollout_s", "rollout"),
    ("generate_s", "generate"),
    ("reward_s", "reward"),
    ("old_logprob_s", "old log-probs"),
    ("reference_s", "reference"),
    ("critic_values_s", "critic values"),
    ("train_s", "train"),
    ("weight_sync_s", "weight sync"),
    ("eval_s", "evaluation"),
)
# training.png's panels, in this order, each only where a run logged it: (key, title, y-axis label)
TRAINING_PANELS = (
    ("train/loss", "policy loss", "loss"),
    ("train/grad_norm", "gradient norm (before clipping)", "norm"),
    ("train/clip_frac", "clipped fraction of tokens", "fraction"),
    ("response_len_mean", "response length (mean)", "tokens"),
    ("row_len_mean", "episode row length (mean, agentic)", "tokens"),
    ("train/entropy", "policy entropy", "nats per token"),
    ("sampled_entropy", "entropy of the sampled tokens (generator)", "nats per token"),
    ("train/kl", "KL to the reference policy", "nats per token"),
)
# learning.png's panels, row by row, and throughput.png's: (key, against wall time, title, y-axis label, smoothed)
# the trainer against the generator (rollhpc.algo.correction), with what a loss.correction did
MISMATCH_PANELS = (
    ("mismatch_kl", "trainer-generator KL (k3 per token)", "nats per token"),
    ("logprob_abs_diff", "|trainer - generator| log-prob", "nats per token"),
    ("mismatch_ratio_p95", "ratio pi_old / mu: 95th percentile", "ratio"),
    ("mismatch_ratio_p05", "ratio pi_old / mu: 5th percentile", "ratio"),
    ("mismatch_ratio_max", "ratio pi_old / mu: largest", "ratio"),
    ("mismatch_seq_ratio_p95", "sequence ratio (geometric mean): 95th pct", "ratio"),
    ("correction_masked_frac", "tokens rejected by the correction", "fraction"),
    ("correction_masked_seq_frac", "sequences with a rejected token", "fraction"),
    ("correction_truncated_frac", "tokens whose weight was truncated", "fraction"),
    ("correction_ess", "effective sample size of the weights", "fraction of tokens"),
)
LEARNING_PANELS = (
    ("reward_mean", False, "reward (mean over samples)", "reward", True),
    ("accuracy", False, "held-out accuracy", "accuracy", False),
    ("reward_mean", True, "reward against wall time", "reward", True),
    ("accuracy", True, "held-out accuracy against wall time", "accuracy", False),
)
THROUGHPUT_PANELS = (
    ("tokens_per_s", False, "generated tokens/s", "tokens/s", True),
    ("generator_idle_fraction", False, "generator idle fraction", "fraction of the step", True),
)
RESTART_EVENTS = ("resume", "requeue", "requeued", "start")


@dataclass
class RunSeries:
    """One run's metrics as columns, plus its restart times."""

    name: str
    run_dir: Path
    records: list[dict[str, Any]]
    # (minutes since the run's start, label)
    restarts: list[tuple[float, str]] = field(default_factory=list)

    def column(self, key: str) -> tuple[list[float], list[float]]:
        """(steps, values) where the key was logged."""
        pairs = [
            (r["step"], float(r[key])) for r in self.records if isinstance(r.get(key), (int, float))
        ]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    def minutes(self) -> dict[int, float]:
        """Wall minutes since the first record, per step."""
        stamped = [
            (r["step"], r["time"]) for r in self.records if isinstance(r.get("time"), (int, float))
        ]
        if stamped and len(stamped) == len(self.records):
            t0 = stamped[0][1]
            return {s: (t - t0) / 60 for s, t in stamped}
        total, out = 0.0, {}
        # records without wall-clock stamps: the summed step times (start-up and restarts not counted)
        for r in self.records:
            total += float(r.get("step_s", 0.0) or 0.0)
            out[r["step"]] = total / 60
        return out

    def start_time(self) -> float | None:
        stamped = [r["time"] for r in self.records if isinstance(r.get("time"), (int, float))]
        return stamped[0] if stamped else None


def load_run(run_dir: Path) -> RunSeries:
    """The run's metrics and restarts; raises FileNotFoundError naming what is missing."""
    run_dir = Path(run_dir)
    path = RunPaths(run_dir).metrics
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl (is this a rollhpc run directory?)")
    records = [
        r for r in read_jsonl(path) if isinstance(r, dict) and isinstance(r.get("step"), int)
    ]
    series = RunSeries(run_dir.name, run_dir, records)
    t0 = series.start_time()
    for event in read_events(run_dir):
        if event.get("event") not in RESTART_EVENTS or t0 is None or "time" not in event:
            continue
        try:
            when = dt.datetime.strptime(event["time"], "%Y-%m-%dT%H:%M:%S%z").timestamp()
        except ValueError:
            continue
        if when >= t0:  # the first start precedes the first record: not a restart
            label = event["event"] + (f" @ step {event['step']}" if "step" in event else "")
            series.restarts.append(((when - t0) / 60, label))
    return series


def _figure(rows: int, cols: int, figsize: tuple[float, float]) -> tuple[Figure, list[Axes]]:
    """A figure of rows x cols panels laid out by matplotlib's constrained layout; its axes row by row.
    Drawn off-screen: a Figure of its own, never pyplot's global state."""
    fig = Figure(figsize=figsize, constrained_layout=True)
    axes = fig.subplots(rows, cols, squeeze=False)
    return fig, list(axes.flat)


def _save(fig: Figure, path: Path) -> Path:
    """Write the figure atomically, its axes count in the PNG's Description chunk."""
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110, metadata={"Description": f"axes={len(fig.axes)}"})
    atomic_write_bytes(path, png.getvalue())
    return path


def _mark_restarts(ax: Axes, run: RunSeries, color: str) -> None:
    for minutes, label in run.restarts:
        ax.axvline(minutes, color=color, linestyle="--", linewidth=1, alpha=0.8)
        ax.annotate(
            label,
            (minutes, 1),
            xycoords=("data", "axes fraction"),
            rotation=90,
            fontsize=7,
            va="top",
            ha="right",
            color=color,
        )


def _integer_steps(ax: Axes) -> None:
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # no step 1.5 on a short run's axis


def _note(ax: Axes, text: str) -> None:
    """Grey words in the middle of an empty panel."""
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="gray")


def _labels(runs: list[RunSeries]) -> list[str]:
    """Legend labels: the run's name, or its directory where two runs share a name (runs/a/x vs runs/b/x)."""
    names = [r.name for r in runs]
    return [r.name if names.count(r.name) == 1 else str(r.run_dir) for r in runs]


def _smoothed(values: list[float]) -> list[float]:
    """An exponential moving average over about a tenth of the points: the trend under noisy per-step values."""
    alpha = 1.0 / max(1.0, len(values) / 10)
    out, level = [], values[0]
    for v in values:
        level += alpha * (v - level)
        out.append(level)
    return out


def _plot_xy(
    ax: Axes,
    runs: list[RunSeries],
    key: str,
    *,
    wall: bool,
    title: str,
    ylabel: str = "",
    smooth: bool = False,
) -> None:
    colors = [f"C{i}" for i in range(10)]
    drawn = False
    for run, color, label in zip(runs, colors, _labels(runs)):
        steps, values = run.column(key)
        if not steps:
            continue
        drawn = True
        minutes = run.minutes() if wall else {}
        xs = [minutes.get(s, float("nan")) for s in steps] if wall else steps
        if smooth and len(values) > 5:
            ax.plot(xs, values, color=color, alpha=0.25, linewidth=0.8)
            ax.plot(xs, _smoothed(values), color=color, label=label)
        else:
            ax.plot(xs, values, color=color, label=label, marker="." if len(xs) < 40 else None)
        if wall:
            _mark_restarts(ax, run, color)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("wall time (min)" if wall else "step")
    if not wall:
        _integer_steps(ax)
    if ylabel:
        ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if not drawn:
        _note(ax, f"{key}: not logged")
    elif len(runs) > 1:
        ax.legend(fontsize=8)


def _stage_panel(ax: Axes, run: RunSeries) -> None:
    steps = [r["step"] for r in run.records if "step_s" in r]
    bottom = [0.0] * len(steps)
    by_step = {r["step"]: r for r in run.records}
    for key, label in STAGES:
        values = [float(by_step[s].get(key, 0.0) or 0.0) for s in steps]
        if any(values):
            ax.bar(steps, values, bottom=bottom, width=1.0, label=label, linewidth=0)
            bottom = [b + v for b, v in zip(bottom, values)]
    rest = [max(0.0, float(by_step[s]["step_s"]) - b) for s, b in zip(steps, bottom)]
    if any(rest):
        ax.bar(steps, rest, bottom=bottom, width=1.0, label="other", linewidth=0, color="lightgray")
    _integer_steps(ax)
    ax.set_title(f"{run.name}: time per step by stage", fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.legend(fontsize=7, loc="upper right")
    if not steps:
        _note(ax, "no step timings logged")


def _steps_line(run: RunSeries) -> str:
    trained = [r for r in run.records if "step_s" in r]
    last = run.records[-1]["step"] if run.records else 0
    minutes = run.minutes().get(last, 0.0)
    stamped = all(isinstance(r.get("time"), (int, float)) for r in run.records)
    return f"  steps: {last} logged, {len(trained)} trained; " + (
        f"wall time {minutes:.1f} min"
        if stamped
        else f"{minutes:.1f} min of step time (no wall-clock stamps in this run's metrics)"
    )


def _learning_lines(run: RunSeries) -> list[str]:
    """Held-out accuracy (first, last, best), reward and generation speed, each where it was logged."""
    lines = []
    steps, acc = run.column("accuracy")
    if acc:
        best = max(range(len(acc)), key=lambda i: acc[i])
        lines.append(
            f"  held-out accuracy: {acc[0]:.3f} at step {steps[0]} -> {acc[-1]:.3f} at step {steps[-1]} "
            f"(best {acc[best]:.3f} at step {steps[best]})"
        )
    _, reward = run.column("reward_mean")
    if reward:
        tail = reward[-10:]
        lines.append(
            f"  reward: first {reward[0]:.3f}, mean of the last {len(tail)} steps {sum(tail) / len(tail):.3f}"
        )
    _, tps = run.column("tokens_per_s")
    if tps:
        lines.append(f"  generation: {sum(tps) / len(tps):.0f} tokens/s on average")
    return lines


def _stage_shares_line(trained: list[dict[str, Any]]) -> list[str]:
    total = sum(float(r["step_s"]) for r in trained)
    if total <= 0:
        return []
    shares = [
        (label, sum(float(r.get(key, 0.0) or 0.0) for r in trained) / total)
        for key, label in STAGES
    ]
    return [
        "  time per step: "
        + ", ".join(f"{label} {share:.0%}" for label, share in shares if share > 0)
        + f" of {total / max(len(trained), 1):.2f} s"
    ]


def _mean_of(trained: list[dict[str, Any]], key: str) -> float | None:
    values = [float(r[key]) for r in trained if key in r]
    return sum(values) / len(values) if values else None


def _load_line(trained: list[dict[str, Any]]) -> list[str]:
    """Each role's share of a step inside calls and the CPU cores it used (rollhpc.controller.run_loop)."""
    roles = sorted({k.split("/")[1] for r in trained for k in r if k.startswith("load/")})
    if not roles:
        return []
    parts = []
    for role in roles:
        busy = _mean_of(trained, f"load/{role}/busy_fraction")
        cores = _mean_of(trained, f"load/{role}/cpu_cores")
        part = role + (f" busy {busy:.0%}" if busy is not None else "")
        parts.append(part + (f" {cores:.2f} cores" if cores is not None else ""))
    return ["  load per step (mean): " + ", ".join(parts)]


def _restarts_line(run: RunSeries) -> str:
    if not run.restarts:
        return "  restarts: none"
    return (
        f"  restarts: {len(run.restarts)} ("
        + "; ".join(f"{label} at {m:.1f} min" for m, label in run.restarts)
        + ")"
    )


def summarize(run: RunSeries) -> list[str]:
    """A few lines a person reads first."""
    trained = [r for r in run.records if "step_s" in r]
    return [
        f"run {run.name} ({run.run_dir})",
        _steps_line(run),
        *_learning_lines(run),
        *_stage_shares_line(trained),
        *_load_line(trained),
        _restarts_line(run),
    ]


def logged_panels(
    runs: list[RunSeries], panels: tuple[tuple[str, str, str], ...] = TRAINING_PANELS
) -> list[tuple[str, str, str]]:
    """Those of ``panels`` (training.png's by default) that some run logged."""
    return [panel for panel in panels if any(run.column(panel[0])[0] for run in runs)]


PanelSpec = tuple[
    str, bool, str, str, bool
]  # (key, against wall time, title, y-axis label, smoothed)


def _panels_png(
    runs: list[RunSeries],
    panels: tuple[PanelSpec, ...],
    shape: tuple[int, int],
    figsize: tuple[float, float],
    path: Path,
    suptitle: str,
) -> Path:
    """One figure of ``panels``, laid out ``shape`` (rows, columns) row by row, written to ``path``."""
    fig, axes = _figure(*shape, figsize)
    for ax, (key, wall, title, ylabel, smooth) in zip(axes, panels):
        _plot_xy(ax, runs, key, wall=wall, title=title, ylabel=ylabel, smooth=smooth)
    fig.suptitle(suptitle)
    return _save(fig, path)


def _logged_png(
    runs: list[RunSeries], panels: tuple[tuple[str, str, str], ...], path: Path, suptitle: str
) -> Path | None:
    """A figure of a panel per quantity of ``panels`` some run logged (training.png, mismatch.png); none (and an
    earlier report's removed) when no run logged any."""
    logged = logged_panels(runs, panels)
    if not logged:
        path.unlink(missing_ok=True)  # an earlier report's, of other runs
        return None
    cols = min(3, len(logged))
    rows = -(-len(logged) // cols)
    fig, axes = _figure(rows, cols, (11, 3.6 * rows))
    for ax, (key, panel_title, ylabel) in zip(axes, logged):
        _plot_xy(ax, runs, key, wall=False, title=panel_title, ylabel=ylabel, smooth=True)
    for ax in axes[len(logged) :]:
        fig.delaxes(ax)  # no empty panels
    fig.suptitle(suptitle)
    return _save(fig, path)


def _stages_png(runs: list[RunSeries], path: Path) -> Path:
    fig, axes = _figure(len(runs), 1, (11, 3.8 * len(runs)))
    for ax, run in zip(axes, runs):
        _stage_panel(ax, run)
    return _save(fig, path)


def write_report(run_dirs: list[Path], out_dir: Path) -> list[Path]:
    """Write the figures and summary.txt for ``run_dirs`` (compared on shared axes) into ``out_dir``;
    returns the files written."""
    runs = [load_run(Path(d)) for d in run_dirs]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    title = " vs ".join(r.name for r in runs)
    written = [
        _panels_png(
            runs, LEARNING_PANELS, (2, 2), (11, 7), out_dir / "learning.png", f"{title}: learning"
        ),
        _panels_png(
            runs,
            THROUGHPUT_PANELS,
            (1, 2),
            (11, 3.8),
            out_dir / "throughput.png",
            f"{title}: throughput",
        ),
    ]
    for name, panels in (("training", TRAINING_PANELS), ("mismatch", MISMATCH_PANELS)):
        if png := _logged_png(runs, panels, out_dir / f"{name}.png", f"{title}: {name}"):
            written.append(png)
    written.append(_stages_png(runs, out_dir / "stages.png"))
    text = "\n".join(line for run in runs for line in summarize(run)) + "\n"
    atomic_write_bytes(out_dir / "summary.txt", text.encode())
    written.append(out_dir / "summary.txt")
    return written
