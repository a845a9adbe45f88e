"""SGLang's sampling parameters for the CPU engine: parsing, and the sampler of one batch.

Parsing follows SGLang 0.5.23: the JSON schema of ``sglang.api.v1.api_types.SamplingParams``
(field types, defaults, unknown keys refused), then ``SamplingParams.__post_init__`` and
``verify`` in ``srt/sampling/sampling_params.py`` (temperature below 1e-6 means greedy; top_k
-1 and 2**30 both mean off; the same range checks and messages). A field the engine cannot
honour (grammars, stop_regex, beam search, watermark, choice, custom_params) is refused when
set, naming it; ``stream_interval`` only shapes streaming and is ignored.

Sampling follows ``srt/layers/sampler.py`` and ``srt/sampling/penaltylib`` (overlap schedule):
each step the logits get the additive penalties (frequency, presence, and min_new_tokens'
ban on stop tokens), then the repetition penalty, then ``logit_bias``, all counted over the
output so far (not the prompt); then they are divided by the temperature. The returned
log-prob of a token is its log-probability under that distribution, before top-k, top-p and
min-p filtering; greedy (temperature 0) returns the unscaled log-probability of the argmax.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

TOP_K_ALL = 1 << 30  # SGLang's "whole vocabulary"
_SAMPLING_EPS = 1e-6
MAX_STOP_COUNT = 32
_F32_MAX = torch.finfo(torch.float32).max


class RequestError(ValueError):
    """A request the engine refuses (HTTP 400); the message names the field at fault."""


@dataclass
class GenRequest:
    """One sequence to generate: its prompt and the sampling parameters the engine honours
    (SGLang's meaning for each; ``temperature`` 0 is greedy, ``top_k`` -1 is off)."""

    input_ids: list[int]
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    """Stop strings, matched in the decoded output."""
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    """No token-based stop at all (EOS nor ``stop_token_ids``), as in SGLang."""
    logit_bias: dict[int, float] = field(default_factory=dict)
    sampling_seed: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False


# -- parsing -----------------------------------------------------------------------------
def _unexpected(v: Any) -> str:
    """serde's wording for a value, as SGLang's schema errors print it."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"boolean `{'true' if v else 'false'}`"
    if isinstance(v, int):
        return f"integer `{v}`"
    if isinstance(v, float):
        return f"floating point `{v}`"
    if isinstance(v, str):
        return f'string "{v}"'
    return "sequence" if isinstance(v, list) else "map" if isinstance(v, dict) else type(v).__name__


def type_error(where: str, v: Any, expected: str) -> RequestError:
    return RequestError(f"{where}: invalid type: {_unexpected(v)}, expected {expected}")


def as_int(where: str, v: Any) -> int:
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    raise type_error(where, v, "i64")


def as_float(where: str, v: Any) -> float:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    raise type_error(where, v, "f64")


def as_bool(where: str, v: Any) -> bool:
    if isinstance(v, bool):
        return v
    raise type_error(where, v, "a boolean")


def as_str(where: str, v: Any) -> str:
    if isinstance(v, str):
        return v
    raise type_error(where, v, "a string")


def as_list(where: str, v: Any, item) -> list:
    if not isinstance(v, list):
        raise type_error(where, v, "a sequence")
    return [item(f"{where}[{i}]", e) for i, e in enumerate(v)]


def as_str_or_list(where: str, v: Any) -> str | list[str]:
    return as_list(where, v, as_str) if isinstance(v, list) else as_str(where, v)


def _as_map(where: str, v: Any) -> dict:
    if isinstance(v, dict):
        return v
    raise type_error(where, v, "a map")


def _as_float_map(where: str, v: Any) -> dict[str, float]:
    return {k: as_float(f"{where}.{k}", e) for k, e in _as_map(where, v).items()}


def _as_watermark(where: str, v: Any) -> dict:
    kinds = {"enabled": as_bool, "key": as_str, "context_window": as_int}
    m = _as_map(where, v)
    for k, e in m.items():
        if k not in kinds:
            raise _unknown_field(where, k, tuple(kinds))
        if e is not None:
            kinds[k](f"{where}.{k}", e)
    return m


# name -> (decoder, value when absent, value when null), as api_types.SamplingParams
SAMPLING_FIELDS: dict[str, tuple[Any, Any, Any]] = {
    "max_new_tokens": (as_int, 128, None), "stop": (as_str_or_list, None, None),
    "stop_token_ids": (lambda w, v: as_list(w, v, as_int), None, None),
    "stop_regex": (as_str_or_list, None, None), "temperature": (as_float, 1.0, 1.0),
    "top_p": (as_float, 1.0, 1.0), "top_k": (as_int, TOP_K_ALL, TOP_K_ALL),
    "min_p": (as_float, 0.0, 0.0), "frequency_penalty": (as_float, 0.0, 0.0),
    "presence_penalty": (as_float, 0.0, 0.0), "repetition_penalty": (as_float, 1.0, 1.0),
    "min_new_tokens": (as_int, 0, 0), "n": (as_int, 1, 1), "json_schema": (as_str, None, None),
    "regex": (as_str, None, None), "ebnf": (as_str, None, None),
    "structural_tag": (as_str, None, None), "ignore_eos": (as_bool, False, False),
    "skip_special_tokens": (as_bool, True, True),
    "spaces_between_special_tokens": (as_bool, True, True),
    "no_stop_trim": (as_bool, False, False), "stream_interval": (as_int, None, None),
    "logit_bias": (_as_float_map, {}, {}), "sampling_seed": (as_int, None, None),
    "custom_params": (lambda w, v: v, None, None), "beam_width": (as_int, None, None),
    "watermark": (_as_watermark, None, None),
    "choice": (lambda w, v: as_list(w, v, as_str), [], []),
}

# Refused when set (each test says what "set" means): the engine would otherwise ignore them.
_REFUSED = {
    "json_schema": bool, "regex": bool, "ebnf": bool, "structural_tag": bool,  # "" = unset
    "stop_regex": lambda v: v is not None and v != [],
    "beam_width": lambda v: v is not None and v > 1,
    "watermark": lambda v: v is not None and v.get("enabled") is not False,
    "choice": bool, "custom_params": lambda v: v is not None,
}


def _unknown_field(where: str, key: str, fields: tuple[str, ...]) -> RequestError:
    listed = ", ".join(f"`{f}`" for f in fields)
    return RequestError(f"{where}: unknown field `{key}`, expected one of {listed}")


def parse_sampling_params(raw: Any, vocab_size: int,
                          where: str = "sampling_params") -> tuple[dict[str, Any], int]:
    """``(GenRequest keyword arguments, n)`` from one JSON ``sampling_params`` object.
    ``max_new_tokens`` may come back None (SGLang then runs to the context length)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise type_error(where, raw, "struct SamplingParams")
    for key in raw:
        if key not in SAMPLING_FIELDS:
            raise _unknown_field(where, key, tuple(SAMPLING_FIELDS))
    p = {}
    for name, (decode, absent, null) in SAMPLING_FIELDS.items():
        v = raw.get(name)
        p[name] = absent if name not in raw else null if v is None else decode(f"{where}.{name}", v)
    for name, is_set in _REFUSED.items():
        if is_set(p[name]):
            raise RequestError(f"{where}.{name} is not supported by the CPU engine "
                               f"(got {p[name]!r}); leave it unset")
    # SamplingParams.__post_init__
    temperature, top_k = p["temperature"], p["top_k"]
    if 0 <= temperature < _SAMPLING_EPS:
        temperature, top_k = 0.0, 1  # greedy
    if top_k == -1:
        top_k = TOP_K_ALL
    _verify(p, temperature, top_k, vocab_size)
    stop = p["stop"]
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if len(stop) > MAX_STOP_COUNT:
        raise RequestError(f"at most {MAX_STOP_COUNT} stop strings are allowed, got {len(stop)}")
    return dict(
        max_new_tokens=p["max_new_tokens"], temperature=temperature, top_p=p["top_p"],
        top_k=-1 if top_k >= TOP_K_ALL else top_k, min_p=p["min_p"],
        frequency_penalty=p["frequency_penalty"], presence_penalty=p["presence_penalty"],
        repetition_penalty=p["repetition_penalty"], min_new_tokens=p["min_new_tokens"],
        stop=stop, stop_token_ids=sorted(set(p["stop_token_ids"] or [])),
        ignore_eos=p["ignore_eos"], logit_bias={int(k): v for k, v in p["logit_bias"].items()},
        sampling_seed=p["sampling_seed"], skip_special_tokens=p["skip_special_tokens"],
        spaces_between_special_tokens=p["spaces_between_special_tokens"],
        no_stop_trim=p["no_stop_trim"]), p["n"]


def _verify(p: dict, temperature: float, top_k: int, vocab_size: int) -> None:
    """SGLang's ``SamplingParams.verify``, with its messages (each names its field)."""
    checks = [
        (p["beam_width"] is None or p["beam_width"] >= 1,
         f"beam_width must be at least 1, got {p['beam_width']}."),
        (math.isfinite(temperature) and temperature >= 0.0,
         f"temperature must be a non-negative finite number, got {temperature}."),
        (0.0 < p["top_p"] <= 1.0, f"top_p must be in (0, 1], got {p['top_p']}."),
        (0.0 <= p["min_p"] <= 1.0, f"min_p must be in [0, 1], got {p['min_p']}."),
        (top_k >= 1, f"top_k must be -1 (disable) or at least 1, got {top_k}."),
        (-2.0 <= p["frequency_penalty"] <= 2.0,
         f"frequency_penalty must be in [-2, 2], got {p['frequency_penalty']}."),
        (-2.0 <= p["presence_penalty"] <= 2.0,
         f"presence_penalty must be in [-2, 2], got {p['presence_penalty']}."),
        (0.0 < p["repetition_penalty"] <= 2.0, "repetition_penalty must be in (0, 2] (1.0 = no "
                                               f"penalty), got {p['repetition_penalty']}."),
        (p["min_new_tokens"] >= 0,
         f"min_new_tokens must be in [0, max_new_tokens], got {p['min_new_tokens']}."),
        (p["n"] >= 1, f"n must be at least 1, got {p['n']}."),
        (p["sampling_seed"] is None or -(2**63) <= p["sampling_seed"] <= 2**63 - 1,
         f"sampling_seed must be in [-2**63, 2**63 - 1], got {p['sampling_seed']}."),
    ]
    max_new = p["max_new_tokens"]
    if max_new is not None:
        checks += [(max_new >= 0, f"max_new_tokens must be at least 0, got {max_new}."),
                   (p["min_new_tokens"] <= max_new, f"min_new_tokens must be in [0, max_new_tokens"
                                                    f"({max_new})], got {p['min_new_tokens']}.")]
    for ok, message in checks:
        if not ok:
            raise RequestError(message)
    for key in p["logit_bias"]:
        try:
            token = int(key)
        except ValueError:
            token = None
        if token is None or not 0 <= token < vocab_size:
            raise RequestError(f"logit_bias must has keys in [0, {vocab_size - 1}], got {key}.")
        if not abs(p["logit_bias"][key]) <= _F32_MAX:  # inf/NaN would turn a whole row to NaN
            raise RequestError(f"logit_bias[{key}] must be a finite float32, got {p['logit_bias'][key]}.")


# -- sampling ----------------------------------------------------------------------------
class BatchSampler:
    """Samples the next token of every row of one batch; holds the penalties' running state.

    Each step: ``tok_b, logp_b = sample(logits_bv)``, then ``record(tok_b)``. Work for a
    feature is done only when some row uses it, so a batch of plain requests samples exactly
    as before penalties existed.
    """

    def __init__(self, reqs: list[GenRequest], eos_ids: list[int], vocab_size: int,
                 device: torch.device, generator: torch.Generator) -> None:
        B, V, dev = len(reqs), vocab_size, device
        self.generator = generator
        self.temps_b = torch.tensor([r.temperature for r in reqs], dtype=torch.float32, device=dev)
        self.greedy_b = self.temps_b == 0
        self.top_k = [r.top_k for r in reqs]
        self.top_p = [r.top_p for r in reqs]
        self.min_p_b = _column([r.min_p for r in reqs], 0.0, dev)
        self.freq_b = _column([r.frequency_penalty for r in reqs], 0.0, dev)
        self.pres_b = _column([r.presence_penalty for r in reqs], 0.0, dev)
        self.rep_b = _column([r.repetition_penalty for r in reqs], 1.0, dev)
        self.min_new_b = _column([float(r.min_new_tokens) for r in reqs], 0.0, dev)
        zeros = lambda: torch.zeros((B, V), dtype=torch.float32, device=dev)  # noqa: E731
        self.freq_acc_bv = zeros() if self.freq_b is not None else None
        self.pres_acc_bv = zeros() if self.pres_b is not None else None
        self.rep_acc_bv = zeros().fill_(1.0) if self.rep_b is not None else None
        self.stop_ban_bv = None
        if self.min_new_b is not None:  # -inf on every token that would end the sequence
            self.stop_ban_bv = zeros()
            for i, r in enumerate(reqs):
                banned = [t for t in set(r.stop_token_ids) | set(eos_ids) if 0 <= t < V]
                self.stop_ban_bv[i, banned] = float("-inf")
        self.bias_bv = None
        if any(r.logit_bias for r in reqs):
            self.bias_bv = zeros()
            for i, r in enumerate(reqs):
                for token, value in r.logit_bias.items():
                    if token < V:  # the model's logits can be narrower than its vocab_size
                        self.bias_bv[i, token] = value
        self.adjusting = any(x is not None for x in (self.freq_b, self.pres_b, self.rep_b,
                                                     self.min_new_b, self.bias_bv))
        self.seeded = [(i, torch.Generator(device=dev).manual_seed(r.sampling_seed))
                       for i, r in enumerate(reqs) if r.sampling_seed is not None]
        self.steps = 0  # tokens generated so far by every row

    def adjust(self, logits_bv: torch.Tensor) -> torch.Tensor:
        """Penalties and bias on float32 logits, in SGLang's order (a new tensor)."""
        if self.freq_b is not None or self.pres_b is not None or self.min_new_b is not None:
            additive_bv = torch.zeros_like(logits_bv)
            if self.freq_acc_bv is not None:
                additive_bv -= self.freq_acc_bv
            if self.pres_acc_bv is not None:
                additive_bv -= self.pres_acc_bv
            if self.stop_ban_bv is not None:
                banning_b1 = self.steps < self.min_new_b
                additive_bv += torch.where(banning_b1, self.stop_ban_bv, 0.0)
            logits_bv = logits_bv + additive_bv
        if self.rep_acc_bv is not None:
            logits_bv = torch.where(logits_bv < 0, logits_bv * self.rep_acc_bv,
                                    logits_bv / self.rep_acc_bv)
        if self.bias_bv is not None:
            logits_bv = logits_bv + self.bias_bv
        return logits_bv

    def sample(self, logits_bv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (token_b, logprob_b) for the last position's logits of every row."""
        logits_bv = logits_bv.float()
        if self.adjusting:
            logits_bv = self.adjust(logits_bv)
        greedy_b = self.greedy_b
        scaled_bv = logits_bv / torch.where(greedy_b, 1.0, self.temps_b)[:, None]
        if self.adjusting:  # a tiny repetition penalty or temperature can overflow to inf
            scaled_bv = scaled_bv.nan_to_num(nan=float("-inf"), posinf=_F32_MAX,
                                             neginf=float("-inf"))
        logp_bv = torch.log_softmax(scaled_bv, dim=-1)
        filtered_bv = _top_k_top_p(scaled_bv, self.top_k, self.top_p)
        if self.min_p_b is not None:  # keep tokens at least min_p times the likeliest one
            probs_bv = logp_bv.exp()
            floor_b1 = probs_bv.max(dim=-1, keepdim=True).values * self.min_p_b
            filtered_bv = filtered_bv.masked_fill(probs_bv < floor_b1, float("-inf"))
        probs_bv = torch.softmax(filtered_bv, dim=-1)
        tok_b = torch.multinomial(probs_bv, 1, generator=self.generator).squeeze(1)
        for i, gen in self.seeded:  # rows with sampling_seed draw from their own stream
            tok_b[i] = torch.multinomial(probs_bv[i], 1, generator=gen)[0]
        tok_b = torch.where(greedy_b, logits_bv.argmax(-1), tok_b)
        return tok_b, logp_bv.gather(1, tok_b[:, None]).squeeze(1)

    def record(self, tok_b: torch.Tensor) -> None:
        """Count the tokens just generated (SGLang's ``cumulate_output_tokens``)."""
        idx_b1 = tok_b[:, None]
        if self.freq_acc_bv is not None:
            self.freq_acc_bv.scatter_add_(1, idx_b1, self.freq_b)
        if self.pres_acc_bv is not None:
            self.pres_acc_bv.scatter_(1, idx_b1, self.pres_b)
        if self.rep_acc_bv is not None:
            self.rep_acc_bv.scatter_(1, idx_b1, self.rep_b)
        self.steps += 1


def _column(values: list[float], neutral: float, device: torch.device) -> torch.Tensor | None:
    """``values`` as a (B, 1) float32 column, or None when every row has the neutral value."""
    if all(v == neutral for v in values):
        return None
    return torch.tensor(values, dtype=torch.float32, device=device)[:, None]


def _top_k_top_p(logits_bv: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    V = logits_bv.shape[-1]
    if all(k <= 0 or k >= V for k in top_k) and all(p >= 1.0 for p in top_p):
        return logits_bv
    sorted_bv, idx_bv = logits_bv.sort(dim=-1, descending=True)
    ranks_v = torch.arange(V, device=logits_bv.device)
    k_b = torch.tensor([k if k > 0 else V for k in top_k], device=logits_bv.device)
    p_b = torch.tensor(top_p, device=logits_bv.device, dtype=torch.float32)
    probs_bv = sorted_bv.softmax(-1)
    mass_before_bv = probs_bv.cumsum(-1) - probs_bv  # keep a token while the mass before it < p
    drop_bv = (ranks_v[None, :] >= k_b[:, None]) | (mass_before_bv >= p_b[:, None])
    sorted_bv = sorted_bv.masked_fill(drop_bv, float("-inf"))
    return torch.full_like(logits_bv, float("-inf")).scatter(-1, idx_bv, sorted_bv)
