"""The CPU engine's core: batched sampling with log-probs and in-place weight updates.

No HTTP here (see ``hf_server``), so it is testable directly. Sampling and stopping follow
SGLang 0.5.23 (``sampling`` holds the parameters and the sampler): a sequence ends at the
first stop string found in its decoded tail, else at a stop token (EOS or
``stop_token_ids``, none with ``ignore_eos``), which is returned as the last output id,
else at ``max_new_tokens``. Weight updates follow SGLang's session rules
(``scheduler_components/weight_updater.py``): ``update_weights_from_distributed`` runs only
between ``begin_weight_update`` and ``end_weight_update``, and refuses before receiving.

Pausing follows SGLang 0.5.23's ``Scheduler.pause_generation`` (``managers/scheduler.py``;
the modes are documented on ``PauseGenerationReqInput`` in ``managers/io_struct.py``). A
batch asks its ``PausePoint`` between two decode steps, after sampling a token and before
the next forward pass:

- ``retract``: every unfinished request leaves the batch (``retract_all``): it keeps its
  output tokens and their log-probs, drops its KV cache, and counts a retraction
  (``Req.reset_for_retract``). Run again (after ``continue_generation``), its prompt and
  output so far are prefilled anew under the weights then in force, so its KV and every
  later token come from those weights alone ("recomputed after continue_generation"); as in
  SGLang the re-prefilled batch builds fresh penalty state (``SamplingBatchInfo
  .from_schedule_batch`` prepares ``penaltylib``'s frequency, presence and min_new_tokens
  counters at zero), so those count the output from the resumption on.
- ``in_place``: the batch stays as it is, KV cache included, and waits with the engine's
  lock released, so weights can be updated meanwhile; after ``continue_generation`` it
  decodes on with the new weights over the old KV cache ("continue generation after
  continue_generation with the old kv cache").

Either way each output token's log-prob is computed by the weights that sampled it, and a
request that saw a version change answers its versions as SGLang's spans
(``weight_versions``).

As in SGLang's scheduler, a request that finishes leaves the batch at once (its rows of the
KV cache and of the sampler's state with it; a model whose cache holds other than attention
layers keeps the rows, unused), so a batch's later steps compute only the requests still
decoding, and it is reported finished then (``run``'s ``on_finish``), not when the batch
ends. Requests that arrive while a batch decodes join it at a step boundary (``run``'s
``admit``; SGLang's continuous batching): they are prefilled by themselves, then their KV
rows are appended to the batch's, the shorter left-padded and the padding masked out, so a
row attends to its own tokens as it would alone (models whose cache holds other than
full-attention layers wait for the batch to end instead). A weight update outside a pause
waits for the running batch to end, as SGLang's ``model_update_lock`` makes it wait for the
requests in flight (``tokenizer_control_mixin.update_weights_from_distributed``), and no
request joins the batch while it waits (``_exclusive``). Weight reads and checks are answered
between two decode steps of the running batch, as SGLang's scheduler answers them from its
loop (``_between_steps``), or at once when nothing runs.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import threading
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import torch

from rl.rollout.engines.sampling import BatchSampler, GenRequest
from rl.rollout.engines.weight_versions import VersionEvent
from transfer.weights.group import SideGroup, init_side_group

__all__ = ["GenRequest", "GenResult", "GenState", "HFEngine", "PausePoint"]

RETRACT, IN_PLACE = "retract", "in_place"
"""SGLang's pause modes the engine serves (its default, ``abort``, is not served)."""

UNCHECKED_BUFFERS = ("cos_sin_cache", "cos_cache", "sin_cache", "inv_freq", "freqs_cis",
                     "expert_mask_gpu")
"""Name parts of the buffers SGLang's weight checker leaves alone (derived, not loaded)."""

ASIDE_POLL_S = 0.01
"""How often a read or check waiting for the engine looks whether its lock is free."""

OUTSIDE_SESSION = ("update_weights_from_distributed must run between begin_weight_update() "
                   "and end_weight_update()")


@dataclass
class GenResult:
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: dict
    weight_version: str
    """The version that sampled the last output token (SGLang's served version when the
    request finished); the newest of its spans."""
    text: str = ""
    """The decoded output, trimmed at the matched stop as SGLang's detokenizer does."""
    version_events: list[VersionEvent] = field(default_factory=list)
    """The version changes the request saw while holding output tokens (``weight_versions``)."""
    num_retractions: int = 0
    """Times the request was retracted (SGLang's ``meta_info.num_retractions``)."""


@dataclass
class GenState:
    """One request on its way through the engine: its output so far, kept across a
    retraction (``HFEngine.run``); finished once ``finish_reason`` is set."""

    req: GenRequest
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: dict | None = None
    version: str | None = None
    """The weight version that sampled the last output token."""
    version_events: list[VersionEvent] = field(default_factory=list)
    retractions: int = 0
    error: Exception | None = None
    """Why the request failed on its own (joining a running batch), if it did; it is
    answered with this error."""

    def add(self, token: int, logprob: float, version: str) -> None:
        """Append a token sampled by the weights of ``version``. SGLang records an event on
        each request holding output when the version changes; recording it here, when the
        first token of a new version arrives, gives the same spans: a request gets at
        least one more token after any change (it was unfinished), and the changes with no
        token between them are spans that ``weight_version_spans`` drops or merges."""
        if self.output_ids and version != self.version:
            self.version_events.append(VersionEvent(self.version, len(self.output_ids)))
        self.version = version
        self.output_ids.append(token)
        self.logprobs.append(logprob)


class PausePoint(Protocol):
    """What a running batch asks between two decode steps (the server's scheduler answers):
    ``pause_mode()`` every step; while it answers ``in_place``, ``hold()`` with the engine's
    lock released, then ``pause_mode()`` again."""

    def pause_mode(self) -> str | None:
        """``retract``, ``in_place``, or None when not paused."""

    def hold(self) -> None:
        """Block while paused in place (weights may change meanwhile)."""


class HFEngine:
    def __init__(self, model, tokenizer, eos_ids: list[int], *, seed: int = 0,
                 weight_version: str = "default", device: str = "cpu") -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.eos_ids = list(eos_ids)
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self._noise = torch.Generator(device=self.device).manual_seed(seed + 1)  # not the sampler's
        self.weight_version = weight_version
        self.lock = threading.Lock()  # a batch and a weight update never overlap
        self._waiters = 0  # threads waiting for the lock to update weights
        self._waiters_lock = threading.Lock()
        self._asides: list[_Aside] = []  # weight reads and checks waiting for a step boundary
        self._asides_lock = threading.Lock()
        self.groups: dict[str, SideGroup] = {}
        self.session: dict | None = None  # the open weight-update session, if any
        self._session_lock = threading.Lock()
        self.params = dict(model.named_parameters())
        config = model.config
        self.vocab_size = int(getattr(config, "vocab_size", None)
                              or model.get_input_embeddings().num_embeddings)
        self.context_len: int | None = getattr(config, "max_position_embeddings", None)
        # transformers 5 renamed `past_key_values` to `cache`; 4.x (GPU images) has the old name.
        self._cache_arg = ("cache" if "cache" in inspect.signature(model.forward).parameters
                           else "past_key_values")
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]

    # -- generation --------------------------------------------------------------------
    def generate(self, reqs: list[GenRequest]) -> list[GenResult]:
        """Decode ``reqs`` as one batch to the end (no pause point)."""
        states = [GenState(r) for r in reqs]
        self.run(states)
        return [self.result(s) for s in states]

    @torch.no_grad()
    def run(self, states: list[GenState], pause: PausePoint | None = None,
            on_finish: Callable[[GenState], None] | None = None,
            admit: Callable[[int], list[GenState]] | None = None) -> None:
        """Decode the unfinished ``states`` as one batch until each has finished, or until
        ``pause`` retracts them: then the unfinished ones keep ``finish_reason`` None, and a
        later ``run`` resumes them (see the module's docstring). ``on_finish(state)`` is
        called, on this thread, as each request finishes. ``admit(rows)``, asked at each step
        boundary with the rows decoding, gives requests that join the batch there."""
        with self.lock:
            # reads and checks also before and after the batch: batches with no step boundary
            # (every request done at its prefill) must not starve one that waits
            self._run_asides()
            try:
                self._run(states, pause, on_finish or (lambda s: None), admit)
            finally:
                self._run_asides()

    def _run(self, states: list[GenState], pause: PausePoint | None,
             on_finish: Callable[[GenState], None],
             admit: Callable[[int], list[GenState]] | None) -> None:
        batch = self._prefill(states, on_finish)
        while batch is not None:
            if pause is not None and self._retracting(pause):
                for s in batch.states:
                    s.retractions += s.finish_reason is None
                return
            if self._asides:
                self._run_asides()
            if admit is not None and not self._waiters and batch.joinable:
                self._join(batch, admit(len(batch.states)), on_finish)
            batch.attn = torch.cat([batch.attn, batch.attn.new_ones((len(batch.states), 1))], dim=1)
            batch.pos = batch.pos + 1
            out = self.model(input_ids=batch.tok[:, None], attention_mask=batch.attn,
                             position_ids=batch.pos, use_cache=True, **{self._cache_arg: batch.cache})
            batch.cache = _cache_of(out)
            batch = self._step(batch, out.logits[:, -1, :], on_finish)

    def _join(self, batch: _Batch, new: list[GenState], on_finish: Callable[[GenState], None]) -> None:
        """``new`` requests join ``batch``. If that fails (a prompt the model refuses, memory)
        they fail alone, each finished with its ``error``; the batch decodes on untouched."""
        if not new:
            return
        try:
            batch.join(self._prefill(new, on_finish))
        except Exception as e:
            for s in new:
                if s.finish_reason is None and s.error is None:
                    s.error = e
                    on_finish(s)

    def _prefill(self, states: list[GenState], on_finish: Callable[[GenState], None]) -> _Batch | None:
        """Run the prompts of ``states`` (and a retracted request's output so far: its KV
        comes from these weights) and sample each one's next token; the unfinished ones as a
        batch, or None when none is left."""
        for s in states:
            if s.finish_reason is None and s.req.max_new_tokens <= 0:
                s.finish_reason, s.version = {"type": "length", "length": 0}, self.weight_version
                on_finish(s)
        active = [s for s in states if s.finish_reason is None]
        if not active:  # max_new_tokens=0 everywhere: nothing to run
            return None
        dev, B = self.device, len(active)
        seqs = [s.req.input_ids + s.output_ids for s in active]
        width = max(len(q) for q in seqs)
        ids = torch.full((B, width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((B, width), dtype=torch.long)
        for i, q in enumerate(seqs):  # left padding: the last column is every prompt's end
            ids[i, width - len(q):] = torch.tensor(q)
            attn[i, width - len(q):] = 1
        ids, attn = ids.to(dev), attn.to(dev)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        reqs = [s.req for s in active]
        out = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True)
        cache = _cache_of(out)
        batch = _Batch(active, [set() if r.ignore_eos else set(r.stop_token_ids) | set(self.eos_ids)
                                for r in reqs], [self._tail_len(r.stop) for r in reqs],
                       attn, pos[:, -1:], cache,
                       BatchSampler(reqs, self.eos_ids, out.logits.shape[-1], dev, self.generator),
                       (selectable := _rows_selectable(cache)), selectable and _rows_joinable(cache))
        return self._step(batch, out.logits[:, -1, :], on_finish)

    def _step(self, batch: _Batch, logits_bv: torch.Tensor,
              on_finish: Callable[[GenState], None]) -> _Batch | None:
        """Sample every row's next token from ``logits_bv``; finished requests are answered
        and leave the batch (their rows stay, unused, in a cache that cannot drop them).
        None once every request has finished."""
        tok, logp = batch.sampler.sample(logits_bv)
        batch.sampler.record(tok)
        batch.tok = tok
        tok_l, logp_l = tok.tolist(), logp.tolist()
        for i, s in enumerate(batch.states):  # the lock is held: these logits are this version's
            if s.finish_reason is None:
                s.add(tok_l[i], logp_l[i], self.weight_version)
                s.finish_reason = self._finished(s.req, s.output_ids, batch.stops[i], batch.tails[i])
                if s.finish_reason is not None:
                    on_finish(s)
        keep = [i for i, s in enumerate(batch.states) if s.finish_reason is None]
        if not keep:
            return None
        if len(keep) < len(batch.states):
            batch.drop_finished(keep)
        return batch

    @contextmanager
    def _exclusive(self):
        """The lock, for a weight update, which waits for the running batch to end: while it
        waits no request joins the batch, so the batch ends (SGLang's ``model_update_lock``,
        which holds new requests back)."""
        with self._waiters_lock:
            self._waiters += 1
        try:
            self.lock.acquire()
        finally:
            with self._waiters_lock:
                self._waiters -= 1
        try:
            yield
        finally:
            self.lock.release()

    def _between_steps(self, fn: Callable[[], object]) -> object:
        """``fn()`` (a weight read or check) with no forward pass running: run by the decoding
        thread at the running batch's next step boundary, or here as soon as the engine's lock
        is free (no batch, a batch paused in place, or after a weight update). SGLang's
        scheduler answers these from its loop, between two steps; as there, a
        ``reset_tensors`` check lands under the requests in flight (the driver's coverage check
        runs before any rollout)."""
        job = _Aside(fn)
        with self._asides_lock:
            self._asides.append(job)
        while True:
            if self.lock.acquire(blocking=False):
                try:
                    self._run_asides()
                finally:
                    self.lock.release()
            if job.done.wait(ASIDE_POLL_S):
                return job.outcome()

    def _run_asides(self) -> None:
        """Run the reads and checks waiting (the engine's lock held): each by one thread."""
        with self._asides_lock:
            jobs, self._asides = self._asides, []
        for job in jobs:
            job.run()

    def _retracting(self, pause: PausePoint) -> bool:
        """At a step boundary: True to retract the batch; paused in place, wait here with
        the lock released (a weight update takes it), keeping the batch and its KV cache."""
        while (mode := pause.pause_mode()) == IN_PLACE:
            self.lock.release()
            try:
                pause.hold()
            finally:
                self.lock.acquire()
        return mode == RETRACT

    def _tail_len(self, stop: list[str]) -> int:
        """Tokens to decode to find any of ``stop`` (SGLang: the longest, in tokens, plus 1)."""
        return max((len(self.tokenizer.encode(s, add_special_tokens=False)) for s in stop),
                   default=0) + 1

    def _finished(self, req: GenRequest, ids: list[int], stops: set[int], tail: int) -> dict | None:
        """SGLang's ``Req.update_finish_state`` order: stop string, stop token, length."""
        if req.stop:
            text = self.tokenizer.decode(ids[-tail:])
            for s in req.stop:
                if s in text:
                    return {"type": "stop", "matched": s}
        if ids[-1] in stops:
            return {"type": "stop", "matched": ids[-1]}
        if len(ids) >= req.max_new_tokens:
            return {"type": "length", "length": req.max_new_tokens}
        return None

    def result(self, state: GenState) -> GenResult:
        """The answer of a finished request, with text as SGLang's detokenizer makes it: a
        matched stop token is left out of the text, and the text ends before a matched stop
        string."""
        req, ids, reason = state.req, state.output_ids, state.finish_reason
        assert reason is not None and state.version is not None, "the request has not finished"
        matched = reason.get("matched")
        text_ids = ids[:-1] if isinstance(matched, int) else ids
        text = self.tokenizer.decode(
            text_ids, skip_special_tokens=req.skip_special_tokens,
            spaces_between_special_tokens=req.spaces_between_special_tokens)
        if isinstance(matched, str) and (pos := text.find(matched)) != -1:
            text = text[:pos]
        return GenResult(ids, state.logprobs, reason, state.version, text,
                         list(state.version_events), state.retractions)

    # -- weight updates (SGLang's init_weights_update_group, begin_weight_update,
    #    update_weights_from_distributed, end_weight_update, destroy_weights_update_group)
    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str, backend: str,
                                  timeout_s: float = 120.0) -> None:
        if group_name in self.groups:
            raise ValueError(f"weight update group {group_name!r} exists; destroy it first")
        try:
            self.groups[group_name] = init_side_group(
                backend=backend, master_address=master_address, master_port=master_port,
                rank=rank_offset, world_size=world_size, group_name=group_name,
                timeout_s=timeout_s)
        except (RuntimeError, ValueError, OSError) as e:  # SGLang's answer names the cause
            raise ValueError(f"Failed to initialize custom process group: {e}.") from e

    def begin_weight_update(self) -> None:
        with self._session_lock:
            if self.session is not None:
                raise ValueError("a weight-update session is already open; "
                                 "call end_weight_update() first")
            self.session = {"loaded_weights": False}

    def end_weight_update(self) -> None:
        with self._session_lock:
            if self.session is None:
                raise ValueError("no weight-update session is open; "
                                 "call begin_weight_update() first")
            self.session = None

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str],
                                        shapes: list[list[int]], group_name: str,
                                        weight_version: str | None = None,
                                        src: int = 0) -> None:
        """Receive one bucket (a broadcast per tensor, in order) and load it. Refused
        outside a session, or for a bucket it cannot receive, before any broadcast is
        joined, so the sender sees the refusal instead of waiting on the group."""
        if self.session is None:
            raise ValueError(OUTSIDE_SESSION)
        group = self.groups.get(group_name)
        if group is None:
            raise ValueError(f"Failed to receive weights: Group {group_name} not in "
                             f"{list(self.groups)}. Please call `init_weights_update_group` first.")
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError("Failed to receive weights: names, dtypes and shapes differ in length")
        bad = [d for d in dtypes if not isinstance(getattr(torch, d, None), torch.dtype)]
        if bad:
            raise ValueError(f"Failed to receive weights: unknown dtypes {bad[:5]}")
        unknown = []
        with self._exclusive():
            try:
                for name, dtype, shape in zip(names, dtypes, shapes):
                    buf = torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)
                    group.broadcast(buf, src=src)  # receive every tensor, even unknown ones,
                    param = self.params.get(name)  # so the group stays in step with the sender
                    if param is None or tuple(param.shape) != tuple(shape):
                        unknown.append(name)
                        continue
                    param.data.copy_(buf)
            except RuntimeError as e:  # the sender left the group or timed out
                raise ValueError(f"Failed to receive weights: {e}") from e
            if unknown:
                raise ValueError(f"Failed to update parameter online: parameters not in this "
                                 f"model or of another shape: {unknown[:5]}")
            if self.session is not None:
                self.session["loaded_weights"] = True
            if weight_version is not None:
                self.weight_version = str(weight_version)

    def destroy_weights_update_group(self, group_name: str) -> None:
        group = self.groups.pop(group_name, None)
        if group is None:
            raise ValueError("The group to be destroyed does not exist.")
        group.destroy()

    def check_weights(self, action: str, skip: list[str] | None = None) -> dict | None:
        """SGLang's ``/weights_checker`` for the two actions the driver uses
        (``utils/weight_checker.py``): ``reset_tensors`` fills every checked tensor with
        random values, ``checksum`` answers one hash per checked tensor and one over all.
        Checked: every parameter and buffer but derived buffers and names containing an
        entry of ``skip``. The hash is SGLang's for CPU tensors (the first 8 bytes of the
        SHA-256 of the tensor's bytes); only equality between two answers of one engine
        means anything."""
        if action not in ("reset_tensors", "checksum"):
            raise ValueError(f"action={action!r} is not supported by the CPU engine "
                             "(it serves checksum and reset_tensors)")

        def check() -> dict[str, str] | None:
            tensors = {n: t for n, t in [*self.model.named_parameters(), *self.model.named_buffers()]
                       if not any(p in n for p in (*UNCHECKED_BUFFERS, *(skip or ())))}
            if action == "reset_tensors":
                for t in tensors.values():
                    noise = (torch.rand(t.shape, generator=self._noise, device=self.device)
                             if t.dtype.is_floating_point else
                             torch.randint(0, 2, t.shape, generator=self._noise, device=self.device))
                    t.data.copy_(noise.to(t.dtype))
                return None
            return {n: hashlib.sha256(t.detach().cpu().contiguous().reshape(-1)
                                      .view(torch.uint8).numpy()).digest()[:8].hex()
                    for n, t in tensors.items()}

        checksums = self._between_steps(check)
        if checksums is None:
            return None
        overall = hashlib.sha256()
        for name in sorted(checksums):
            overall.update(name.encode() + checksums[name].encode())
        return {"checksums": checksums, "per_gpu_checksum": overall.hexdigest(),
                "parallelism_info": [{"role": "target", "tp_rank": 0, "tp_size": 1, "dp_rank": 0,
                                      "dp_size": 1, "pp_rank": 0, "pp_size": 1, "rank": 0,
                                      "size": 1}]}

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """SGLang's semantics (``LlamaForCausalLM.get_weights_by_name``, the reference the
        route's models follow): the parameter's first ``truncate_size`` rows (entries of a
        vector) as float32 values, names as the checkpoint spells them; a tied output layer
        (``lm_head.weight``) reads as the input embedding. ``ValueError`` for an unknown name."""
        # remove_duplicate=False: a tied lm_head.weight is listed beside the embedding it is
        param = dict(self.model.named_parameters(remove_duplicate=False)).get(name)
        if param is None:
            raise ValueError(f"no parameter {name!r}")
        return self._between_steps(lambda: param.detach()[:truncate_size].float().cpu().tolist())



class _Aside:
    """A read or check waiting for a step boundary, run once, by whichever thread takes it."""

    def __init__(self, fn: Callable[[], object]) -> None:
        self.fn, self.done = fn, threading.Event()
        self.value: object = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.value = self.fn()
        except BaseException as e:  # raised again in the thread that asked
            self.error = e
        finally:
            self.done.set()

    def outcome(self) -> object:
        if self.error is not None:
            raise self.error
        return self.value


@dataclass
class _Batch:
    """The requests decoding together, row by row: each one's state, stop tokens, stop
    strings' tail length, attention-mask row (left-padded), last position and last sampled
    token; and their KV cache and sampler. ``states`` are the requests still decoding, unless
    the cache cannot drop rows (``selectable`` False): then finished ones stay, unused."""

    states: list[GenState]
    stops: list[set[int]]
    tails: list[int]
    attn: torch.Tensor
    pos: torch.Tensor
    cache: object
    sampler: BatchSampler
    selectable: bool
    joinable: bool
    tok: torch.Tensor | None = None

    def drop_finished(self, keep: list[int]) -> None:
        """Keep the rows ``keep`` (the requests still decoding), when the cache allows."""
        if not self.selectable:
            return
        idx = torch.tensor(keep, device=self.attn.device)
        self.cache.batch_select_indices(idx)
        self.sampler.select(idx)
        self.attn, self.pos, self.tok = self.attn[idx], self.pos[idx], self.tok[idx]
        self.states, self.stops, self.tails = ([x[i] for i in keep]
                                               for x in (self.states, self.stops, self.tails))
        if self.joinable:  # columns no row attends to any more (left padding of those that left)
            start = int(self.attn.any(dim=0).nonzero()[0])
            if start:
                self.attn = self.attn[:, start:]
                _map_kv(self.cache, lambda kv: kv[..., start:, :])

    def join(self, other: _Batch | None) -> None:
        """Append ``other``'s rows (requests just prefilled, their first token sampled): the
        shorter KV cache and attention mask are left-padded, the padding masked out, so each
        row attends to its own tokens only, as it would alone."""
        if other is None:
            return
        width = max(self.attn.shape[1], other.attn.shape[1])  # what may fail first, then the batch changes
        attn = torch.cat([_pad_left(self.attn, width, dim=1), _pad_left(other.attn, width, dim=1)])
        pos, tok = torch.cat([self.pos, other.pos]), torch.cat([self.tok, other.tok])
        sampler = copy.copy(self.sampler)  # join sets new tensors on it, never changes them in place
        sampler.join(other.sampler)
        _map_kv(self.cache, lambda a, b: torch.cat([_pad_left(a, width, -2), _pad_left(b, width, -2)]),
                other.cache)  # the cache last: it sets its tensors only once every one is made
        self.sampler, self.attn, self.pos, self.tok = sampler, attn, pos, tok
        self.states, self.stops, self.tails = (self.states + other.states, self.stops + other.stops,
                                               self.tails + other.tails)


def _pad_left(x: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """``x`` with zeros before it along ``dim`` up to ``width``."""
    missing = width - x.shape[dim]
    if missing == 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x.new_zeros(shape), x], dim=dim)


def _map_kv(cache, fn, other=None) -> None:
    """Replace each layer's keys and values ``kv`` by ``fn(kv)``, or by ``fn(kv, other's)``;
    every new tensor is made before any is set (transformers before 4.54 keeps them in
    ``key_cache`` and ``value_cache`` lists)."""
    if getattr(cache, "layers", None) is None:
        slots = [(getattr(cache, name), getattr(other, name, None), i)
                 for name in ("key_cache", "value_cache") for i in range(len(cache.key_cache))]
        new = [fn(kvs[i]) if more is None else fn(kvs[i], more[i]) for kvs, more, i in slots]
        for (kvs, _, i), kv in zip(slots, new):
            kvs[i] = kv
        if hasattr(cache, "_seen_tokens"):
            cache._seen_tokens = cache.key_cache[0].shape[-2]
        return
    slots = [(layer, name, getattr(other.layers[i], name) if other is not None else None)
             for i, layer in enumerate(cache.layers) for name in ("keys", "values")]
    new = [fn(getattr(layer, name)) if more is None else fn(getattr(layer, name), more)
           for layer, name, more in slots]
    for (layer, name, _), kv in zip(slots, new):
        setattr(layer, name, kv)


def _rows_joinable(cache) -> bool:
    """Whether requests can join a running batch: a KV cache of full-attention layers only
    (keys and values along the whole sequence, which ``_Batch.join`` pads); a sliding-window
    or recurrent layer's state is not padded so simply."""
    layers = getattr(cache, "layers", None)
    if layers is None:  # transformers before 4.54: key_cache and value_cache lists, empty for a skipped layer
        return type(cache).__name__ == "DynamicCache" and all(
            k.dim() == 4 and k.numel() for k in (*cache.key_cache, *cache.value_cache))
    return all(type(layer).__name__ == "DynamicLayer" and getattr(layer, "keys", None) is not None
               and layer.keys.dim() == 4 for layer in layers)


def _rows_selectable(cache) -> bool:
    """Whether finished requests can leave the batch: a KV cache of plain attention layers,
    whose rows ``batch_select_indices`` keeps (transformers' linear-attention layers of hybrid
    models have recurrent state it does not select); otherwise their rows decode on, unused."""
    layers = getattr(cache, "layers", None)
    if layers is None:  # transformers before 4.54: key_cache and value_cache lists
        return type(cache).__name__ == "DynamicCache"
    return all(type(layer).__name__ in ("DynamicLayer", "DynamicSlidingWindowLayer") for layer in layers)


def _cache_of(out):
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values
