"""Run-level helpers for the entry points: run directory, step timing, checkpoints."""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import sys
import time
from collections import Counter
from contextlib import contextmanager

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, open_dict, read_write

from rl.config import Config, load
from rl.driver.bounds import EXIT_BOUND_S, exit_after
from rl.learner.checkpoint import TRAINER_STATE, prune, read_trainer_state, step_dir, write_trainer_state
from rl.model import largest_param_bytes, resolve_model_path
from rl.rollout.functions import load as load_rollout_function
from rl.runtime import Runtime
from rl.tasks.build import check_task

logger = logging.getLogger(__name__)

INTERRUPTED = 130
"""Exit status of a run stopped by Ctrl-C (128 + SIGINT, as a shell reports it)."""


def exit_on_interrupt(main, exit_bound_s: float = EXIT_BOUND_S) -> None:
    """Run an entry point's ``main``; Ctrl-C ends the process with status 130 after the
    run's parts were stopped (``Cluster.__exit__``), with one line instead of a traceback.
    However ``main`` ends (all of Hydra's jobs done), the process's exit is bounded by
    ``exit_bound_s`` (``rl.driver.bounds``)."""
    try:
        main()
    except KeyboardInterrupt:
        logger.warning("interrupted by the user (Ctrl-C)")
        sys.exit(INTERRUPTED)
    finally:
        exit_after(exit_bound_s)


class CheckConfigFirst(Callback):
    """Hydra callback (conf/config.yaml): validates the config before Hydra creates the run
    directory (it does so before calling ``main``), so that a config error leaves nothing
    behind. The error ends the process with its message, as ``main`` would have."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        job = config.copy()
        with read_write(job), open_dict(job):
            del job["hydra"]
        try:
            cfg = load(job)
            check_task(cfg.task)
            load_rollout_function(cfg.rollout.function)
        except Exception as e:  # whatever load raises is the user's config error, reported
            raise SystemExit(f"{type(e).__name__}: {e}") from None  # Hydra's callbacks swallow Exception


def prepare_run(cfg: Config) -> Runtime:
    """Resolve the run directory and the model checkpoint (building the tiny one if needed)."""
    output_dir = cfg.output_dir
    if output_dir is None:
        try:
            output_dir = HydraConfig.get().runtime.output_dir
        except ValueError:  # not under @hydra.main (tests, notebooks)
            output_dir = os.path.join("outputs", time.strftime("%Y-%m-%d/%H-%M-%S"))
    output_dir = os.path.abspath(output_dir)
    os.makedirs(os.path.join(output_dir, "logs"), exist_ok=True)
    model_path = resolve_model_path(cfg.model)
    largest = largest_param_bytes(model_path, cfg.model.dtype)
    if cfg.weights.bucket_bytes < largest:
        raise ValueError(f"weights.bucket_bytes={cfg.weights.bucket_bytes} is smaller than the "
                         f"model's largest tensor ({largest} bytes); set weights.bucket_bytes to "
                         f"at least that, e.g. {-(-largest // (1 << 20))}mb")
    runtime = Runtime(run_id=Runtime.new_run_id(cfg.run_name), output_dir=output_dir,
                      model_path=model_path)
    logger.info("%s: outputs in %s", runtime.run_id, output_dir)
    return runtime


class StepTimer:
    """``with timer("rollout"): ...`` -> ``perf/rollout_time``; ``metrics()`` adds the step's
    time and its wall-clock start (``perf/step_started_at``, to line up with the rollout's and
    the learners' ``*_at`` stamps)."""

    def __init__(self) -> None:
        self.started_at = time.time()
        self.t0 = time.perf_counter()
        self.times: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t

    def metrics(self) -> dict[str, float]:
        step = time.perf_counter() - self.t0
        out = {f"perf/{k}_time": v for k, v in self.times.items()}
        out["perf/step_time"] = step
        out["perf/step_started_at"] = self.started_at
        return out


def checkpoint_root(cfg: Config, runtime: Runtime) -> str:
    return os.path.abspath(os.path.expanduser(cfg.checkpoint.dir or
                                              os.path.join(runtime.output_dir, "checkpoints")))


def resume(cfg: Config, cluster) -> int:
    """Load ``checkpoint.resume`` into learners and manager; return the step to start at."""
    if cfg.checkpoint.resume is None:
        return 0
    path = os.path.abspath(os.path.expanduser(cfg.checkpoint.resume))
    state = read_trainer_state(path)
    cluster.learners.load(path)
    cluster.rollout.load_state_dict(state["rollout"])
    logger.info("resumed from %s at step %s", path, state["step"])
    return int(state["step"])


def newest_checkpoint(cfg: Config, runtime: Runtime) -> str | None:
    """The newest complete checkpoint (one with trainer_state.json) this run can resume from:
    the latest it saved, else the one it resumed from; None when there is none."""
    root = checkpoint_root(cfg, runtime)
    found = [os.path.join(root, d) for d in (os.listdir(root) if os.path.isdir(root) else [])
             if d.startswith("step_") and os.path.exists(os.path.join(root, d, TRAINER_STATE))]
    if cfg.checkpoint.resume is not None:
        found.append(os.path.abspath(os.path.expanduser(cfg.checkpoint.resume)))
    return max(found, key=lambda p: int(read_trainer_state(p)["step"]), default=None)


_PLAIN_VALUE = re.compile(r"[\w./:@+-]+")


def resume_command(checkpoint: str, output_dir: str, argv: list[str] | None = None,
                   cwd: str | None = None) -> str:
    """The command line that continues this run from ``checkpoint``, for a shell: this
    directory, this interpreter, the same script and overrides, with ``output_dir`` set to
    this run's directory (metrics.jsonl appends, checkpoints continue beside the old ones)
    and ``checkpoint.resume`` replacing any earlier one."""
    argv = list(sys.argv if argv is None else argv)

    def override(key: str, value: str) -> str:  # a Hydra value: quoted unless plain
        if not _PLAIN_VALUE.fullmatch(value):
            value = "'" + value.replace("'", "\\'") + "'"
        return f"{key}={value}"

    mine = re.compile(r"\+{0,2}(checkpoint\.resume|output_dir)=")
    args = [a for a in argv[1:] if not mine.match(a)]
    args += [override("output_dir", output_dir), override("checkpoint.resume", checkpoint)]
    return f"cd {shlex.quote(cwd or os.getcwd())} && {shlex.join([sys.executable, argv[0], *args])}"


def resume_hint(cfg: Config, runtime: Runtime) -> str:
    """What to run after a learner died: the resume command, or why there is none."""
    path = newest_checkpoint(cfg, runtime)
    if path is None:
        return (f"no complete checkpoint to resume from (checkpoint.every={cfg.checkpoint.every}; "
                "0 saves none): the run must be started again")
    return f"resume with: {resume_command(path, runtime.output_dir)}"


@contextmanager
def consuming(store, ref):
    """The step's data is removed when the block ends, also when it fails (a failure to
    remove is then reported, never raised over the original error)."""
    try:
        yield ref
    except BaseException:
        try:
            store.remove(ref.partitions)
        except Exception as e:
            logger.warning("could not remove the data of step %d: %s", ref.step, e)
        raise
    store.remove(ref.partitions)


def checkpoint_due(cfg: Config, step: int) -> bool:
    every = cfg.checkpoint.every
    return bool(every) and (step % every == 0 or step == cfg.num_steps)


def maybe_save(cfg: Config, runtime: Runtime, cluster, step: int,
               rollout_state: dict | None = None) -> None:
    """Save after ``step`` steps when due (and at the end); prune old checkpoints.
    ``rollout_state``: the manager's data position to record, when a later batch is already
    being generated (async)."""
    if not checkpoint_due(cfg, step):
        return
    root = checkpoint_root(cfg, runtime)
    path = step_dir(root, step)
    cluster.learners.save(path)  # with checkpoint.save_hf, <path>/hf too
    write_trainer_state(path, {"step": step, "run_id": runtime.run_id,
                               "rollout": rollout_state or cluster.rollout.state_dict(),
                               # what python -m rl.learner.export_hf needs besides the shards
                               "model": {"path": runtime.model_path, "dtype": cfg.model.dtype}})
    prune(root, cfg.checkpoint.keep_last)
    logger.info("checkpoint %s%s", path, " (Hugging Face model in hf/)" if cfg.checkpoint.save_hf else "")


def step_metrics(step: int, ref, train: dict[str, float], weights: dict[str, float],
                 timer: StepTimer) -> dict[str, float]:
    """One step's metrics: rollout, train, weights, timings, and how stale the samples were."""
    m = {**ref.stats, **train, **weights, **timer.metrics()}
    # async: the generation ran beside training; its own duration is the rollout time
    m.setdefault("perf/rollout_time", ref.stats["rollout/generate_time"])
    m["perf/wait_time_ratio"] = m.get("perf/wait_rollout_time", 0.0) / max(m["perf/step_time"], 1e-9)
    m.setdefault("async/staleness_mean", step - ref.stats["rollout/weight_version_mean"])
    m.setdefault("async/staleness_max", step - ref.stats["rollout/weight_version_min"])
    return m


def write_sample_ledger(runtime: Runtime, ledger: list[dict] | None) -> dict[str, int]:
    """Append to ``samples.jsonl`` (one line per generated batch: each sample's weight version
    and outcome) and print this run's balance: generated = trained + dropped, by reason."""
    if ledger is None:
        logger.warning("samples: no ledger (the rollout manager did not answer)")
        return {}
    counts = Counter(o for entry in ledger for o in entry["outcome"])
    # appended: a resumed run (same output_dir) adds its batches after the dead run's
    with open(os.path.join(runtime.output_dir, "samples.jsonl"), "a") as f:
        for entry in ledger:
            f.write(json.dumps(entry) + "\n")
    generated = sum(counts.values())
    dropped = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()) if k != "trained") or "none"
    logger.info("samples: %d generated = %d trained + dropped (%s); ledger in samples.jsonl",
                generated, counts["trained"], dropped)
    return dict(counts)
