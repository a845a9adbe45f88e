"""The driver's checks that a weight push reaches the engines' parameters.

The push itself is checked by the version each engine reports; these two close the gap that
leaves: an engine that accepts an update and keeps its old weights.

- **Names, before the first push** (``check_names``, from ``Cluster.start``): the names
  learner rank 0 will push, read from its model as ``Learner.push_weights`` sends them
  (``model.named_parameters()``), against what each engine's loader loads, by the
  architecture the engine reports in ``/model_info`` (``rl.rollout.weight_names``).
- **Content, after the first pushes of a run** (``ContentCheck``, from
  ``WeightPusher.push``): the leading rows of a few small parameters, read back from
  every engine through ``/get_weights_by_name`` (SGLang's route; the CPU engine serves it
  the same way), must equal the learners' values cast to the dtype they were pushed in
  (``model.dtype``, the engines' own), value for value; else an error names the engine and
  the parameter. The first push of a fresh run sends what the engines already loaded from
  the checkpoint, so the second push, the first with trained weights, is checked too.

- **Coverage, at the first push of a run** (``CoverageCheck``, from ``WeightPusher.push``):
  every tensor an engine holds is written by a push. Through SGLang's ``/weights_checker``,
  each engine fills its tensors with random values (``reset_tensors``), the learners push,
  each engine hashes every tensor (``checksum``); then again. A tensor the push writes hashes
  the same both times; one it misses (a name the loader drops with a warning, a shard of a
  fused parameter left out) holds other random values the second time and is named. It
  needs the engine's hash function on neither side, and costs one push more. Checked: the
  target model (a speculative-decoding draft is left alone), without SGLang's derived
  buffers and the rotary tables (``COVERAGE_SKIP``). An engine that fails the check holds
  random values in what the push missed: the run stops, and the engines must be restarted.

What SGLang 0.5.23 serves there: its route calls the model's own ``get_weights_by_name``
(``model_runner_components/weight_exporter.py``), which only a few model classes define
(``llama``, ``opt``, ``granite``, ``exaone4``, ``embedding_gemma2``). ``Qwen2ForCausalLM``
defines none, so SGLang answers every name with HTTP 400 "Get parameter by name failed".
Such an engine is named in a warning and its content goes unchecked by this route; the
coverage check still finds a parameter the push leaves unwritten.
"""

from __future__ import annotations

import logging
import math
import time

import numpy as np

from rl.rollout.client import EngineClient, EngineError
from rl.rollout.weight_names import PushedModel, check_push_names

logger = logging.getLogger(__name__)

CONTENT_CHECKS = 2
"""Pushes read back at the start of a run (the first, and the first with trained weights)."""
PROBE_VALUES = 8192
"""About how many values to read back per probed parameter (whole rows, at least one)."""
UNSERVED = "Get parameter by name failed"
"""SGLang's answer when the model cannot serve ``/get_weights_by_name`` (or lacks the name)."""


# -- run inside the learner processes (``LearnerGroup.run``) -----------------------------
def pushed_model(learner) -> tuple[PushedModel, dict[str, list[int]]]:
    """What ``learner.push_weights`` sends: its parameters' names, in order, and shapes."""
    config = learner.model.config
    shapes = {name: list(p.shape) for name, p in learner.model.named_parameters()}
    return PushedModel(names=list(shapes), num_layers=int(getattr(config, "num_hidden_layers", 0)),
                       tied_embeddings=bool(getattr(config, "tie_word_embeddings", False))), shapes


def leading_rows(learner, rows: dict[str, int], dtype: str) -> dict[str, np.ndarray] | None:
    """The first ``rows[name]`` rows of each named parameter, cast to ``dtype`` as the push
    casts it, as float32 (exact for every dtype pushed); rank 0 answers. A collective: every
    rank gathers the sharded parameters."""
    import torch  # the learner's process has it; the driver does not need it

    from transfer.weights.base import full_tensor

    params = dict(learner.model.named_parameters())
    out = {name: full_tensor(params[name].detach().to(getattr(torch, dtype)))[:n].float().cpu().numpy()
           for name, n in rows.items()}
    return out if learner.rank == 0 else None


# -- in the driver -------------------------------------------------------------------------
def check_names(learners, clients: list[EngineClient], dtype: str) -> ContentCheck:
    """Refuse (``ValueError``) names an engine's loader would not load; returns the content
    check for the pushes to come."""
    model, shapes = learners.run(pushed_model, rank0_only=True)
    for client in clients:
        architectures = client.model_info().get("architectures")
        logger.info("%s: %s", client.name, check_push_names(model, architectures, client.name))
    return ContentCheck(shapes, dtype)


def pick_probes(shapes: dict[str, list[int]]) -> dict[str, int]:
    """A few small parameters to read back, each with its row count (SGLang's
    ``truncate_size``): the first and the last vector, and the last of the smallest
    matrices (Qwen2: layer 0's ``q_proj`` bias, the final norm, the last layer's ``v_proj``).
    Small, because the learners gather each whole."""
    vectors = [n for n, s in shapes.items() if len(s) == 1]
    matrices = [n for n, s in shapes.items() if len(s) >= 2]
    picked = vectors[:1] + vectors[-1:]
    if matrices:
        smallest = min(math.prod(shapes[n]) for n in matrices)
        picked.append([n for n in matrices if math.prod(shapes[n]) == smallest][-1])
    return {n: max(1, PROBE_VALUES // max(1, math.prod(shapes[n][1:]))) for n in dict.fromkeys(picked)}


def compare_rows(engine: str, name: str, got, want: np.ndarray, dtype: str, version: int) -> str | None:
    """Why an engine's answer for ``name`` is not the learners' rows ``want``, or None.
    Exact: both are ``dtype`` values (-0.0 equals 0.0; NaN equals NaN, JSON keeps no payload)."""
    got_a = np.asarray(got, dtype=np.float32)
    if got_a.shape != want.shape:
        return (f"{engine}: parameter {name!r}: its first rows have shape {list(got_a.shape)}, the "
                f"learners' {list(want.shape)}")
    same = (got_a == want) | (np.isnan(got_a) & np.isnan(want))
    if same.all():
        return None
    at = np.unravel_index(int(np.flatnonzero(~same)[0]), want.shape)
    return (f"{engine}: parameter {name!r} holds other values than the learners pushed as version "
            f"{version}: {int((~same).sum())} of {same.size} values read back differ, the first at "
            f"{tuple(int(i) for i in at)}: engine {float(got_a[at])!r}, learners {float(want[at])!r} "
            f"({dtype})")


REFERENCE_PARAMETER = "model.embed_tokens.weight"
"""A parameter every decoder model that SGLang serves has: an engine that cannot read even
this one back cannot serve the route at all."""


def serves_route(client: EngineClient) -> bool:
    """Whether the engine's model answers ``/get_weights_by_name``. SGLang answers the same
    400 for a model without the method (Qwen2 in 0.5.23) and for a name the model lacks
    (Llama), so the 400 of a probed name counts as "unserved" only when the reference
    parameter gets it too; otherwise that name is missing on the engine."""
    try:
        client.get_weights_by_name(REFERENCE_PARAMETER, truncate_size=1)
    except EngineError as e:
        if e.status == 404 or e.status == 400 and UNSERVED in str(e):
            return False
        raise
    return True


class ContentCheck:
    """Reads a few pushed parameters back from every engine after each of the first
    ``CONTENT_CHECKS`` pushes."""

    def __init__(self, shapes: dict[str, list[int]], dtype: str) -> None:
        self.probes = pick_probes(shapes)
        self.dtype = dtype
        """The dtype the learners push in (``model.dtype``)."""
        self.left = CONTENT_CHECKS
        self.unserved: set[str] = set()
        """Engines whose model cannot serve ``/get_weights_by_name`` (warned once)."""

    def after_push(self, learners, clients: list[EngineClient], version: int) -> None:
        """``RuntimeError`` naming each engine and parameter that differ."""
        if self.left == 0 or not self.probes:
            return
        self.left -= 1
        want = learners.run(leading_rows, self.probes, self.dtype)
        problems = [p for c in clients if c.name not in self.unserved
                    for p in self._engine_problems(c, want, version)]
        if problems:
            raise RuntimeError("the engines do not hold the weights the learners pushed (a parameter "
                               "loaded under another name or layout, or not at all):\n  - "
                               + "\n  - ".join(problems))
        logger.info("weights of version %s read back from %d engine(s): %s", version,
                    len(clients) - len(self.unserved), ", ".join(self.probes))

    def _engine_problems(self, client: EngineClient, want: dict[str, np.ndarray],
                         version: int) -> list[str]:
        problems = []
        for name, rows in self.probes.items():
            try:
                got = client.get_weights_by_name(name, truncate_size=rows)
            except EngineError as e:
                if e.status == 404 or e.status == 400 and UNSERVED in str(e) and not serves_route(client):
                    self.unserved.add(client.name)
                    logger.warning("%s cannot serve /get_weights_by_name for %r (%s): the pushed "
                                   "weights' content is not checked on it, only their names and "
                                   "version (SGLang serves the route only for models that define "
                                   "get_weights_by_name; Qwen2 does not)", client.name, name, e)
                    return []
                if e.status is None:  # gone: rollout fault tolerance deals with it
                    logger.warning("%s: no answer to /get_weights_by_name: %s", client.name, e)
                    return []
                problems.append(f"{client.name}: parameter {name!r}: {e}")
                continue
            problem = compare_rows(client.name, name, got, want[name], self.dtype, version)
            if problem is not None:
                problems.append(problem)
        return problems


COVERAGE_SKIP = ["rotary_emb"]
"""Tensors the coverage check leaves alone besides SGLang's own skips: every rotary table
(their buffers are derived, not loaded, and some variants' names escape SGLang's list,
e.g. the dual-chunk tables of Qwen2.5's 1M-context models)."""


class CoverageCheck:
    """The first push of a run, done twice between random resets of every engine tensor
    (module docstring): a tensor whose hash differs between the two was not written."""

    def run(self, push, clients) -> dict[str, float]:
        """``push()`` twice, checked; returns the second push's metrics. ``clients()``: the
        engines' clients now (a push may replace a dead engine: rollout fault tolerance).
        ``RuntimeError`` naming each engine and the tensors the push left unwritten."""
        t0 = time.monotonic()
        checked: dict[str, EngineClient] = {}
        for c in clients():  # a read-only probe first: a release without the route keeps its weights
            if self._ask(c, "checksum") is None:
                logger.warning("%s cannot answer /weights_checker checksums: which of its parameters "
                               "a push writes is not checked", c.name)
            elif self._ask(c, "reset_tensors") is not None:
                checked[c.name] = c
        metrics = push()
        first = self._checksums(checked, clients)
        for c in list(checked.values()):
            if self._ask(c, "reset_tensors") is None:
                checked.pop(c.name)
        metrics = push()
        second = self._checksums(checked, clients)
        problems = [p for name in second if name in first
                    for p in self._compare(checked[name], first[name], second[name])]
        if problems:
            raise RuntimeError(
                "the weight push does not write every tensor of the engines (a name the engine's "
                "loader drops, a shard of a fused parameter left out, or a tensor the model derives "
                "that this check does not know); those tensors now hold random values, so restart "
                "the engines, and set weights.check_coverage=false only for a tensor that is not a "
                "weight:\n  - " + "\n  - ".join(problems))
        compared = [name for name in second if name in first]
        tensors = sum(len(hashes) for name in compared for hashes in second[name].values())
        logger.info("the push writes every tensor of %d engine(s) (%d tensors checked in %.1fs)",
                    len(compared), tensors, time.monotonic() - t0)
        return metrics

    @staticmethod
    def _ask(client: EngineClient, action: str):
        """The engine's answer; None when it cannot (or died: fault tolerance deals with it)."""
        try:
            return client.check_weights(action, COVERAGE_SKIP)
        except EngineError as e:
            logger.warning("%s: /weights_checker %s failed (%s): its parameters are not checked",
                           client.name, action, e)
            return None

    def _checksums(self, checked: dict[str, EngineClient], now) -> dict[str, dict]:
        """Each checked engine's checksums; an engine replaced by the push (another URL) or
        one that gives none leaves the check."""
        urls = {c.name: c.url for c in now()}
        out = {}
        for name, c in list(checked.items()):
            hashes = self._ask(c, "checksum") if urls.get(name) == c.url else None
            if hashes is None:
                checked.pop(name)
            else:
                out[name] = hashes
        return out

    @staticmethod
    def _compare(client: EngineClient, first: dict, second: dict) -> list[str]:
        if sorted(first) != sorted(second) or len(second) != client.num_ranks or \
                not all(second.values()):
            return [f"{client.name}: its checksums cover ranks {sorted(first)} then {sorted(second)} "
                    f"(expected {client.num_ranks}, each with tensors)"]
        problems = []
        for rank, hashes in sorted(second.items()):
            missed = sorted(n for n in first[rank].keys() | hashes.keys()
                            if first[rank].get(n) != hashes.get(n))
            if missed:
                problems.append(f"{client.name} (rank {rank}): {len(missed)} of {len(hashes)} tensors, "
                                f"first {missed[:8]}")
        return problems
