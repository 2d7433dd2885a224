"""Batched decode: the generations of a step advance in one forward (``Generator.step_all``)."""
import asyncio

import pytest
import torch

from lean_qwenflash.config import load_config
from lean_qwenflash.generate import Generator, SamplingParams
from lean_qwenflash.loader import load_hf_checkpoint
from lean_qwenflash.models.policy import ExecPolicy
from lean_qwenflash.runtime import Runtime
from lean_qwenflash.store import ExpertStore, pack

hf_models = pytest.importorskip("hf_models")

GREEDY = SamplingParams(temperature=0.0)
# Three sequences: different prompt lengths, the second ends early (max_new_tokens), the third on a
# stop token chosen from its own solo run.
LENGTHS, MAX_NEW = (40, 13, 27), (12, 4, 12)


def _prompts(c):
    p = c.prompt[0].tolist()
    return [p[:n] for n in LENGTHS]


def _solo(g, prompts, stops):
    return [list(g.start(q, GREEDY, m, stop_token_ids=s)) for q, m, s in zip(prompts, MAX_NEW, stops)]


def _batched(g, prompts, stops, params=(GREEDY,) * 3):
    """Drive the three generations with ``step_all`` until all are done; tokens per generation,
    and the number of steps in which more than one generation fed a token together."""
    gens = [g.start(q, p, m, stop_token_ids=s) for q, p, m, s in zip(prompts, params, MAX_NEW, stops)]
    out = [[] for _ in gens]
    while not all(x.done for x in gens):
        live = [i for i, x in enumerate(gens) if not x.done]
        for i, r in zip(live, g.step_all([gens[i] for i in live])):
            assert not isinstance(r, Exception), r
            if r is not None:
                out[i].append(r)
    return out, gens


def _stops(g, prompts):
    """No stop for the first two; for the third, a greedy token of its own that first comes 5th or
    later (so it stops early, after the second has ended)."""
    third = list(g.start(prompts[2], GREEDY, MAX_NEW[2]))
    at = next((i for i in range(4, len(third)) if third[i] not in third[:i]), None)
    assert at is not None, f"no fresh token after the 4th in {third}"
    return [(), (), (third[at],)], third[:at]


@pytest.mark.parametrize("family", list(hf_models.FAMILIES))
def test_batched_equals_solo_exact(family, monkeypatch):
    c = hf_models.case(family)
    model, _ = load_hf_checkpoint(c.path)
    model.set_policy(ExecPolicy(kernel_mode="exact"))
    g = Generator(model)
    prompts = _prompts(c)
    stops, third = _stops(g, prompts)
    solo = _solo(g, prompts, stops)
    assert solo[2] == third and len(solo[1]) == MAX_NEW[1]
    rows = []
    forward_rows = model.forward_rows
    monkeypatch.setattr(model, "forward_rows", lambda ids, states: rows.append(len(states)) or forward_rows(ids, states))
    batched, gens = _batched(g, prompts, stops)
    assert batched == solo
    assert max(rows) == 3 and 2 in rows       # all three stepped together, then the rest after one ended
    assert [x.finish_reason for x in gens] == ["length", "length", "stop"]


@pytest.mark.parametrize("family", ["qwen3_next", "deepseek_v3"])
def test_batched_fast_mode_rows_match_solo_logits(family):
    """Fast mode shares kernel calls between rows (one MoE call, one head product); each row's
    logits stay within fast mode's rounding of the same sequence stepped alone."""
    c = hf_models.case(family)
    model, _ = load_hf_checkpoint(c.path)
    model.set_policy(ExecPolicy(kernel_mode="fast"))
    g = Generator(model)
    prompts = _prompts(c)
    states = [g.new_state() for _ in prompts]
    firsts = [int(g.prefill(q, s).argmax()) for q, s in zip(prompts, states)]
    copies = [s.clone() for s in states]
    solo = torch.stack([g.feed([t], s) for t, s in zip(firsts, states)])
    rows = g.feed_rows(firsts, copies)
    assert rows.shape == solo.shape
    torch.testing.assert_close(rows, solo, atol=2e-4, rtol=2e-4)
    assert [s.num_tokens for s in copies] == [s.num_tokens for s in states]
    assert copies[0].tokens == states[0].tokens


def test_batched_sampling_keeps_each_rows_own_sampler():
    """Seeded sampling per row: the same tokens batched as alone."""
    c = hf_models.case("qwen3_moe")
    model, _ = load_hf_checkpoint(c.path)
    model.set_policy(ExecPolicy(kernel_mode="exact"))
    g = Generator(model)
    prompts = _prompts(c)
    params = [SamplingParams(temperature=0.9, top_k=20, seed=s) for s in (1, 2, 3)]
    solo = [list(g.start(q, p, m)) for q, p, m in zip(prompts, params, MAX_NEW)]
    batched, _ = _batched(g, prompts, [(), (), ()], params)
    assert batched == solo


@pytest.fixture(scope="module")
def streamed_pack(tmp_path_factory):
    c = hf_models.case("qwen3_moe")
    out = tmp_path_factory.mktemp("pack") / "qwen3_moe"
    pack(c.path, out, progress=False)
    return c, out


def _cache_smaller_than_a_token(c, pack_dir) -> int:
    """A host cache of top-k slots fewer than one token's experts over all layers: a sequence
    stepped alone has evicted a layer's experts by the time the next sequence comes to that layer,
    so each reads them again; stepped together, the rows' union is read once per layer."""
    store = ExpertStore.open(pack_dir)
    try:
        top_k = int(c.config["num_experts_per_tok"])
        return top_k * (len(store.moe_layers) - 1) * store.max_record_bytes
    finally:
        store.close()


def test_streamed_batched_reads_each_shared_expert_once(streamed_pack):
    c, pack_dir = streamed_pack
    # (lru: the cyclic pattern of sequences stepped alone is what evicts each layer's experts
    # before the next sequence needs them; lfu would keep the most used ones instead)
    cfg = dict(model=str(pack_dir), host_cache_bytes=_cache_smaller_than_a_token(c, pack_dir), prefetch=False,
               expert_kernels="exact", cache_policy="lru")
    prompts = _prompts(c)
    read = {}
    tokens = {}
    for how in ("interleaved", "batched"):
        with Runtime.open(load_config(**cfg)) as rt:
            g = Generator(rt.model)
            gens = [g.start(q, GREEDY, m) for q, m in zip(prompts, MAX_NEW)]
            for x in gens:                      # the prompts first, alone: only the decode differs
                while not x.prefilled:
                    x.step()
            before = rt.stats()["total"]["bytes_read"]
            out = [[] for _ in gens]
            while not all(x.done for x in gens):
                live = [i for i, x in enumerate(gens) if not x.done]
                if how == "batched":
                    results = g.step_all([gens[i] for i in live])
                else:
                    results = [gens[i].step() for i in live]
                for i, r in zip(live, results):
                    if r is not None:
                        out[i].append(r)
            read[how] = rt.stats()["total"]["bytes_read"] - before
            tokens[how] = out
    assert tokens["batched"] == tokens["interleaved"]
    # three sequences per step share their experts' reads (measured: 0.70x the bytes)
    assert read["batched"] < 0.8 * read["interleaved"], read


def test_engine_steps_its_generations_together(streamed_pack):
    """The server's engine: concurrent jobs decode in shared forwards and get their solo tokens."""
    from lean_qwenflash.server.engine import Engine, Job
    from lean_qwenflash.server.metrics import Metrics

    c, pack_dir = streamed_pack
    prompts = _prompts(c)
    with Runtime.open(load_config(model=str(pack_dir), expert_kernels="exact")) as rt:
        g = Generator(rt.model)
        solo = [list(g.start(q, GREEDY, m)) for q, m in zip(prompts, MAX_NEW)]
        rows = []
        forward_rows = rt.model.forward_rows
        rt.model.forward_rows = lambda ids, states: rows.append(len(states)) or forward_rows(ids, states)

        class Collect:          # the job's output: the token ids (no tokenizer in this pack)
            def __init__(self):
                self.ids, self.stopped = [], False

            def push(self, token):
                self.ids.append(token)
                return []

            def finish(self):
                return []

        async def run():
            engine = Engine(rt.model, 512, max_queue=8, prefix_cache_bytes=0, metrics=Metrics(), max_active=4)
            jobs = [Job(q, GREEDY, m, frozenset(), Collect()) for q, m in zip(prompts, MAX_NEW)]
            for job in jobs:
                engine.submit(job)
            for job in jobs:
                while (await job.events.get())[0] != "done":
                    pass
            engine.close()
            return [job.output.ids for job in jobs]

        assert asyncio.run(run()) == solo
        assert rows and max(rows) >= 2


def test_a_failed_step_ends_its_generations_with_error(monkeypatch):
    """A forward that raises: step_all hands each decoding generation the exception and ends it
    ("error", so close() keeps no half-updated state); a lone step() raises and ends it likewise."""
    c = hf_models.case("qwen3_moe")
    model, _ = load_hf_checkpoint(c.path)
    g = Generator(model)
    prompts = _prompts(c)
    gens = [g.start(q, GREEDY, 8) for q in prompts]
    first = g.step_all(gens)                    # the prompts, then each one's first token
    assert all(isinstance(t, int) for t in first)

    def broken(*args):
        raise RuntimeError("device lost")
    monkeypatch.setattr(model, "forward_rows", broken)
    out = g.step_all(gens)
    assert all(isinstance(r, RuntimeError) for r in out)
    assert all(x.done and x.finish_reason == "error" for x in gens)
    alone = g.start(prompts[0], GREEDY, 8)
    assert isinstance(alone.step(), int)
    monkeypatch.setattr(g, "feed", broken)
    with pytest.raises(RuntimeError):
        alone.step()
    assert alone.done and alone.finish_reason == "error" and alone.step() is None
