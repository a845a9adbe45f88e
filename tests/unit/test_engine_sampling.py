"""The CPU engine's sampling parameters against SGLang 0.5.23, in this process: the schema
(every field of ``api_types.SamplingParams``, its defaults, types and refusals), penalties and
bias on a tiny logits example computed by hand, log-probs before filtering, and stopping
rules on the real tiny model. Over HTTP: tests/integration/test_engine_sampling.py."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch

from rl.model import eos_token_ids, load_model, load_tokenizer
from rl.rollout.engines.hf_engine import GenRequest, HFEngine
from rl.rollout.engines.sampling import SAMPLING_FIELDS, BatchSampler, RequestError, parse_sampling_params


@pytest.fixture(scope="module")
def engine(tiny_path):
    tok = load_tokenizer(tiny_path)
    return HFEngine(load_model(tiny_path), tok, eos_token_ids(tiny_path, tok), seed=0)


def _sampler(*reqs: GenRequest, eos=(4,), vocab=5, seed=0) -> BatchSampler:
    return BatchSampler(list(reqs), list(eos), vocab, torch.device("cpu"),
                        torch.Generator().manual_seed(seed))


# -- schema ------------------------------------------------------------------------------
def test_every_sglang_sampling_field_is_known_with_sglangs_default():
    from sglang.api.v1 import api_types as api  # the pinned wheel (a test dependency)

    default = api.SamplingParams()
    sglang = {f.name: getattr(default, f.name) for f in msgspec.structs.fields(api.SamplingParams)}
    assert list(SAMPLING_FIELDS) == list(sglang)
    assert {name: absent for name, (_, absent, _) in SAMPLING_FIELDS.items()} == sglang
    # every field, sent at SGLang's default, is accepted and changes nothing
    defaults = default.to_json_value() | {"stop_token_ids": [], "choice": []}
    assert parse_sampling_params(defaults, 49) == parse_sampling_params({}, 49)


def test_sglang_defaults_and_off_values():
    kwargs, n = parse_sampling_params({}, 49)
    assert n == 1 and kwargs == dict(
        max_new_tokens=128, temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0,
        frequency_penalty=0.0, presence_penalty=0.0, repetition_penalty=1.0, min_new_tokens=0,
        stop=[], stop_token_ids=[], ignore_eos=False, logit_bias={}, sampling_seed=None,
        skip_special_tokens=True, spaces_between_special_tokens=True, no_stop_trim=False)
    assert parse_sampling_params({"top_k": 1 << 30}, 49)[0]["top_k"] == -1
    assert parse_sampling_params({"top_k": -1}, 49)[0]["top_k"] == -1
    greedy = parse_sampling_params({"temperature": 5e-7, "top_k": 0}, 49)[0]  # as SGLang: greedy
    assert (greedy["temperature"], greedy["top_k"]) == (0.0, 1)
    assert parse_sampling_params({"temperature": None}, 49)[0]["temperature"] == 1.0
    assert parse_sampling_params({"stop": "ab"}, 49)[0]["stop"] == ["ab"]
    assert parse_sampling_params({"logit_bias": {"7": -1}}, 49)[0]["logit_bias"] == {7: -1.0}


@pytest.mark.parametrize("raw, names", [
    ({"max_tokens": 3}, "unknown field `max_tokens`"),
    ({"temperature": "hot"}, 'sampling_params.temperature: invalid type: string "hot", expected f64'),
    ({"top_k": 2.5}, "sampling_params.top_k: invalid type: floating point `2.5`, expected i64"),
    ({"ignore_eos": 1}, "sampling_params.ignore_eos"),
    ({"stop": [1]}, "sampling_params.stop[0]"),
    ({"logit_bias": {"3": "x"}}, "sampling_params.logit_bias.3"),
    ({"logit_bias": {"49": 1.0}}, "logit_bias must has keys in [0, 48], got 49."),
    ({"logit_bias": {"x": 1.0}}, "logit_bias must has keys"),
    ({"temperature": -0.5}, "temperature must be a non-negative finite number"),
    ({"top_p": 0.0}, "top_p must be in (0, 1]"),
    ({"top_k": 0}, "top_k must be -1 (disable) or at least 1, got 0."),
    ({"min_p": 1.5}, "min_p must be in [0, 1]"),
    ({"frequency_penalty": 3}, "frequency_penalty must be in [-2, 2]"),
    ({"presence_penalty": -3}, "presence_penalty must be in [-2, 2]"),
    ({"repetition_penalty": 0}, "repetition_penalty must be in (0, 2]"),
    ({"min_new_tokens": 5, "max_new_tokens": 4}, "min_new_tokens must be in [0, max_new_tokens(4)]"),
    ({"max_new_tokens": -1}, "max_new_tokens must be at least 0"),
    ({"n": 0}, "n must be at least 1"),
    ({"beam_width": 0}, "beam_width must be at least 1"),
    ({"stop": ["x"] * 33}, "at most 32 stop strings"),
    ({"json_schema": "{}"}, "sampling_params.json_schema is not supported"),
    ({"regex": "a+"}, "sampling_params.regex is not supported"),
    ({"ebnf": "root ::= 'a'"}, "sampling_params.ebnf is not supported"),
    ({"structural_tag": "{}"}, "sampling_params.structural_tag is not supported"),
    ({"stop_regex": "a+"}, "sampling_params.stop_regex is not supported"),
    ({"beam_width": 2}, "sampling_params.beam_width is not supported"),
    ({"watermark": {"enabled": True}}, "sampling_params.watermark is not supported"),
    ({"watermark": {"colour": 1}}, "sampling_params.watermark: unknown field `colour`"),
    ({"choice": ["a", "b"]}, "sampling_params.choice is not supported"),
    ({"custom_params": {"k": 1}}, "sampling_params.custom_params is not supported"),
    ([1, 2], "sampling_params: invalid type: sequence, expected struct SamplingParams"),
])
def test_bad_or_unsupported_sampling_params_are_refused_naming_the_field(raw, names):
    with pytest.raises(RequestError) as e:
        parse_sampling_params(raw, 49)
    assert names in str(e.value)


def test_refused_fields_at_their_off_values_are_accepted():
    for raw in ({"json_schema": ""}, {"regex": None}, {"stop_regex": []}, {"beam_width": 1},
                {"watermark": {"enabled": False}}, {"choice": []}, {"custom_params": None},
                {"stream_interval": 4}, {"spaces_between_special_tokens": False}):
        parse_sampling_params(raw, 49)


# -- the sampler on a hand-computed example ------------------------------------------------
LOGITS = [1.0, 2.0, -1.0, 0.5, 0.0]  # vocab of 5; token 4 is EOS


def test_penalties_and_bias_adjust_logits_as_sglang():
    """After outputs 1, 1, 3: frequency 0.5 per occurrence and presence 0.25 once are
    subtracted, then repetition 2.0 divides positive and multiplies negative logits of seen
    tokens, then logit_bias adds; a row without them in the same batch is untouched."""
    req = GenRequest([0], frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=2.0,
                     logit_bias={0: 1.5, 1: 1.5})
    sampler = _sampler(req, GenRequest([0]))
    for tok in (1, 1, 3):
        sampler.record(torch.tensor([tok, tok]))
    got = sampler.adjust(torch.tensor([LOGITS, LOGITS]))
    # token 1: 2.0 - 2*0.5 - 0.25 = 0.75, /2 -> 0.375, +1.5; token 3: 0.5 - 0.5 - 0.25, *2
    assert got.tolist() == [[2.5, 1.875, -1.0, -0.5, 0.0], LOGITS]


def test_each_penalty_alone():
    for req, want in [
        (GenRequest([0], frequency_penalty=-1.0), [1.0, 4.0, -1.0, 1.5, 0.0]),
        (GenRequest([0], presence_penalty=1.0), [1.0, 1.0, -1.0, -0.5, 0.0]),
        (GenRequest([0], repetition_penalty=0.5), [1.0, 4.0, -1.0, 1.0, 0.0]),
        (GenRequest([0], logit_bias={2: -2.0, 4: 0.25}), [1.0, 2.0, -3.0, 0.5, 0.25]),
    ]:
        sampler = _sampler(req)
        for tok in (1, 1, 3):
            sampler.record(torch.tensor([tok]))
        assert sampler.adjust(torch.tensor([LOGITS])).tolist() == [want], req


def test_logprob_is_of_the_adjusted_tempered_distribution_before_top_k():
    req = GenRequest([0], temperature=0.5, top_k=1, logit_bias={0: 1.5})
    tok, logp = _sampler(req).sample(torch.tensor([LOGITS]))
    scaled = [(x + (1.5 if i == 0 else 0.0)) / 0.5 for i, x in enumerate(LOGITS)]
    want = scaled[0] - math.log(sum(math.exp(x) for x in scaled))
    assert tok.tolist() == [0]  # top_k=1 keeps only the argmax
    assert logp.item() == pytest.approx(want, abs=1e-6)  # not 0: the unfiltered distribution
    # greedy: the argmax and its unscaled log-probability
    tok, logp = _sampler(GenRequest([0], temperature=0.0)).sample(torch.tensor([LOGITS]))
    assert tok.tolist() == [1]
    assert logp.item() == pytest.approx(2.0 - math.log(sum(math.exp(x) for x in LOGITS)), abs=1e-6)


def test_min_new_tokens_bans_stop_tokens_until_reached():
    sampler = _sampler(GenRequest([0], min_new_tokens=2, stop_token_ids=[2]))
    inf = float("-inf")
    assert sampler.adjust(torch.tensor([LOGITS])).tolist() == [[1.0, 2.0, inf, 0.5, inf]]
    sampler.record(torch.tensor([0]))
    assert sampler.adjust(torch.tensor([LOGITS])).tolist() == [[1.0, 2.0, inf, 0.5, inf]]
    sampler.record(torch.tensor([0]))
    assert sampler.adjust(torch.tensor([LOGITS])).tolist() == [LOGITS]


def test_min_p_keeps_tokens_within_a_fraction_of_the_likeliest():
    probs = [0.5, 0.3, 0.15, 0.05]
    logits = torch.tensor([[math.log(p) for p in probs]] * 400)
    for min_p, allowed in ((0.5, {0, 1}), (0.0, {0, 1, 2, 3})):
        reqs = [GenRequest([0], min_p=min_p)] * 400
        tok, logp = _sampler(*reqs, vocab=4).sample(logits)
        assert set(tok.tolist()) == allowed
        # the log-prob is of the unfiltered distribution
        torch.testing.assert_close(logp, torch.tensor([math.log(probs[t]) for t in tok.tolist()]))


def test_sampling_seed_repeats_a_sample_whatever_the_engine_seed(tiny_path):
    tok = load_tokenizer(tiny_path)
    model = load_model(tiny_path)
    engines = [HFEngine(model, tok, eos_token_ids(tiny_path, tok), seed=s) for s in (1, 2)]
    prompt = tok.encode("bb:")
    seeded = [e.generate([GenRequest(prompt, max_new_tokens=10, ignore_eos=True,
                                     sampling_seed=42)])[0].output_ids for e in engines]
    free = [e.generate([GenRequest(prompt, max_new_tokens=10, ignore_eos=True)])[0].output_ids
            for e in engines]
    assert seeded[0] == seeded[1] and free[0] != free[1]


# -- stopping, on the tiny model -----------------------------------------------------------
def _greedy(engine, prompt: str, **kw):
    req = GenRequest(engine.tokenizer.encode(prompt), max_new_tokens=12, temperature=0.0, **kw)
    return engine.generate([req])[0]


def test_stop_strings_match_the_decoded_output(engine):
    base = _greedy(engine, "bb:", ignore_eos=True)
    assert len(set(base.text)) >= 8, f"need a varied greedy output to cut: {base.text!r}"
    stop = base.text[4:6]  # one character per token in the tiny tokenizer
    cut = _greedy(engine, "bb:", ignore_eos=True, stop=["zz:", stop])
    assert cut.finish_reason == {"type": "stop", "matched": stop}
    assert cut.output_ids == base.output_ids[:6]  # through the token that completes it
    assert cut.text == base.text[:4]  # trimmed before the stop string
    kept = _greedy(engine, "bb:", ignore_eos=True, stop=[stop], no_stop_trim=True)
    assert kept.text == base.text[:6] and kept.output_ids == cut.output_ids


def test_stop_token_ids_eos_ignore_eos_and_min_new_tokens(engine):
    tok = engine.tokenizer
    base = _greedy(engine, "bb:", ignore_eos=True)
    stop_id = base.output_ids[3]
    res = _greedy(engine, "bb:", stop_token_ids=[stop_id])
    assert res.output_ids == base.output_ids[:4]  # the stop token is the last output id
    assert res.finish_reason == {"type": "stop", "matched": stop_id}
    assert res.text == tok.decode(base.output_ids[:3])  # ... and not in the text
    assert _greedy(engine, "bb:", stop_token_ids=[stop_id], no_stop_trim=True).text == \
        tok.decode(base.output_ids[:4])
    # ignore_eos turns off every token stop, as in SGLang
    assert _greedy(engine, "bb:", stop_token_ids=[stop_id], ignore_eos=True).finish_reason == \
        {"type": "length", "length": 12}
    # EOS certain from the first token: min_new_tokens holds it off for 3 tokens
    eos = engine.eos_ids[0]
    res = _greedy(engine, "bb:", logit_bias={eos: 100.0}, min_new_tokens=3)
    assert len(res.output_ids) == 4 and eos not in res.output_ids[:3]
    assert res.finish_reason == {"type": "stop", "matched": eos}
    assert _greedy(engine, "bb:", logit_bias={eos: 100.0}).output_ids == [eos]


def test_zero_new_tokens_answers_an_empty_output(engine):
    res = engine.generate([GenRequest([5, 6], max_new_tokens=0)])[0]
    assert (res.output_ids, res.finish_reason) == ([], {"type": "length", "length": 0})


def test_plain_requests_sample_as_before_penalties(engine):
    """A batch without any penalty takes the plain path: the same tokens as a sampler run by
    hand with the same generator, step by step."""
    prompt = engine.tokenizer.encode("bb:")
    engine.generator.manual_seed(7)
    got = engine.generate([GenRequest(prompt, max_new_tokens=6, ignore_eos=True)])[0]
    gen = torch.Generator().manual_seed(7)
    ids, want = list(prompt), []
    with torch.no_grad():
        for _ in range(6):
            logits = engine.model(input_ids=torch.tensor([ids])).logits[:, -1, :].float()
            t = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen).item()
            want.append(t)
            ids.append(t)
    assert got.output_ids == want
