"""The ``/generate`` request and answer the CPU engine serves: SGLang 0.5.23's, for the fields
our rollout and SGLang's frontend (``sglang.lang``'s ``RuntimeEndpoint``) send.

Served: ``input_ids`` or ``text``, one prompt or a list of them; ``sampling_params`` (one
object for every prompt; fields in ``sampling.SERVED``); ``return_logprob`` and
``return_text_in_logprobs``. Any other field is refused unless unset (``check_served``).
As ``GenerateReqInput`` does, ``n`` samples of each prompt come back prompt-major
(``tokenizer_manager._handle_batch_request``), so one prompt with ``n > 1`` answers a list;
a prompt longer than the context, or one plus an explicit ``max_new_tokens``, is refused,
and ``max_new_tokens`` is capped at the room left. Answers are ``GenerateResponse`` /
``GenerateMetaInfo``, with the weight versions of the output tokens as SGLang's spans
(``weight_versions``).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from rl.rollout.engines.hf_engine import GenResult
from rl.rollout.engines.sampling import (GenRequest, RequestError, as_bool, as_int, list_of,
                                         parse_sampling_params, read_fields, str_or_list)
from rl.rollout.engines.weight_versions import add_weight_versions_to_meta_info, weight_version_spans


def _prompts(where: str, v: Any) -> tuple[list, bool]:
    """``(prompts, single)``: one prompt (token ids or a string) or a list of them."""
    if where == "text":
        return (str_or_list(where, v), isinstance(v, str))
    single = not (isinstance(v, list) and v and isinstance(v[0], list))
    return ([list_of(as_int)(where, v)] if single else list_of(list_of(as_int))(where, v)), single


FIELDS = {"input_ids": (_prompts, None), "text": (_prompts, None),
          "sampling_params": (lambda where, v: v, None),  # read by parse_sampling_params
          "return_logprob": (as_bool, False), "return_text_in_logprobs": (as_bool, False)}
"""The top-level fields served: name -> (check, default), as ``sampling.SERVED``."""


@dataclass
class Generate:
    """A parsed ``/generate``: the expanded requests (prompt-major) and how to answer."""

    reqs: list[GenRequest]
    single: bool
    """Answer one object, not a list."""
    return_logprob: bool = False
    return_text_in_logprobs: bool = False


def parse_generate(body: Any, tokenizer, vocab_size: int, context_len: int | None) -> Generate:
    """The requests of one ``/generate`` body; ``RequestError`` names what is refused."""
    b = read_fields("", body, FIELDS)
    if (b["input_ids"] is None) == (b["text"] is None):
        raise RequestError("give exactly one of input_ids and text")
    where = "input_ids" if b["text"] is None else "text"
    prompts, single = b[where]
    if where == "text":
        prompts = [tokenizer.encode(t) for t in prompts]
    if not prompts or not all(prompts):
        raise RequestError(f"{where}: a prompt cannot be empty")
    for p in prompts:
        if not all(0 <= t < vocab_size for t in p):
            raise RequestError(f"{where}: token ids must be in [0, {vocab_size})")
    kwargs, n = parse_sampling_params(b["sampling_params"])
    sp = b["sampling_params"] if isinstance(b["sampling_params"], dict) else {}
    explicit = sp.get("max_new_tokens") is not None
    if "max_new_tokens" in sp and sp["max_new_tokens"] is None:
        # SGLang: a null max_new_tokens runs to the context length (the scheduler takes 1 << 30
        # and caps it at the room left), which _fit_context does below
        if context_len is None:
            raise RequestError("sampling_params.max_new_tokens=null needs the model's context length, "
                               "which its config does not give")
        kwargs["max_new_tokens"] = context_len
    reqs = [GenRequest(input_ids=p, **_fit_context(kwargs, len(p), context_len, explicit))
            for p in prompts for _ in range(n)]
    return Generate(reqs, single and n == 1, b["return_logprob"], b["return_text_in_logprobs"])


def _fit_context(kwargs: dict, input_len: int, context_len: int | None, explicit: bool) -> dict:
    """SGLang's length rules: refuse a prompt longer than the context, or one plus an
    ``explicit`` max_new_tokens; then cap max_new_tokens (default 128) at the room left,
    and min_new_tokens at that."""
    if context_len is None:
        return kwargs
    max_new = kwargs["max_new_tokens"]
    if input_len >= context_len or explicit and max_new + input_len > context_len:
        raise RequestError(f"the prompt ({input_len} tokens) plus max_new_tokens must fit the "
                           f"model's context length of {context_len} tokens")
    max_new = min(max_new, context_len - input_len - 1)
    return {**kwargs, "max_new_tokens": max_new,
            "min_new_tokens": min(kwargs["min_new_tokens"], max_new)}


def answer(g: Generate, i: int, res: GenResult, e2e_latency_s: float, tokenizer) -> dict:
    """One ``GenerateResponse`` (the keys SGLang's tokenizer manager writes,
    ``_handle_batch_output``)."""
    n = len(res.output_ids)
    meta: dict[str, Any] = {"id": uuid.uuid4().hex, "finish_reason": res.finish_reason,
                            "prompt_tokens": len(g.reqs[i].input_ids),
                            "weight_version": res.weight_version,
                            "num_retractions": res.num_retractions}
    if g.return_logprob:
        texts = ([tokenizer.decode([t]) for t in res.output_ids] if g.return_text_in_logprobs
                 else [None] * len(res.output_ids))
        meta["input_token_logprobs"] = []  # logprob_start_len=-1: output tokens only
        meta["output_token_logprobs"] = [[lp, t, s] for lp, t, s in
                                         zip(res.logprobs, res.output_ids, texts)]
    meta.update({"completion_tokens": n, "cached_tokens": 0})
    spans = weight_version_spans(res.version_events, res.weight_version, n)
    add_weight_versions_to_meta_info(meta, spans, n)
    meta["e2e_latency"] = e2e_latency_s
    return {"text": res.text, "output_ids": res.output_ids, "meta_info": meta}
