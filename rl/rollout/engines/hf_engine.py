"""The CPU engine's core: batched sampling with log-probs and in-place weight updates.

No HTTP here (see ``hf_server``), so it is testable directly. Semantics follow SGLang:
the returned log-prob of a token is its log-probability under the temperature-scaled
distribution (before top-p/top-k filtering); with temperature 0 (greedy) it is the
unscaled log-probability. Generation stops at the first end-of-sequence token, which is
returned as the last output id.
"""

from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass, field

import torch

from transfer.weights.group import SideGroup, init_side_group


@dataclass
class GenRequest:
    input_ids: list[int]
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False


@dataclass
class GenResult:
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: dict
    weight_version: str


class HFEngine:
    def __init__(self, model, tokenizer, eos_ids: list[int], *, seed: int = 0,
                 weight_version: str = "default", device: str = "cpu") -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.eos_ids = list(eos_ids)
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.weight_version = weight_version
        self.lock = threading.Lock()  # a batch and a weight update never overlap
        self.groups: dict[str, SideGroup] = {}
        self.params = dict(model.named_parameters())
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
        width = max(len(r.input_ids) for r in reqs)
        ids = torch.full((B, width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((B, width), dtype=torch.long)
        for i, r in enumerate(reqs):  # left padding: the last column is every prompt's end
            ids[i, width - len(r.input_ids):] = torch.tensor(r.input_ids)
            attn[i, width - len(r.input_ids):] = 1
        ids, attn = ids.to(dev), attn.to(dev)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        temps = torch.tensor([r.temperature for r in reqs], dtype=torch.float32, device=dev)
        stops = [set(r.stop_token_ids) | (set() if r.ignore_eos else set(self.eos_ids)) for r in reqs]
        limits = [r.max_new_tokens for r in reqs]

        out_ids: list[list[int]] = [[] for _ in reqs]
        out_lp: list[list[float]] = [[] for _ in reqs]
        reasons: list[dict | None] = [None] * B
        out = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True)
        cache = _cache_of(out)
        for step in range(max(limits)):
            tok, logp = self._sample(out.logits[:, -1, :], temps, reqs)
            tok_l, logp_l = tok.tolist(), logp.tolist()
            for i in range(B):
                if reasons[i] is not None:
                    continue
                out_ids[i].append(tok_l[i])
                out_lp[i].append(logp_l[i])
                if tok_l[i] in stops[i]:
                    reasons[i] = {"type": "stop", "matched": tok_l[i]}
                elif len(out_ids[i]) >= limits[i]:
                    reasons[i] = {"type": "length", "length": limits[i]}
            if all(r is not None for r in reasons):
                break
            attn = torch.cat([attn, attn.new_ones((B, 1))], dim=1)
            pos = pos[:, -1:] + 1
            out = self.model(input_ids=tok[:, None], attention_mask=attn, position_ids=pos,
                             use_cache=True, **{self._cache_arg: cache})
            cache = _cache_of(out)
        return [GenResult(out_ids[i], out_lp[i], reasons[i], self.weight_version) for i in range(B)]

    def _sample(self, logits_bv: torch.Tensor, temps_b: torch.Tensor,
                reqs: list[GenRequest]) -> tuple[torch.Tensor, torch.Tensor]:
        logits_bv = logits_bv.float()
        greedy_b = temps_b == 0
        scaled_bv = logits_bv / torch.where(greedy_b, 1.0, temps_b)[:, None]
        logp_bv = torch.log_softmax(scaled_bv, dim=-1)
        filtered_bv = _top_k_top_p(scaled_bv, [r.top_k for r in reqs], [r.top_p for r in reqs])
        probs_bv = torch.softmax(filtered_bv, dim=-1)
        tok_b = torch.multinomial(probs_bv, 1, generator=self.generator).squeeze(1)
        tok_b = torch.where(greedy_b, logits_bv.argmax(-1), tok_b)
        return tok_b, logp_bv.gather(1, tok_b[:, None]).squeeze(1)

    # -- weight updates (SGLang's init_weights_update_group / update_weights_from_distributed)
    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str, backend: str,
                                  timeout_s: float = 120.0) -> None:
        if group_name in self.groups:
            raise ValueError(f"weight update group {group_name!r} exists; destroy it first")
        self.groups[group_name] = init_side_group(
            backend=backend, master_address=master_address, master_port=master_port,
            rank=rank_offset, world_size=world_size, group_name=group_name, timeout_s=timeout_s)

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str],
                                        shapes: list[list[int]], group_name: str,
                                        weight_version: str | None = None,
                                        src: int = 0) -> None:
        group = self.groups.get(group_name)
        if group is None:
            raise ValueError(f"no weight update group {group_name!r}; call init_weights_update_group")
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError("names, dtypes and shapes differ in length")
        unknown = []
        with self.lock:
            for name, dtype, shape in zip(names, dtypes, shapes):
                buf = torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)
                group.broadcast(buf, src=src)  # receive every tensor, even unknown ones,
                param = self.params.get(name)  # so the group stays in step with the sender
                if param is None or tuple(param.shape) != tuple(shape):
                    unknown.append(name)
                    continue
                param.data.copy_(buf)
            if unknown:
                raise ValueError(f"parameters not in this model or of another shape: {unknown[:5]}")
            if weight_version is not None:
                self.weight_version = str(weight_version)

    def destroy_weights_update_group(self, group_name: str) -> None:
        group = self.groups.pop(group_name, None)
        if group is None:
            raise ValueError(f"no weight update group {group_name!r}")
        group.destroy()

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        param = self.params.get(name)
        if param is None:
            raise ValueError(f"no parameter {name!r}")
        with self.lock:
            return param.detach()[:truncate_size].float().cpu().tolist()


def _cache_of(out):
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def _top_k_top_p(logits_bv: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    if all(k <= 0 for k in top_k) and all(p >= 1.0 for p in top_p):
        return logits_bv
    sorted_bv, idx_bv = logits_bv.sort(dim=-1, descending=True)
    ranks_v = torch.arange(logits_bv.shape[-1], device=logits_bv.device)
    k_b = torch.tensor([k if k > 0 else logits_bv.shape[-1] for k in top_k], device=logits_bv.device)
    p_b = torch.tensor(top_p, device=logits_bv.device, dtype=torch.float32)
    probs_bv = sorted_bv.softmax(-1)
    mass_before_bv = probs_bv.cumsum(-1) - probs_bv  # keep a token while the mass before it < p
    drop_bv = (ranks_v[None, :] >= k_b[:, None]) | (mass_before_bv >= p_b[:, None])
    sorted_bv = sorted_bv.masked_fill(drop_bv, float("-inf"))
    return torch.full_like(logits_bv, float("-inf")).scatter(-1, idx_bv, sorted_bv)
