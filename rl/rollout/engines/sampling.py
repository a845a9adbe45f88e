"""The sampling parameters the CPU engine serves, and the sampler of one batch.

Served (SGLang 0.5.23's names, defaults and meaning, ``srt/sampling/sampling_params.py``):
the fields our rollout sends and those SGLang's frontend (``sglang.lang``'s
``RuntimeEndpoint``) sends, ``SERVED`` below. Temperature below 1e-6 means greedy; top_k -1
and 2**30 both mean off; out-of-range values are refused, naming the field. Any other field
is refused unless it is null, false or empty (what leaving it out means): ``check_served``.

Sampling follows ``srt/layers/sampler.py`` and ``srt/sampling/penaltylib``: each step the
logits get the frequency and presence penalties (counted over the output so far, not the
prompt) and min_new_tokens' ban on stop tokens, then are divided by the temperature. The
returned log-prob of a token is its log-probability under that distribution, before top-k,
top-p and min-p filtering; greedy (temperature 0) returns the unscaled log-probability of
the argmax.
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
    """Bad input (HTTP 400 in the server's one refusal shape); the message names the field."""


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
    min_new_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    """Stop strings, matched in the decoded output."""
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    """No token-based stop at all (EOS nor ``stop_token_ids``), as in SGLang."""
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True


# -- parsing -----------------------------------------------------------------------------
def _type_error(where: str, v: Any, expected: str) -> RequestError:
    return RequestError(f"{where}: expected {expected}, got {type(v).__name__} {v!r}")


def as_int(where: str, v: Any) -> int:
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    raise _type_error(where, v, "an integer")


def as_float(where: str, v: Any) -> float:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    raise _type_error(where, v, "a number")


def as_bool(where: str, v: Any) -> bool:
    if isinstance(v, bool):
        return v
    raise _type_error(where, v, "a boolean")


def as_str(where: str, v: Any) -> str:
    if isinstance(v, str):
        return v
    raise _type_error(where, v, "a string")


def list_of(item):
    """A check for a list whose entries pass ``item``."""
    def check(where: str, v: Any) -> list:
        if not isinstance(v, list):
            raise _type_error(where, v, "a list")
        return [item(f"{where}[{i}]", e) for i, e in enumerate(v)]
    return check


def str_or_list(where: str, v: Any) -> list[str]:
    return list_of(as_str)(where, v) if isinstance(v, list) else [as_str(where, v)]


def unset(v: Any) -> bool:
    """What leaving a field out means: null, false or empty."""
    return v is None or v is False or (isinstance(v, (list, dict, str)) and not v)


def check_served(where: str, body: dict, served) -> None:
    """Refuse a field of ``body`` outside ``served`` unless it is unset. Every route checks
    its body with this, so each refusal reads the same and names what is served."""
    for key, value in body.items():
        if key not in served and not unset(value):
            prefix = f"{where}." if where else ""
            raise RequestError(f"the CPU engine does not serve {prefix}{key}; it serves: "
                               f"{', '.join(sorted(served))}")


REQUIRED = object()


def read_fields(where: str, body: Any, spec: dict[str, tuple]) -> dict[str, Any]:
    """``body`` (a JSON object or null) checked against ``spec``, ``{name: (check, default)}``
    (default ``REQUIRED``: the field must be given): every field of ``spec``, null taken as
    left out; any other field refused unless unset."""
    if body is None:
        body = {}
    if not isinstance(body, dict):
        raise _type_error(where or "the request body", body, "a JSON object")
    check_served(where, body, spec)
    out = {}
    for name, (check, default) in spec.items():
        v = body.get(name)
        if v is None and default is REQUIRED:
            raise RequestError(f"{where + '.' if where else ''}{name} is required")
        out[name] = default if v is None else check(f"{where + '.' if where else ''}{name}", v)
    return out


SERVED: dict[str, tuple] = {
    "max_new_tokens": (as_int, 128), "min_new_tokens": (as_int, 0), "n": (as_int, 1),
    "stop": (str_or_list, []), "stop_token_ids": (list_of(as_int), []),
    "temperature": (as_float, 1.0), "top_p": (as_float, 1.0), "top_k": (as_int, TOP_K_ALL),
    "min_p": (as_float, 0.0), "frequency_penalty": (as_float, 0.0),
    "presence_penalty": (as_float, 0.0), "ignore_eos": (as_bool, False),
    "skip_special_tokens": (as_bool, True), "spaces_between_special_tokens": (as_bool, True),
}
"""The sampling fields served: name -> (check, SGLang's default). Null is the default."""


def parse_sampling_params(raw: Any) -> tuple[dict[str, Any], int]:
    """``(GenRequest keyword arguments, n)`` from one JSON ``sampling_params`` object."""
    p = read_fields("sampling_params", raw, SERVED)
    to_context = isinstance(raw, dict) and "max_new_tokens" in raw and raw["max_new_tokens"] is None
    temperature, top_k = p.pop("temperature"), p.pop("top_k")
    if 0 <= temperature < _SAMPLING_EPS:  # SamplingParams.__post_init__
        temperature, top_k = 0.0, 1  # greedy
    if top_k == -1:
        top_k = TOP_K_ALL
    n = p.pop("n")
    checks = [  # SamplingParams.verify's ranges
        (math.isfinite(temperature) and temperature >= 0.0, "temperature", ">= 0 and finite"),
        (0.0 < p["top_p"] <= 1.0, "top_p", "in (0, 1]"),
        (0.0 <= p["min_p"] <= 1.0, "min_p", "in [0, 1]"),
        (top_k >= 1, "top_k", "-1 (off) or at least 1"),
        (-2.0 <= p["frequency_penalty"] <= 2.0, "frequency_penalty", "in [-2, 2]"),
        (-2.0 <= p["presence_penalty"] <= 2.0, "presence_penalty", "in [-2, 2]"),
        (p["max_new_tokens"] >= 0, "max_new_tokens", "at least 0"),
        # a null max_new_tokens (run to the context length) bounds nothing here, as on SGLang
        (0 <= p["min_new_tokens"] and (to_context or p["min_new_tokens"] <= p["max_new_tokens"]),
         "min_new_tokens", "in [0, max_new_tokens]"),
        (n >= 1, "n", "at least 1"),
        (len(p["stop"]) <= MAX_STOP_COUNT, "stop", f"at most {MAX_STOP_COUNT} strings"),
    ]
    for ok, name, rule in checks:
        if not ok:
            raise RequestError(f"sampling_params.{name} must be {rule}")
    return dict(p, temperature=temperature, top_k=-1 if top_k >= TOP_K_ALL else top_k,
                stop_token_ids=sorted(set(p["stop_token_ids"]))), n


# -- sampling ----------------------------------------------------------------------------
class BatchSampler:
    """Samples the next token of every row of one batch; holds the penalties' running state.

    Each step: ``tok_b, logp_b = sample(logits_bv)``, then ``record(tok_b)``. Work for a
    feature is done only when some row uses it, so a batch of plain requests pays nothing for
    the penalties. Rows leave (``select``) and join (``join``) with their own state.
    """

    COLUMNS = {"min_p_b": 0.0, "freq_b": 0.0, "pres_b": 0.0, "min_new_b": 0.0}
    """The optional per-row columns (None while every row has the neutral value) and that value."""
    ACCUMULATORS = ("freq_acc_bv", "pres_acc_bv", "stop_ban_bv")
    """The optional per-row state over the vocabulary (None while unused; zeros is neutral)."""

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
        self.min_new_b = _column([float(r.min_new_tokens) for r in reqs], 0.0, dev)
        zeros = lambda: torch.zeros((B, V), dtype=torch.float32, device=dev)  # noqa: E731
        self.freq_acc_bv = zeros() if self.freq_b is not None else None
        self.pres_acc_bv = zeros() if self.pres_b is not None else None
        self.stop_ban_bv = None
        if self.min_new_b is not None:  # -inf on every token that would end the sequence
            self.stop_ban_bv = zeros()
            for i, r in enumerate(reqs):
                banned = [t for t in set(r.stop_token_ids) | set(eos_ids) if 0 <= t < V]
                self.stop_ban_bv[i, banned] = float("-inf")
        self.adjusting = any(x is not None for x in (self.freq_b, self.pres_b, self.min_new_b))
        self.steps_b1 = torch.zeros((B, 1), dtype=torch.float32, device=dev)  # tokens generated, per row

    def adjust(self, logits_bv: torch.Tensor) -> torch.Tensor:
        """The additive penalties on float32 logits, as SGLang's (a new tensor)."""
        additive_bv = torch.zeros_like(logits_bv)
        if self.freq_acc_bv is not None:
            additive_bv -= self.freq_acc_bv
        if self.pres_acc_bv is not None:
            additive_bv -= self.pres_acc_bv
        if self.stop_ban_bv is not None:
            banning_b1 = self.steps_b1 < self.min_new_b
            additive_bv += torch.where(banning_b1, self.stop_ban_bv, 0.0)
        return logits_bv + additive_bv

    def sample(self, logits_bv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (token_b, logprob_b) for the last position's logits of every row."""
        logits_bv = logits_bv.float()
        if self.adjusting:
            logits_bv = self.adjust(logits_bv)
        greedy_b = self.greedy_b
        scaled_bv = logits_bv / torch.where(greedy_b, 1.0, self.temps_b)[:, None]
        if self.adjusting:  # a tiny temperature can overflow to inf
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
        tok_b = torch.where(greedy_b, logits_bv.argmax(-1), tok_b)
        return tok_b, logp_bv.gather(1, tok_b[:, None]).squeeze(1)

    def select(self, idx_b: torch.Tensor) -> None:
        """Keep only the rows ``idx_b`` (the requests still decoding), in that order."""
        rows = idx_b.tolist()
        self.top_k = [self.top_k[i] for i in rows]
        self.top_p = [self.top_p[i] for i in rows]
        for name in ("temps_b", "greedy_b", "steps_b1", *self.COLUMNS, *self.ACCUMULATORS):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value[idx_b])

    def join(self, other: BatchSampler) -> None:
        """Append ``other``'s rows after these (requests joining a running batch), each row
        keeping its parameters, counters and step count; a feature one side does not use
        gets its neutral value there."""
        B, B2 = len(self.top_k), len(other.top_k)
        self.top_k, self.top_p = self.top_k + other.top_k, self.top_p + other.top_p
        for name in ("temps_b", "greedy_b", "steps_b1"):
            setattr(self, name, torch.cat([getattr(self, name), getattr(other, name)]))
        for name, neutral in (*self.COLUMNS.items(), *((n, 0.0) for n in self.ACCUMULATORS)):
            setattr(self, name, _joined(getattr(self, name), getattr(other, name), B, B2, neutral))
        self.adjusting = self.adjusting or other.adjusting

    def record(self, tok_b: torch.Tensor) -> None:
        """Count the tokens just generated (SGLang's ``cumulate_output_tokens``)."""
        idx_b1 = tok_b[:, None]
        if self.freq_acc_bv is not None:
            self.freq_acc_bv.scatter_add_(1, idx_b1, self.freq_b)
        if self.pres_acc_bv is not None:
            self.pres_acc_bv.scatter_(1, idx_b1, self.pres_b)
        self.steps_b1 += 1


def _joined(a: torch.Tensor | None, b: torch.Tensor | None, rows_a: int, rows_b: int,
            neutral: float) -> torch.Tensor | None:
    """``a``'s rows then ``b``'s; a side that is None (unused) filled with ``neutral``."""
    if a is None and b is None:
        return None
    like = a if a is not None else b
    fill = lambda n: torch.full((n, like.shape[1]), neutral, dtype=like.dtype, device=like.device)  # noqa: E731
    return torch.cat([a if a is not None else fill(rows_a), b if b is not None else fill(rows_b)])


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
