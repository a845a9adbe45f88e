"""The CPU engine's core: batched sampling with log-probs and in-place weight updates.

No HTTP here (see ``hf_server``), so it is testable directly. Sampling and stopping follow
SGLang 0.5.23 (``sampling`` holds the parameters and the sampler): a sequence ends at the
first stop string found in its decoded tail, else at a stop token (EOS or
``stop_token_ids``, none with ``ignore_eos``), which is returned as the last output id,
else at ``max_new_tokens``. Weight updates follow SGLang's session rules
(``scheduler_components/weight_updater.py``): ``update_weights_from_distributed`` runs only
between ``begin_weight_update`` and ``end_weight_update``, and refuses before receiving.
"""

from __future__ import annotations

import hashlib
import inspect
import threading
from dataclasses import dataclass

import torch

from rl.rollout.engines.sampling import BatchSampler, GenRequest
from transfer.weights.group import SideGroup, init_side_group

__all__ = ["GenRequest", "GenResult", "HFEngine"]

UNCHECKED_BUFFERS = ("cos_sin_cache", "cos_cache", "sin_cache", "inv_freq", "freqs_cis",
                     "expert_mask_gpu")
"""Name parts of the buffers SGLang's weight checker leaves alone (derived, not loaded)."""

OUTSIDE_SESSION = ("update_weights_from_distributed must run between begin_weight_update() "
                   "and end_weight_update()")


@dataclass
class GenResult:
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: dict
    weight_version: str
    text: str = ""
    """The decoded output, trimmed at the matched stop as SGLang's detokenizer does."""


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
    @torch.no_grad()
    def generate(self, reqs: list[GenRequest]) -> list[GenResult]:
        with self.lock:
            return self._generate(reqs)

    def _generate(self, reqs: list[GenRequest]) -> list[GenResult]:
        dev, B = self.device, len(reqs)
        limits = [r.max_new_tokens for r in reqs]
        out_ids: list[list[int]] = [[] for _ in reqs]
        out_lp: list[list[float]] = [[] for _ in reqs]
        reasons: list[dict | None] = [{"type": "length", "length": 0} if n <= 0 else None
                                      for n in limits]
        if all(r is not None for r in reasons):  # max_new_tokens=0 everywhere: nothing to run
            return [self._result(r, [], [], {"type": "length", "length": 0}) for r in reqs]
        width = max(len(r.input_ids) for r in reqs)
        ids = torch.full((B, width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((B, width), dtype=torch.long)
        for i, r in enumerate(reqs):  # left padding: the last column is every prompt's end
            ids[i, width - len(r.input_ids):] = torch.tensor(r.input_ids)
            attn[i, width - len(r.input_ids):] = 1
        ids, attn = ids.to(dev), attn.to(dev)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        stops = [set() if r.ignore_eos else set(r.stop_token_ids) | set(self.eos_ids) for r in reqs]
        tails = [self._tail_len(r.stop) for r in reqs]

        out = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True)
        cache = _cache_of(out)
        sampler = BatchSampler(reqs, self.eos_ids, out.logits.shape[-1], dev, self.generator)
        for _ in range(max(limits)):
            tok, logp = sampler.sample(out.logits[:, -1, :])
            sampler.record(tok)
            tok_l, logp_l = tok.tolist(), logp.tolist()
            for i in range(B):
                if reasons[i] is not None:
                    continue
                out_ids[i].append(tok_l[i])
                out_lp[i].append(logp_l[i])
                reasons[i] = self._finished(reqs[i], out_ids[i], stops[i], tails[i])
            if all(r is not None for r in reasons):
                break
            attn = torch.cat([attn, attn.new_ones((B, 1))], dim=1)
            pos = pos[:, -1:] + 1
            out = self.model(input_ids=tok[:, None], attention_mask=attn, position_ids=pos,
                             use_cache=True, **{self._cache_arg: cache})
            cache = _cache_of(out)
        return [self._result(reqs[i], out_ids[i], out_lp[i], reasons[i]) for i in range(B)]

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

    def _result(self, req: GenRequest, ids: list[int], logprobs: list[float],
                reason: dict) -> GenResult:
        """The answer, with text as SGLang's detokenizer makes it: a matched stop token is
        left out of the text, and the text ends before a matched stop string."""
        matched = reason.get("matched")
        text_ids = ids[:-1] if isinstance(matched, int) else ids
        text = self.tokenizer.decode(
            text_ids, skip_special_tokens=req.skip_special_tokens,
            spaces_between_special_tokens=req.spaces_between_special_tokens)
        if isinstance(matched, str) and (pos := text.find(matched)) != -1:
            text = text[:pos]
        return GenResult(ids, logprobs, reason, self.weight_version, text)

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
        with self.lock:
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
        with self.lock:
            tensors = {n: t for n, t in [*self.model.named_parameters(), *self.model.named_buffers()]
                       if not any(p in n for p in (*UNCHECKED_BUFFERS, *(skip or ())))}
            if action == "reset_tensors":
                for t in tensors.values():
                    noise = (torch.rand(t.shape, generator=self._noise, device=self.device)
                             if t.dtype.is_floating_point else
                             torch.randint(0, 2, t.shape, generator=self._noise, device=self.device))
                    t.data.copy_(noise.to(t.dtype))
                return None
            if action != "checksum":
                raise ValueError(f"action={action!r} is not supported by the CPU engine "
                                 "(it serves checksum and reset_tensors)")
            checksums = {n: hashlib.sha256(t.detach().cpu().contiguous().reshape(-1)
                                           .view(torch.uint8).numpy()).digest()[:8].hex()
                         for n, t in tensors.items()}
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
        with self.lock:
            return param.detach()[:truncate_size].float().cpu().tolist()


def _cache_of(out):
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values
