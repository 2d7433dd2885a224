"""Generation loop, sampling and state reuse."""
import pytest

import hf_models
from lean_qwenflash.generate import Generator, SamplingParams, new_state
from lean_qwenflash.models import load_hf_checkpoint


@pytest.fixture(scope="module")
def gen():
    c = hf_models.case("qwen3_next")
    model, _ = load_hf_checkpoint(c.path)
    return Generator(model), c.prompt[0].tolist()


SAMPLED = dict(temperature=0.9, top_k=30, top_p=0.95, min_p=0.02, repetition_penalty=1.2,
               presence_penalty=0.4, frequency_penalty=0.2)


def test_seeded_sampling_is_reproducible(gen):
    g, prompt = gen
    a = list(g.generate(prompt, SamplingParams(**SAMPLED, seed=3), max_new_tokens=16))
    b = list(g.generate(prompt, SamplingParams(**SAMPLED, seed=3), max_new_tokens=16))
    c = list(g.generate(prompt, SamplingParams(temperature=1.5, seed=4), max_new_tokens=16))
    assert a == b and len(a) == 16
    assert a != c


def test_filters_that_keep_one_token_are_greedy(gen):
    g, prompt = gen
    greedy = list(g.generate(prompt, SamplingParams(temperature=0), max_new_tokens=8))
    for params in (dict(top_k=1), dict(top_p=1e-6), dict(min_p=0.999999)):
        assert list(g.generate(prompt, SamplingParams(temperature=1.0, seed=0, **params), 8)) == greedy


def test_penalties_change_greedy_choice(gen):
    g, prompt = gen
    plain = list(g.generate(prompt, SamplingParams(temperature=0), max_new_tokens=24))
    penalised = list(g.generate(prompt, SamplingParams(temperature=0, frequency_penalty=2.0,
                                                       repetition_penalty=3.0), max_new_tokens=24))
    assert plain != penalised


def test_stop_tokens_and_max_tokens(gen):
    g, prompt = gen
    greedy = list(g.generate(prompt, SamplingParams(temperature=0), max_new_tokens=12))
    assert len(greedy) == 12
    stop = greedy[5]
    cut = greedy.index(stop)
    assert list(g.generate(prompt, SamplingParams(temperature=0), 12, stop_token_ids=[stop])) == greedy[:cut]
    assert list(g.generate(prompt, SamplingParams(temperature=0), 0)) == []


def test_chunked_prefill_and_prefix_snapshot_give_same_tokens(gen):
    g, prompt = gen
    greedy = list(g.generate(prompt, SamplingParams(temperature=0), max_new_tokens=10))
    small_chunks = Generator(g.model, prefill_chunk_tokens=7)
    assert list(small_chunks.generate(prompt, SamplingParams(temperature=0), 10)) == greedy
    prefix = new_state(g.model)
    g.prefill(prompt[:25], prefix)
    snapshot = prefix.clone()
    assert list(g.generate(prompt, SamplingParams(temperature=0), 10, state=snapshot)) == greedy
    assert snapshot.num_tokens == len(prompt) + 9
    assert prefix.num_tokens == 25


@pytest.mark.parametrize("name,value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("top_k", -1), ("top_k", 2.5), ("top_p", 0.0),
    ("top_p", 1.5), ("min_p", 1.0), ("min_p", -0.1), ("repetition_penalty", 0.0),
    ("presence_penalty", 2.5), ("frequency_penalty", -3.0), ("seed", -1), ("seed", "x"),
])
def test_invalid_sampling_params_name_the_parameter(name, value):
    with pytest.raises(ValueError, match=name) as err:
        SamplingParams(**{name: value})
    assert "allowed" in str(err.value)


def test_invalid_generate_arguments(gen):
    g, prompt = gen
    with pytest.raises(ValueError, match="max_new_tokens"):
        g.generate(prompt, SamplingParams(), max_new_tokens=-1)
    with pytest.raises(ValueError, match="vocabulary"):
        g.generate([0, 10 ** 6], SamplingParams())
    with pytest.raises(ValueError, match="prompt"):
        g.generate([], SamplingParams())
