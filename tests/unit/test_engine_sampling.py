"""The CPU engine's sampling parameters against SGLang 0.5.23, in this process: the fields
it serves (SGLang's, with SGLang's defaults), refusals naming the field, penalties on a tiny
logits example computed by hand, log-probs before filtering, and stopping rules on the real
tiny model. Over HTTP: tests/integration/test_engine_sampling.py."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch

from rl.model import eos_token_ids, load_model, load_tokenizer
from rl.rollout.engines.hf_engine import GenRequest, HFEngine
from rl.rollout.engines.sampling import SERVED, BatchSampler, RequestError, parse_sampling_params


@pytest.fixture(scope="module")
def engine(tiny_path):
    tok = load_tokenizer(tiny_path)
    return HFEngine(load_model(tiny_path), tok, eos_token_ids(tiny_path, tok), seed=0)


def _sampler(*reqs: GenRequest, eos=(4,), vocab=5, seed=0) -> BatchSampler:
    return BatchSampler(list(reqs), list(eos), vocab, torch.device("cpu"),
                        torch.Generator().manual_seed(seed))


# -- schema ------------------------------------------------------------------------------
def test_every_served_field_is_sglangs_with_sglangs_default():
    from sglang.api.v1 import api_types as api  # the pinned wheel (a test dependency)

    default = api.SamplingParams()
    sglang = {f.name for f in msgspec.structs.fields(api.SamplingParams)}
    assert set(SERVED) <= sglang, sorted(set(SERVED) - sglang)
    # every served field, sent at SGLang's default, changes nothing
    for name in SERVED:
        assert parse_sampling_params({name: getattr(default, name)}) == parse_sampling_params({}), name


def test_sglang_defaults_and_off_values():
    kwargs, n = parse_sampling_params({})
    assert n == 1 and kwargs == dict(
        max_new_tokens=128, temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0,
        frequency_penalty=0.0, presence_penalty=0.0, min_new_tokens=0, stop=[],
        stop_token_ids=[], ignore_eos=False, skip_special_tokens=True,
        spaces_between_special_tokens=True)
    assert parse_sampling_params({"top_k": 1 << 30})[0]["top_k"] == -1
    assert parse_sampling_params({"top_k": -1})[0]["top_k"] == -1
    greedy = parse_sampling_params({"temperature": 5e-7, "top_k": 0})[0]  # as SGLang: greedy
    assert (greedy["temperature"], greedy["top_k"]) == (0.0, 1)
    assert parse_sampling_params({"temperature": None})[0]["temperature"] == 1.0
    assert parse_sampling_params({"stop": "ab"})[0]["stop"] == ["ab"]


@pytest.mark.parametrize("raw, names", [
    ({"max_tokens": 3}, "does not serve sampling_params.max_tokens; it serves: frequency_penalty"),
    ({"regex": "a+"}, "does not serve sampling_params.regex"),
    ({"logit_bias": {"3": 1.0}}, "does not serve sampling_params.logit_bias"),
    ({"temperature": "hot"}, "sampling_params.temperature: expected a number"),
    ({"top_k": 2.5}, "sampling_params.top_k: expected an integer"),
    ({"ignore_eos": 1}, "sampling_params.ignore_eos: expected a boolean"),
    ({"stop": [1]}, "sampling_params.stop[0]: expected a string"),
    ({"temperature": -0.5}, "sampling_params.temperature must be >= 0"),
    ({"top_p": 0.0}, "sampling_params.top_p must be in (0, 1]"),
    ({"top_k": 0}, "sampling_params.top_k must be -1 (off) or at least 1"),
    ({"min_p": 1.5}, "sampling_params.min_p must be in [0, 1]"),
    ({"frequency_penalty": 3}, "sampling_params.frequency_penalty must be in [-2, 2]"),
    ({"presence_penalty": -3}, "sampling_params.presence_penalty must be in [-2, 2]"),
    ({"min_new_tokens": 5, "max_new_tokens": 4}, "sampling_params.min_new_tokens must be in"),
    ({"max_new_tokens": -1}, "sampling_params.max_new_tokens must be at least 0"),
    ({"n": 0}, "sampling_params.n must be at least 1"),
    ({"stop": ["x"] * 33}, "at most 32 strings"),
    ([1, 2], "sampling_params: expected a JSON object"),
])
def test_bad_or_unserved_sampling_params_are_refused_naming_the_field(raw, names):
    with pytest.raises(RequestError) as e:
        parse_sampling_params(raw)
    assert names in str(e.value)


def test_unserved_fields_left_unset_are_accepted():
    """What SGLang's frontend sends for fields it leaves at their default."""
    for raw in ({"json_schema": ""}, {"regex": None}, {"stop_regex": []}, {"choice": []},
                {"custom_params": None}, {"no_stop_trim": False}):
        assert parse_sampling_params(raw) == parse_sampling_params({})


# -- the sampler on a hand-computed example ------------------------------------------------
LOGITS = [1.0, 2.0, -1.0, 0.5, 0.0]  # vocab of 5; token 4 is EOS


def test_penalties_adjust_logits_as_sglang():
    """After outputs 1, 1, 3: frequency 0.5 per occurrence and presence 0.25 once are
    subtracted; a row without them in the same batch is untouched."""
    req = GenRequest([0], frequency_penalty=0.5, presence_penalty=0.25)
    sampler = _sampler(req, GenRequest([0]))
    for tok in (1, 1, 3):
        sampler.record(torch.tensor([tok, tok]))
    got = sampler.adjust(torch.tensor([LOGITS, LOGITS]))
    assert got.tolist() == [[1.0, 0.75, -1.0, -0.25, 0.0], LOGITS]


def test_each_penalty_alone():
    for req, want in [
        (GenRequest([0], frequency_penalty=-1.0), [1.0, 4.0, -1.0, 1.5, 0.0]),
        (GenRequest([0], presence_penalty=1.0), [1.0, 1.0, -1.0, -0.5, 0.0]),
    ]:
        sampler = _sampler(req)
        for tok in (1, 1, 3):
            sampler.record(torch.tensor([tok]))
        assert sampler.adjust(torch.tensor([LOGITS])).tolist() == [want], req


def test_logprob_is_of_the_adjusted_tempered_distribution_before_top_k():
    req = GenRequest([0], temperature=0.5, top_k=1, presence_penalty=1.5)
    sampler = _sampler(req)
    sampler.record(torch.tensor([1]))  # token 1, the argmax, is penalised below token 0
    tok, logp = sampler.sample(torch.tensor([LOGITS]))
    scaled = [(x - (1.5 if i == 1 else 0.0)) / 0.5 for i, x in enumerate(LOGITS)]
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


@pytest.mark.parametrize("penalised_first", [True, False])
def test_rows_joining_a_batch_keep_their_own_penalties_and_counts(penalised_first):
    """``join`` (requests joining a running batch): each row's penalties, counters and
    min_new_tokens count are its own, on whichever side a feature is unused."""
    penalised = GenRequest([0], frequency_penalty=0.5, presence_penalty=0.25, min_new_tokens=3,
                           temperature=0.5)
    running, joining = _sampler(penalised), _sampler(GenRequest([0]))
    if not penalised_first:
        running, joining = _sampler(GenRequest([0])), _sampler(penalised)
    for t in (1, 1):  # two tokens decoded before the join
        running.record(torch.tensor([t]))
    want = [running.adjust(torch.tensor([LOGITS]))[0], joining.adjust(torch.tensor([LOGITS]))[0]]
    running.join(joining)
    got = running.adjust(torch.tensor([LOGITS, LOGITS]))
    torch.testing.assert_close(got, torch.stack(want))
    running.record(torch.tensor([3, 3]))  # one more token each
    rows = running.adjust(torch.tensor([LOGITS, LOGITS])).tolist()
    if penalised_first:  # its tokens 1, 1, 3: three, so EOS (4) is allowed again
        assert rows == [pytest.approx([1.0, 2.0 - 1.0 - 0.25, -1.0, 0.5 - 0.5 - 0.25, 0.0]), LOGITS]
    else:  # its token 3 alone: one, so EOS is still banned
        assert rows == [LOGITS, pytest.approx([1.0, 2.0, -1.0, 0.5 - 0.5 - 0.25, float("-inf")])]
    assert running.temps_b.tolist() == ([0.5, 1.0] if penalised_first else [1.0, 0.5])


def test_min_p_keeps_tokens_within_a_fraction_of_the_likeliest():
    probs = [0.5, 0.3, 0.15, 0.05]
    logits = torch.tensor([[math.log(p) for p in probs]] * 400)
    for min_p, allowed in ((0.5, {0, 1}), (0.0, {0, 1, 2, 3})):
        reqs = [GenRequest([0], min_p=min_p)] * 400
        tok, logp = _sampler(*reqs, vocab=4).sample(logits)
        assert set(tok.tolist()) == allowed
        # the log-prob is of the unfiltered distribution
        torch.testing.assert_close(logp, torch.tensor([math.log(probs[t]) for t in tok.tolist()]))


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


def test_stop_token_ids_eos_ignore_eos_and_min_new_tokens(engine):
    tok = engine.tokenizer
    base = _greedy(engine, "bb:", ignore_eos=True)
    stop_id = base.output_ids[3]
    res = _greedy(engine, "bb:", stop_token_ids=[stop_id])
    assert res.output_ids == base.output_ids[:4]  # the stop token is the last output id
    assert res.finish_reason == {"type": "stop", "matched": stop_id}
    assert res.text == tok.decode(base.output_ids[:3])  # ... and not in the text
    # ignore_eos turns off every token stop, as in SGLang
    assert _greedy(engine, "bb:", stop_token_ids=[stop_id], ignore_eos=True).finish_reason == \
        {"type": "length", "length": 12}



def test_min_new_tokens_holds_off_a_certain_eos(tiny_path):
    tok = load_tokenizer(tiny_path)
    model = load_model(tiny_path)
    engine = HFEngine(model, tok, eos_token_ids(tiny_path, tok), seed=0)
    eos = engine.eos_ids[0]
    with torch.no_grad():  # EOS certain from the first token
        model.lm_head.weight[eos] += 50.0
    res = _greedy(engine, "bb:", min_new_tokens=3)
    assert len(res.output_ids) == 4 and eos not in res.output_ids[:3]
    assert res.finish_reason == {"type": "stop", "matched": eos}
    assert _greedy(engine, "bb:").output_ids == [eos]


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
