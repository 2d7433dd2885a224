"""Generation loop, sampling and state reuse."""
import pytest

import hf_models
from lean_qwenflash.generate import Generator, SamplingParams, new_state
from lean_qwenflash.loader import load_hf_checkpoint


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


# -- prefix cache, hooks, stepping ------------------------------------------------------------------

def test_prefix_cache_lru():
    import torch
    from lean_qwenflash.generate import KVCache, ModelState, PrefixCache

    def state(tokens):
        kv = KVCache()
        kv.append(torch.zeros(1, 1, len(tokens), 8), torch.zeros(1, 1, len(tokens), 8))
        st = ModelState([kv])
        st.num_tokens, st.tokens = len(tokens), list(tokens)
        return st

    per = state([0] * 4).nbytes() + 8 * 4
    cache = PrefixCache(2 * per)
    cache.put(state([1, 2, 3, 4]))
    cache.put(state([1, 2, 3, 5]))
    hit = cache.lookup([1, 2, 3, 4, 9])
    assert hit.num_tokens == 4 and hit.tokens == [1, 2, 3, 4]
    assert cache.lookup([1, 2, 3, 4]) is None       # strict prefix only: one new token must remain
    cache.put(state([7, 7, 7, 7]))                   # evicts [1,2,3,5], the least recently used
    assert cache.lookup([1, 2, 3, 5, 1]) is None and cache.lookup([1, 2, 3, 4, 1]) is not None
    assert cache.used_bytes <= cache.capacity_bytes and cache.evictions == 1
    unknown = state([1, 2])
    unknown.tokens = None
    with pytest.raises(ValueError, match="tokens it covers"):
        cache.put(unknown)


def test_prefix_cache_reuse_is_exact(gen):
    from lean_qwenflash.generate import PrefixCache

    g, prompt = gen
    greedy = SamplingParams(temperature=0)
    cached = Generator(g.model, prefill_chunk_tokens=5, prefix_cache=PrefixCache(1 << 30))
    first = cached.start(prompt, greedy, 70, checkpoints=[len(prompt) - 3])
    tokens = list(first)
    assert first.cached_tokens == 0 and first.finish_reason == "length"
    assert first.state.tokens == prompt + tokens[:-1] and first.state.num_tokens == len(prompt) + 69
    assert tokens == list(g.generate(prompt, greedy, 70))
    # The next turn extends the first answer: it starts from the end-of-generation snapshot.
    follow = prompt + tokens + [7, 8]
    second = cached.start(follow, greedy, 12)
    assert list(second) == list(g.generate(follow, greedy, 12))
    assert second.cached_tokens == len(prompt) + 69
    # A prompt that diverges just after the checkpoint starts from the checkpoint's snapshot.
    other = prompt[:-3] + [11, 12, 13]
    third = cached.start(other, greedy, 8)
    assert list(third) == list(g.generate(other, greedy, 8)) and third.cached_tokens == len(prompt) - 3


def test_hooks_force_mask_and_stop(gen):
    import torch
    from lean_qwenflash.generate import TokenHook

    g, prompt = gen
    greedy = SamplingParams(temperature=0)
    plain = list(g.generate(prompt, greedy, 10))

    class Hook(TokenHook):
        def __init__(self):
            self.seen, self.step = [], 0

        def forced(self):
            return 42 if self.step == 2 else None

        def mask(self, logits):
            return logits.index_fill(0, torch.tensor([plain[0]]), float("-inf"))

        def observe(self, token):
            self.seen.append(token)
            self.step += 1

    hook = Hook()
    run = g.start(prompt, greedy, 10, hooks=[hook])
    out = []
    for token in run:
        out.append(token)
        if len(out) == 6:
            run.stop("client")
    assert out[0] != plain[0] and out[2] == 42 and plain[0] not in [out[i] for i in (0, 1, 3, 4, 5)]
    assert hook.seen == out and len(out) == 6 and run.finish_reason == "client"
    # A forced token is emitted even when it is a stop token; a sampled one ends the generation.
    assert list(g.start(prompt, greedy, 4, stop_token_ids=[42], hooks=[Hook()]))[2] == 42


def test_interleaved_steps_equal_separate_runs(gen):
    g, prompt = gen
    greedy = SamplingParams(temperature=0)
    other = prompt[::-1]
    runs = [g.start(prompt, greedy, 9), g.start(other, SamplingParams(temperature=1.0, seed=5), 7)]
    out = [[], []]
    while not all(r.done for r in runs):
        for i, r in enumerate(runs):
            token = r.step()
            if token is not None:
                out[i].append(token)
    assert out[0] == list(g.generate(prompt, greedy, 9))
    assert out[1] == list(g.generate(other, SamplingParams(temperature=1.0, seed=5), 7))


def test_stop_during_a_long_prefill_ends_before_the_next_chunk(gen):
    g, prompt = gen
    chunked = Generator(g.model, prefill_chunk_tokens=4)
    run = chunked.start(prompt, SamplingParams(temperature=0), 8)
    assert run.step() is None and run.state.num_tokens == 4          # one chunk
    run.stop("cancelled")
    run.step()
    assert run.done and run.finish_reason == "cancelled" and run.state.num_tokens == 4 and run.num_generated == 0


@pytest.mark.parametrize("temperature", [1e-30, 1e-300, 5e-324])
def test_a_tiny_temperature_samples_the_best_token_instead_of_failing(temperature):
    """logits / temperature overflows to inf for a tiny positive temperature; softmax of inf is nan
    and torch.multinomial raised (a server 500 found by the OpenAPI fuzz test). It must pick the
    best token, as the limit of sampling at that temperature does."""
    import torch
    from lean_qwenflash.generate.sampling import Sampler
    logits = torch.tensor([1.5, 40.0, -3.0, 39.0, 0.0])
    for top_p, top_k, min_p in ((1.0, 0, 0.0), (0.9, 3, 0.1)):
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=3)
        sampler = Sampler(params, vocab_size=5, prompt_ids=[0])
        assert [sampler.sample(logits) for _ in range(5)] == [1] * 5
