"""SGLang 0.5.23's ``/generate`` request and answer, for the CPU engine.

The request is ``sglang.api.v1.api_types.GenerateRequest``. As SGLang's server does, the body
is first held to that schema (``check_schema``: every field's JSON type, unknown sampling
keys; SGLang's contract gate, ``ContractError``), then read (``parse_generate``, whose
refusals are SGLang's ``ValueError``s). Unknown top-level keys are ignored; a known field the
engine cannot honour is refused (``RequestError``, naming it) when set to anything but its
default; fields that only steer SGLang's routing, caching or metrics (``extra_key``,
``cache_salt``, ``priority``, ``routing_key``, ``custom_labels``,
``routed_experts_start_len``) are type-checked and ignored. Batching follows
``GenerateReqInput``: ``input_ids`` or ``text``, one prompt or a list; ``n`` samples of each
prompt come back prompt-major (``tokenizer_manager._handle_batch_request``), so one prompt
with ``n > 1`` answers a list. Answers carry ``GenerateResponse`` / ``GenerateMetaInfo``, with
the weight version and its span over the output tokens (``weight_versions``).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from rl.rollout.engines.hf_engine import GenResult
from rl.rollout.engines.sampling import (SAMPLING_FIELDS, GenRequest, RequestError,
                                         _unknown_field, as_bool, as_int, as_list, as_str,
                                         as_str_or_list, parse_sampling_params, type_error)


class ContractError(RequestError):
    """The body breaks ``GenerateRequest``'s schema. SGLang's contract gate answers it with
    ``{"error": "<text>"}`` and 400, where its other refusals carry ``{"message": ...}``."""


def _opt(check):
    """``check`` for a value that may also be null."""
    return lambda where, v: None if v is None else check(where, v)


def _or_list(check):
    """One value or a sequence of them (the schema's ``...OrList`` types)."""
    return lambda where, v: as_list(where, v, check) if isinstance(v, list) else check(where, v)


def _list_of(check):
    return lambda where, v: as_list(where, v, check)


def _token_ids(where: str, v: Any) -> list:
    """A sequence of token ids, or a sequence of such sequences."""
    if not isinstance(v, list):
        raise type_error(where, v, "a sequence of token ids or of such sequences")
    if v and isinstance(v[0], list):
        return [as_list(f"{where}[{i}]", p, as_int) for i, p in enumerate(v)]
    return as_list(where, v, as_int)


def _u64(where: str, v: Any) -> int:
    if as_int(where, v) < 0:
        raise RequestError(f"{where}: invalid value: integer `{v}`, expected u64")
    return v


def _map(where: str, v: Any) -> dict:
    if not isinstance(v, dict):
        raise type_error(where, v, "a map")
    return v


def _labels(where: str, v: Any) -> dict:
    return {k: as_str(f"{where}.{k}", e) for k, e in _map(where, v).items()}


def _media_item(where: str, v: Any) -> Any:
    if v is not None and not isinstance(v, (str, dict)):
        raise type_error(where, v, "one of the MediaInput shapes")
    return v


def _media(where: str, v: Any) -> Any:
    """A URL or ``MediaRef``, or (nested) sequences of them; the fields of a ``MediaRef``
    are not checked (media are refused when set)."""
    if isinstance(v, list):
        return [as_list(f"{where}[{i}]", e, _media_item) if isinstance(e, list)
                else _media_item(f"{where}[{i}]", e) for i, e in enumerate(v)]
    if v is None:
        raise type_error(where, v, "one of the MediaInput shapes")
    return _media_item(where, v)


def _sampling_params(where: str, v: Any) -> Any:
    """``SamplingParams`` or a sequence of them: known keys only, each of its JSON type."""
    if isinstance(v, list):
        return [_sampling_params_struct(f"{where}[{i}]", s) for i, s in enumerate(v)]
    return _sampling_params_struct(where, v)


def _sampling_params_struct(where: str, v: Any) -> dict:
    if not isinstance(v, dict):
        raise type_error(where, v, "struct SamplingParams")
    for key, value in v.items():
        if key not in SAMPLING_FIELDS:
            raise _unknown_field(where, key, tuple(SAMPLING_FIELDS))
        if value is not None:
            SAMPLING_FIELDS[key][0](f"{where}.{key}", value)
    return v


# Every top-level field of ``GenerateRequest`` and its JSON type, null allowed unless in
# ``_NOT_NULL``; the fields of structs the engine refuses (media, ``kv_hints``,
# ``images_config``) are not checked inside. Each field is read, refused or ignored below.
FIELDS = {
    "rid": as_str_or_list, "text": as_str_or_list, "input_ids": _token_ids, "stream": as_bool,
    "sampling_params": _sampling_params, "return_logprob": _or_list(as_bool),
    "logprob_start_len": _or_list(as_int), "top_logprobs_num": _or_list(as_int),
    "token_ids_logprob": _token_ids, "return_hidden_states": _or_list(as_bool),
    "return_text_in_logprobs": as_bool, "bootstrap_host": _or_list(_opt(as_str)),
    "bootstrap_port": _or_list(_opt(as_int)), "bootstrap_room": _or_list(_opt(as_int)),
    "bootstrap_pair_key": _or_list(_opt(as_str)), "decode_tp_size": _or_list(_opt(as_int)),
    "routed_dp_rank": as_int, "disagg_prefill_dp_rank": as_int, "image_data": _media,
    "mm_hashes": _list_of(as_str_or_list), "video_data": _media, "audio_data": _media,
    "extra_key": as_str_or_list, "priority": as_int, "cache_salt": as_str_or_list,
    "require_reasoning": as_bool, "lora_path": _or_list(_opt(as_str)),
    "session_params": lambda where, v: v, "kv_hints": _or_list(_opt(_map)),
    "routing_key": as_str, "max_thinking_tokens": _u64, "session_id": as_str,
    "custom_logit_processor": _or_list(_opt(as_str)), "custom_labels": _labels,
    "images_config": _map, "return_prompt_token_ids": as_bool,
    "routed_experts_start_len": as_int, "return_sampling_mask": _or_list(as_bool),
    "modalities": _list_of(_opt(as_str)),
}
_NOT_NULL = {"return_prompt_token_ids", "routed_experts_start_len"}


def check_schema(body: Any) -> dict:
    """``body`` if it fits ``GenerateRequest``'s schema, else a ``ContractError`` naming the
    field at fault (SGLang's contract gate, ``api_contract.generate_contract_error``)."""
    if not isinstance(body, dict):
        raise ContractError(str(type_error("request body", body, "struct GenerateRequest")))
    for name, check in FIELDS.items():
        if name in body and (body[name] is not None or name in _NOT_NULL):
            try:
                check(name, body[name])
            except RequestError as e:
                raise ContractError(str(e)) from None
    return body


def _values(v: Any) -> list:
    return v if isinstance(v, list) else [v]


def _any_set(v: Any) -> bool:
    """Set to something other than null, false, empty, or a list of those."""
    return any(_any_set(x) for x in v) if isinstance(v, list) else v not in (None, False, "", {})


# Top-level fields the engine reads.
_READ = ("rid", "text", "input_ids", "sampling_params", "return_logprob",
         "return_text_in_logprobs", "return_prompt_token_ids")
# Top-level fields the engine cannot honour: name -> "is it set to a non-default value?"
_REFUSED = {
    "stream": _any_set, "return_hidden_states": _any_set, "return_sampling_mask": _any_set,
    "logprob_start_len": lambda v: any(x not in (None, -1) for x in _values(v)),
    "top_logprobs_num": lambda v: any(x not in (None, 0) for x in _values(v)),
    "token_ids_logprob": _any_set, "require_reasoning": _any_set,
    "routed_dp_rank": lambda v: v not in (None, 0),  # one data-parallel rank: 0
    **{name: _any_set for name in (
        "image_data", "video_data", "audio_data", "mm_hashes", "modalities", "images_config",
        "lora_path", "session_params", "session_id", "kv_hints", "custom_logit_processor",
        "max_thinking_tokens", "bootstrap_host", "bootstrap_port", "bootstrap_room",
        "bootstrap_pair_key", "decode_tp_size", "disagg_prefill_dp_rank")},
}
# Accepted and ignored (SGLang uses them for routing, caching, metrics): type checks only.
_IGNORED = ("extra_key", "cache_salt", "priority", "routing_key", "custom_labels",
            "routed_experts_start_len")


@dataclass
class Generate:
    """A parsed ``/generate``: the expanded requests (prompt-major) and how to answer."""

    reqs: list[GenRequest]
    ids: list[str]
    """``meta_info.id`` of each answer (the request's ``rid`` where SGLang keeps it)."""
    return_logprob: list[bool]
    single: bool
    """Answer one object, not a list."""
    return_text_in_logprobs: bool = False
    return_prompt_token_ids: bool = False


def parse_generate(body: Any, tokenizer, vocab_size: int, context_len: int | None) -> Generate:
    """The requests of one ``/generate`` body: ``ContractError`` when it breaks the schema,
    ``RequestError`` for what SGLang refuses past its gate (and what this engine refuses)."""
    check_schema(body)
    for name, is_set in _REFUSED.items():
        if is_set(body.get(name)):
            raise RequestError(f"{name}={body[name]!r} is not supported by the CPU engine; "
                               "leave it unset")
    prompts, single = _prompts(body, tokenizer, vocab_size)
    P = len(prompts)
    sps = body.get("sampling_params")
    if isinstance(sps, list):
        if len(sps) != P:
            raise RequestError(f"sampling_params: {len(sps)} entries for {P} prompts")
        parsed = [parse_sampling_params(s, vocab_size, f"sampling_params[{i}]")
                  for i, s in enumerate(sps)]
    else:
        parsed = [parse_sampling_params(sps, vocab_size)] * P
    n = parsed[0][1]
    if any(k != n for _, k in parsed):
        raise RequestError("The parallel_sample_num should be the same for all samples in "
                           "sample params.")  # SGLang's message: every n must be equal
    logprob = body.get("return_logprob")
    logprob = False if logprob is None else _or_list(as_bool)("return_logprob", logprob)
    if isinstance(logprob, list):
        if n > 1:
            raise RequestError("Cannot use list return_logprob with parallel_sample_num > 1")
        if len(logprob) != P:
            raise RequestError(f"return_logprob: {len(logprob)} entries for {P} prompts")
    logprobs = logprob if isinstance(logprob, list) else [logprob] * P
    rids = _rids(body.get("rid"), P, single and n == 1)
    reqs, ids, want = [], [], []
    raw = sps if isinstance(sps, list) else [sps] * P
    for p, prompt in enumerate(prompts):  # prompt-major: all n samples of a prompt together
        explicit = isinstance(raw[p], dict) and raw[p].get("max_new_tokens") is not None
        kwargs = _fit_context(parsed[p][0], len(prompt), context_len, explicit)
        for _ in range(n):
            reqs.append(GenRequest(input_ids=prompt, **kwargs))
            ids.append(rids[p] if n == 1 else uuid.uuid4().hex)
            want.append(logprobs[p])
    text_lp = body.get("return_text_in_logprobs")
    prompt_ids = body.get("return_prompt_token_ids")
    return Generate(reqs, ids, want, single and n == 1,
                    bool(text_lp is not None and as_bool("return_text_in_logprobs", text_lp)),
                    bool(prompt_ids is not None and as_bool("return_prompt_token_ids", prompt_ids)))


def _prompts(body: dict, tokenizer, vocab_size: int) -> tuple[list[list[int]], bool]:
    ids, text = body.get("input_ids"), body.get("text")
    if (ids is None) == (text is None):
        raise RequestError("give exactly one of 'input_ids' and 'text'")
    if ids is not None:
        if not isinstance(ids, list):
            raise type_error("input_ids", ids, "a sequence of token ids or of such sequences")
        single = not ids or not isinstance(ids[0], list)
        prompts = [as_list("input_ids", ids, as_int)] if single else [
            as_list(f"input_ids[{i}]", p, as_int) for i, p in enumerate(ids)]
        where = ["input_ids"] if single else [f"input_ids[{i}]" for i in range(len(ids))]
    else:
        single = not isinstance(text, list)
        texts = [as_str("text", text)] if single else as_list("text", text, as_str)
        prompts = [tokenizer.encode(t) for t in texts]
        where = ["text"] if single else [f"text[{i}]" for i in range(len(texts))]
    if not prompts:
        raise RequestError(f"{'input_ids' if ids is not None else 'text'}: an empty batch")
    for w, prompt in zip(where, prompts):
        if not prompt:
            raise RequestError(f"{w} cannot be empty.")
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(f"{w} holds token ids outside the vocabulary [0, {vocab_size}): "
                               f"{bad[:5]}")
    return prompts, single


def _rids(rid: Any, P: int, single: bool) -> list[str]:
    """``meta_info.id`` per prompt, as ``GenerateReqInput._normalize_rid``."""
    if rid is None:
        return [uuid.uuid4().hex for _ in range(P)]
    rid = as_str_or_list("rid", rid)
    if isinstance(rid, str):
        return [rid] if single else [f"{rid}_{i}" for i in range(P)]
    if len(rid) != P:
        raise RequestError("The specified rids length mismatch with the batch_size for "
                           "batch processing.")
    return rid


def _fit_context(kwargs: dict, input_len: int, context_len: int | None, explicit: bool) -> dict:
    """SGLang's length rules: refuse a prompt longer than the context, or one plus an
    ``explicit`` max_new_tokens; then cap max_new_tokens (default 128; null asks for all the
    room) at the room left, and min_new_tokens at that."""
    max_new = kwargs["max_new_tokens"]
    if context_len is None:
        return kwargs if max_new is not None else {**kwargs, "max_new_tokens": 1 << 30}
    if input_len >= context_len:
        raise RequestError(f"The input ({input_len} tokens) is longer than the model's context "
                           f"length ({context_len} tokens).")
    if explicit and max_new + input_len > context_len:
        raise RequestError(
            f"Requested token count exceeds the model's maximum context length of {context_len} "
            f"tokens. You requested a total of {max_new + input_len} tokens: {input_len} tokens "
            f"from the input messages and {max_new} tokens for the completion. Please reduce "
            "the number of tokens in the input messages or the completion to fit within the limit.")
    room = context_len - input_len - 1
    max_new = room if max_new is None else min(max_new, room)
    return {**kwargs, "max_new_tokens": max_new,
            "min_new_tokens": min(kwargs["min_new_tokens"], max_new)}


def answer(g: Generate, i: int, res: GenResult, e2e_latency_s: float, tokenizer) -> dict:
    """One ``GenerateResponse`` (the keys SGLang's tokenizer manager writes)."""
    req = g.reqs[i]
    meta: dict[str, Any] = {"id": g.ids[i], "finish_reason": res.finish_reason,
                            "prompt_tokens": len(req.input_ids),
                            "weight_version": res.weight_version, "num_retractions": 0}
    if g.return_logprob[i]:
        texts = ([tokenizer.decode([t]) for t in res.output_ids] if g.return_text_in_logprobs
                 else [None] * len(res.output_ids))
        meta["input_token_logprobs"] = []  # logprob_start_len=-1: output tokens only
        meta["output_token_logprobs"] = [[lp, t, s] for lp, t, s in
                                         zip(res.logprobs, res.output_ids, texts)]
        meta["output_token_logprobs_length"] = len(res.output_ids)
    meta.update({"reasoning_tokens": 0, "completion_tokens": len(res.output_ids), "cached_tokens": 0,
                 # SGLang's spans (utils/weight_versions.py): one here, as a batch runs to its
                 # end under one version (a pause waits for it)
                 "weight_versions": [{"version": res.weight_version, "start": 0,
                                      "end": len(res.output_ids)}],
                 "e2e_latency": e2e_latency_s})
    out = {"text": res.text, "output_ids": res.output_ids, "meta_info": meta}
    if g.return_prompt_token_ids:
        out["prompt_token_ids"] = req.input_ids
    return out
