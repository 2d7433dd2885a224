"""The decode loop (it exists once): prefill in chunks, then sample token by token.

``Generator.start`` returns a ``Generation``: iterate it for token ids, or drive it with ``step()``
(the server interleaves several generations, one step each in turn). Per-token control comes from
``TokenHook``s — forced tokens (a thinking budget running out), logit masks (grammar-constrained
tool calls and JSON) — and the caller may ``stop()`` a generation between tokens (a stop string
matched, the client left). With a ``PrefixCache`` the generator starts each prompt from the longest
snapshot it extends and takes new snapshots (see ``generate/prefix.py``).

Log-probabilities: ``LogprobCapture`` (a hook) records each emitted token's; ``start(...,
prompt_logprobs=k)`` also records the prompt's (echo); ``start(..., continuations=[...])`` scores
given continuations from the prompt's state instead of generating (choice mode); ``sibling()`` is
another sample of the same prompt decoded from a copy of its prefilled state (n > 1). Every
logprob here is the log-softmax of the model's logits after the hooks' masks (tokens a grammar
forbids at -inf, the rest renormalised), before temperature, penalties and top-k/top-p/min-p: the
model's own distribution over what was allowed (OpenAI's convention), whatever the sampling.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator, Optional, Sequence

import torch

from lean_qwenflash.generate.budget import prefill_chunk_tokens as automatic_chunk
from lean_qwenflash.generate.prefix import PrefixCache
from lean_qwenflash.generate.sampling import Sampler, SamplingParams
from lean_qwenflash.generate.state import ModelState, new_state


class TokenHook:
    """Per-token control of one generation; every method is optional (the defaults do nothing).

    Called in this order for each new token: ``forced()`` (a token to emit without sampling, or
    None), then, only when sampling, ``mask(logits)`` (return the logits with disallowed tokens at
    -inf), then ``observe(token)`` for the token emitted, forced or sampled. ``start(generation)``
    is called once, when the ``Generation`` is made (a hook that reports on it keeps it).
    """

    def start(self, generation: "Generation") -> None:
        pass

    def forced(self) -> Optional[int]:
        return None

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def observe(self, token_id: int) -> None:
        pass


@dataclass
class TokenLogprob:
    """One position's log-probabilities: the token's, and the ``top`` most likely (id, logprob),
    best first (as many as were asked for). A prompt's first token has neither (None)."""
    token: int
    logprob: Optional[float]
    top: Optional[list]


def token_logprob(logprobs: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """The ``TokenLogprob`` of ``token`` in ``logprobs`` [V] (a log-softmax)."""
    best = []
    if top:
        values, ids = torch.topk(logprobs, min(top, logprobs.shape[-1]))
        best = [(i, v) for i, v in zip(ids.tolist(), values.tolist()) if v != float("-inf")]
    return TokenLogprob(int(token), float(logprobs[token]), best)


def token_logprobs(logprobs: torch.Tensor, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """``token_logprob`` of ``tokens[i]`` in each row ``logprobs[i]`` ([T, V], a log-softmax): one
    gather, one top-k and one device-to-host transfer for all rows (echo and choice scoring)."""
    rows = logprobs[:len(tokens)]
    ids = torch.tensor([int(t) for t in tokens], dtype=torch.long, device=rows.device)
    chosen = rows.gather(1, ids[:, None])[:, 0].tolist()
    if not top:
        return [TokenLogprob(int(t), float(v), []) for t, v in zip(tokens, chosen)]
    values, best = torch.topk(rows, min(top, rows.shape[-1]), dim=-1)
    return [TokenLogprob(int(t), float(v), [(i, b) for i, b in zip(bi, bv) if b != float("-inf")])
            for t, v, bi, bv in zip(tokens, chosen, best.tolist(), values.tolist())]


class LogprobCapture(TokenHook):
    """Records a ``TokenLogprob`` for every emitted token (``entries``, in order), of the
    distribution it was sampled from: the log-softmax of the logits after the masks of the hooks
    before this one (put it last), no temperature or filters (see the module docstring). A forced
    token (a thinking budget's close) was not sampled: its logprob is 0 (probability 1).
    ``generation`` is the one it runs in (its prompt logprobs and scores are read from there)."""

    def __init__(self, top: int = 0):
        if top < 0:
            raise ValueError(f"top={top} must be >= 0")
        self.top = top
        self.entries: list[TokenLogprob] = []
        self.generation: Optional["Generation"] = None
        self._logprobs = None

    def start(self, generation: "Generation") -> None:
        self.generation = generation

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        self._logprobs = torch.log_softmax(logits.float(), dim=-1)
        return logits

    def observe(self, token_id: int) -> None:
        logprobs, self._logprobs = self._logprobs, None
        if logprobs is None:            # forced: no mask() this step
            self.entries.append(TokenLogprob(int(token_id), 0.0, [(int(token_id), 0.0)][:self.top]))
        else:
            self.entries.append(token_logprob(logprobs, token_id, self.top))


@dataclass
class ContinuationScore:
    """A continuation's log-likelihood after the prompt: one ``TokenLogprob`` per token."""
    index: int                  # its place in the list given
    tokens: list
    logprobs: list              # [TokenLogprob]

    @property
    def total(self) -> float:
        return sum(e.logprob for e in self.logprobs)

    @property
    def mean(self) -> float:
        return self.total / len(self.logprobs)


def continuation_ids(encode, prompt_ids: Sequence[int], prompt_text: Optional[str], text: str) -> list[int]:
    """The token ids ``text`` has after the prompt: the tail of ``encode(prompt_text + text)`` when
    that starts with the prompt's ids (the tokenization the model would see), else ``encode(text)``."""
    if prompt_text is not None:
        joint = encode(prompt_text + text)
        if len(joint) > len(prompt_ids) and joint[:len(prompt_ids)] == list(prompt_ids):
            return joint[len(prompt_ids):]
    return encode(text)


_NEEDS_LOGITS = object()     # what a decode step yields to its driver: "feed my token, send me the logits"


class Generation:
    """One running generation. Iterating yields token ids; ``step()`` advances by one unit of work
    (a prefill chunk or one token) and returns the new token id or None.

    After it ends, ``finish_reason`` is "stop" (a stop token, or ``stop("stop")``), "length", or
    what ``stop()`` was given; ``state`` covers the prompt and every yielded token but the last.
    ``prompt_logprobs`` (echo) and ``scores`` (choice mode) hold what ``Generator.start`` asked for.
    """

    def __init__(self, gen: "Generator", prompt_ids: list[int], sampler: Sampler, max_new_tokens: int,
                 stop: set, state: Optional[ModelState], hooks: Sequence[TokenHook], checkpoints: Sequence[int],
                 prompt_logprobs: Optional[int] = None, continuations: Optional[Sequence[Sequence[int]]] = None,
                 score_top: int = 0, leader: Optional["Generation"] = None):
        self.generator = gen
        self.prompt_ids = prompt_ids
        self.sampler = sampler
        self.max_new_tokens = max_new_tokens
        self.stop_ids = stop
        self.state = state
        self.hooks = list(hooks)
        self.leader = leader                        # a sibling's: whose prompt state it starts from
        # prompt tokens reused from a snapshot (a sibling's: all of them, from its leader's prefill)
        self.cached_tokens = len(prompt_ids) if leader is not None else state.num_tokens
        # where snapshots go: nowhere when the state cannot say which tokens it holds
        self.cache = (leader.cache if leader is not None else
                      gen.prefix_cache if state.tokens is not None else None)
        self.checkpoints = [] if leader is not None else sorted(
            p for p in set(checkpoints) if self.cached_tokens < p < len(prompt_ids))
        self.prompt_logprobs_top = prompt_logprobs
        # with prompt_logprobs: a TokenLogprob per prompt token (the first's logprob and top None)
        self.prompt_logprobs: Optional[list] = None
        self.continuations = None if continuations is None else [list(c) for c in continuations]
        self.score_top = score_top
        self.scores: Optional[list[ContinuationScore]] = None      # with continuations, once done
        self._waiting_siblings = 0
        self._shared: Optional[list] = None         # [prompt state, its logits] for the siblings
        self.num_generated = 0
        self.prefilled = False
        self.done = False
        self.finish_reason: Optional[str] = None
        self._stop_request: Optional[str] = None
        self._boundary: Optional[ModelState] = None
        self._closed = False
        self._stepped = False
        self._next_input: Optional[int] = None      # the token a decode step feeds next
        self._steps = self._run()
        for hook in self.hooks:
            hook.start(self)

    def sibling(self, params: SamplingParams, hooks: Sequence[TokenHook] = ()) -> "Generation":
        """Another sample of this prompt (n > 1) with its own sampling and hooks: it waits for this
        generation's prefill, then decodes from a copy of the prompt's state, so the prompt is
        computed once. Make siblings before this generation's first step."""
        if self._stepped or self.leader is not None:
            raise RuntimeError("siblings are made from a generation that has not started, and not from a sibling")
        if self.continuations is not None:
            raise ValueError("a scoring generation (continuations) has no siblings")
        self._waiting_siblings += 1
        return Generation(self.generator, self.prompt_ids, self.generator.sampler(params, self.prompt_ids),
                          self.max_new_tokens, self.stop_ids, None, hooks, (), leader=self)

    # -- driving ------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[int]:
        while not self.done:
            token = self.step()
            if token is not None:
                yield token
        self.close()

    def step(self) -> Optional[int]:
        """One unit of work; the new token id, or None (a prefill chunk, or the end: see ``done``)."""
        out = self._advance(None)
        if out is _NEEDS_LOGITS:
            try:
                logits = self.generator.feed([self._next_input], self.state)
            except BaseException:
                self.fail()         # (the state may be half-updated: close() must not keep it)
                raise
            out = self._advance(logits)
        return out

    def _advance(self, logits: Optional[torch.Tensor]):
        """Run the loop to its next stop: a token id, None, or ``_NEEDS_LOGITS`` (a decode step
        waits for the logits after ``_next_input``: ``step`` computes them alone,
        ``Generator.step_all`` for several generations in one forward); ``logits`` answers the
        previous ``_NEEDS_LOGITS``."""
        if self.done:
            return None
        self._stepped = True
        try:
            return next(self._steps) if logits is None else self._steps.send(logits)
        except StopIteration:
            self.done = True
            return None
        except BaseException:
            self.fail()
            raise

    def fail(self) -> None:
        """End with finish_reason "error" (a step raised: the state may be half-updated)."""
        self.done = True
        self.finish_reason = self.finish_reason or "error"

    def stop(self, reason: str = "stop") -> None:
        """End before the next token is computed; ``reason`` becomes ``finish_reason``."""
        if self._stop_request is None:
            self._stop_request = reason

    def close(self) -> None:
        """Store the end-of-generation snapshots in the prefix cache (once; after the caller has
        answered its client, so this costs the client no latency). The state is not used again."""
        if self._closed:
            return
        self._closed = True
        cache = self.cache
        if cache is None or self.finish_reason == "error":
            return      # (an interrupted step may have left the state half-updated: never keep it)
        if self._boundary is not None:
            cache.put(self._boundary, copy=False)
        if self.prefilled:
            cache.put(self.state, copy=False)

    # -- the loop -------------------------------------------------------------------------------

    def _run(self):
        if self.max_new_tokens == 0 and self.prompt_logprobs_top is None and self.continuations is None:
            self.finish_reason = "length"
            return
        logits = yield from (self._prefill() if self.leader is None else self._from_leader())
        if logits is None:
            return
        if self.continuations is not None:
            yield from self._score(logits)
        else:
            yield from self._decode(logits)

    def _prefill(self):
        """Prefill in chunks, snapshotting at the caller's checkpoints and at the prompt's end;
        returns the logits after the prompt (None: stopped first)."""
        gen, state, prompt, cache = self.generator, self.state, self.prompt_ids, self.cache
        pos = state.num_tokens
        top = self.prompt_logprobs_top
        if top is not None:     # (start() fed nothing yet: pos is 0) the first token has no context
            self.prompt_logprobs = [TokenLogprob(prompt[0], None, None)]
        chunk = gen.prefill_chunk_tokens if top is None else gen.scoring_chunk_tokens
        logits = None
        for mark in self.checkpoints + [len(prompt)]:
            while pos < mark:
                if self._stop_request is not None:      # e.g. the client left during a long prefill
                    self.finish_reason = self._stop_request
                    return None
                end = min(mark, pos + chunk)
                if top is None:
                    logits = gen.feed(prompt[pos:end], state)
                else:
                    rows = torch.log_softmax(gen.feed(prompt[pos:end], state, all_logits=True).float(), dim=-1)
                    self.prompt_logprobs.extend(token_logprobs(rows, prompt[pos + 1:end + 1], top))
                    logits = rows[-1]
                pos = end
                if pos < len(prompt):
                    yield None
            if cache is not None:
                cache.put(state)
        self.prefilled = True
        if self._waiting_siblings:
            self._shared = [state.clone(), logits.clone()]
        if self.max_new_tokens == 0 and self.continuations is None:
            self.finish_reason = "length"
            return None
        return logits

    def _from_leader(self):
        """A sibling: wait for the leader's prefill, then take a copy of its prompt state (the
        last sibling to start takes the leader's copy itself)."""
        leader = self.leader
        while leader._shared is None:
            if self._stop_request is not None:
                self.finish_reason = self._stop_request
                return None
            if leader.done or leader.finish_reason is not None:     # it ended before its prefill did
                self.finish_reason = leader.finish_reason or "error"
                return None
            yield None
        state, logits = leader._shared
        leader._waiting_siblings -= 1
        if leader._waiting_siblings:
            state, logits = state.clone(), logits.clone()
        else:
            leader._shared = None
        self.state = state
        self.prompt_logprobs = leader.prompt_logprobs     # (echo: the prompt is the same)
        self.prefilled = True
        return logits

    def _score(self, logits: torch.Tensor):
        """Choice mode: each continuation's logprobs from a copy of the prompt's state, one per step."""
        gen, top = self.generator, self.score_top
        first = torch.log_softmax(logits.float(), dim=-1)
        self.scores = []
        for index, tokens in enumerate(self.continuations):
            if self._stop_request is not None:
                self.finish_reason = self._stop_request
                return
            entries = [token_logprob(first, tokens[0], top)]
            state = self.state.clone()
            state.tokens = None         # a scratch copy: never a prefix snapshot
            for start in range(0, len(tokens) - 1, gen.scoring_chunk_tokens):
                part = tokens[start:start + gen.scoring_chunk_tokens + 1]
                rows = torch.log_softmax(gen.feed(part[:-1], state, all_logits=True).float(), dim=-1)
                entries.extend(token_logprobs(rows, part[1:], top))
            self.scores.append(ContinuationScore(index, tokens, entries))
            if index + 1 < len(self.continuations):
                yield None
        self.finish_reason = "stop"

    def _decode(self, logits: torch.Tensor):
        """The decode loop: from the logits after the prompt, one token per step."""
        gen, state, cache = self.generator, self.state, self.cache
        for step in range(self.max_new_tokens):
            if self._stop_request is not None:
                self.finish_reason = self._stop_request
                return
            token = None
            for hook in self.hooks:
                token = hook.forced()
                if token is not None:
                    break
            if token is None:
                for hook in self.hooks:
                    logits = hook.mask(logits)
                token = self.sampler.sample(logits)
                if token in self.stop_ids:
                    self.finish_reason = "stop"
                    return
            self.sampler.observe(token)
            for hook in self.hooks:
                hook.observe(token)
            self.num_generated += 1
            yield token
            if self._stop_request is not None:
                self.finish_reason = self._stop_request
                return
            if step + 1 == self.max_new_tokens:
                break
            self._next_input = token
            logits = yield _NEEDS_LOGITS            # gen.feed([token], state), alone or batched
            if cache is not None and state.num_tokens % gen.block_tokens == 0:
                self._boundary = state.clone()
        self.finish_reason = "length"


class Generator:
    """Runs sequences on a model built by ``lean_qwenflash.models``.

    ``prefill_chunk_tokens`` bounds the activations of one prefill forward (long prompts are fed
    in chunks that continue the same state); 0: the automatic chunk for the model's shape
    (``budget.prefill_chunk_tokens``, what ``Runtime.prefill_chunk_tokens`` gives by default).
    ``prefix_cache`` (optional) enables prefix reuse.
    """

    block_tokens = 64       # while generating, a snapshot is kept at the last multiple of this
    scoring_logits_bytes = 256 << 20    # a forward whose every position's logits are kept holds at most this

    def __init__(self, model, prefill_chunk_tokens: int = 0, prefix_cache: Optional[PrefixCache] = None):
        if prefill_chunk_tokens < 0:
            raise ValueError(f"prefill_chunk_tokens={prefill_chunk_tokens} must be >= 1 (0: automatic)")
        self.model = model
        self.prefill_chunk_tokens = prefill_chunk_tokens or automatic_chunk(model.config)
        # None when there is no cache or it is off (capacity 0): one test everywhere below
        self.prefix_cache = prefix_cache if prefix_cache is not None and prefix_cache.enabled else None
        embed = model.model.embed_tokens
        self.device = (embed.qweight.raw if embed.qweight is not None else embed.weight).device
        self.vocab_size = embed.num_embeddings
        # tokens per forward when every position's logits are kept (echo, scoring): fp32 [T, V] bounded
        self.scoring_chunk_tokens = max(1, min(self.prefill_chunk_tokens,
                                               self.scoring_logits_bytes // (8 * self.vocab_size)))
        self._token_buf = torch.empty(1, 1, dtype=torch.long, device=self.device)

    def new_state(self) -> ModelState:
        return new_state(self.model)

    def feed(self, token_ids: Sequence[int], state: ModelState, all_logits: bool = False) -> torch.Tensor:
        """Run ``token_ids`` through the model, continuing ``state``; the logits [V] after the last
        (``all_logits``: after each, [T, V])."""
        if len(token_ids) == 1:
            self._token_buf.fill_(int(token_ids[0]))
            ids = self._token_buf
        else:
            ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)
        logits = self.model(ids, state, last_logits_only=not all_logits)[0]
        logits = logits if all_logits else logits[-1]
        if state.tokens is not None:
            state.tokens.extend(int(t) for t in token_ids)
        return logits

    def feed_rows(self, token_ids: Sequence[int], states: Sequence[ModelState]) -> torch.Tensor:
        """One token into each of several states in one forward (``CausalLM.forward_rows``); the
        logits [B, V] after each."""
        if len(token_ids) == 1:
            return self.feed(token_ids, states[0])[None]
        ids = torch.tensor([int(t) for t in token_ids], dtype=torch.long, device=self.device)
        logits = self.model.forward_rows(ids, list(states))
        for state, token in zip(states, token_ids):
            if state.tokens is not None:
                state.tokens.append(int(token))
        return logits

    def step_all(self, generations: Sequence[Generation]) -> list:
        """One unit of work for each generation, the decode steps together: every generation that
        is decoding feeds its token in one ``feed_rows`` forward (the experts its rows share are
        acquired once), one that is prefilling runs its next chunk. Returns, per generation, the new
        token id, None (a prefill chunk, or it ended) or the exception its step raised (the
        generation is then done, finish_reason "error"; the others went on)."""
        results: list = [None] * len(generations)
        waiting = []
        for i, g in enumerate(generations):
            try:
                out = g._advance(None)
            except Exception as exc:
                results[i] = exc
                continue
            if out is _NEEDS_LOGITS:
                waiting.append(i)
            else:
                results[i] = out
        if not waiting:
            return results
        try:
            logits = self.feed_rows([generations[i]._next_input for i in waiting],
                                    [generations[i].state for i in waiting])
        except Exception as exc:
            for i in waiting:
                generations[i].fail()
                results[i] = exc
            return results
        for row, i in enumerate(waiting):
            try:
                results[i] = generations[i]._advance(logits[row])
            except Exception as exc:
                results[i] = exc
        return results

    def prefill(self, token_ids: Sequence[int], state: ModelState) -> torch.Tensor:
        """Feed ``token_ids`` into ``state`` in chunks; returns the logits [V] after the last one."""
        logits = None
        for start in range(0, len(token_ids), self.prefill_chunk_tokens):
            logits = self.feed(token_ids[start:start + self.prefill_chunk_tokens], state)
        return logits

    def sampler(self, params: SamplingParams, prompt_ids: Sequence[int]) -> Sampler:
        return Sampler(params, self.vocab_size, list(prompt_ids), self.device)

    def start(self, prompt_ids: Sequence[int], params: SamplingParams = SamplingParams(),
              max_new_tokens: int = 256, stop_token_ids: Iterable[int] = (),
              state: Optional[ModelState] = None, hooks: Sequence[TokenHook] = (),
              checkpoints: Sequence[int] = (), prompt_logprobs: Optional[int] = None,
              continuations: Optional[Sequence[Sequence[int]]] = None, score_top: int = 0) -> Generation:
        """A ``Generation`` of up to ``max_new_tokens`` new tokens; a sampled stop token ends it
        unyielded (a forced one does not). Nothing runs until it is iterated or stepped.

        ``state``, when given, already holds the first ``state.num_tokens`` tokens of
        ``prompt_ids``; only the rest is prefilled, and the state is updated in place. Without one,
        the prefix cache (if any) supplies the longest snapshot the prompt extends.
        ``checkpoints``: prompt lengths worth a snapshot (e.g. turn boundaries).
        ``prompt_logprobs=k``: also record every prompt token's logprob and its k best
        (``Generation.prompt_logprobs``; the whole prompt is computed, no snapshot is reused).
        ``continuations``: score these token sequences after the prompt instead of generating
        (``Generation.scores``; each position lists its ``score_top`` best tokens too).
        """
        prompt_ids = [int(t) for t in prompt_ids]
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} outside the vocabulary [0, {self.vocab_size})")
        if continuations is not None:
            continuations = [[int(t) for t in c] for c in continuations]
            if not continuations or not all(continuations):
                raise ValueError("continuations must be a non-empty list of non-empty token sequences")
            bad = [t for c in continuations for t in c if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"continuation token ids {bad[:5]} outside the vocabulary [0, {self.vocab_size})")
        echo = prompt_logprobs is not None
        if echo and state is not None and state.num_tokens:
            raise ValueError("prompt_logprobs needs the whole prompt computed: give no state (or an empty one)")
        if state is None and self.prefix_cache is not None and not echo:
            state = self.prefix_cache.lookup(prompt_ids)
        if state is None:
            state = self.new_state()
        if not state.num_tokens < len(prompt_ids):
            raise ValueError(f"the prompt ({len(prompt_ids)} tokens) must extend the state's "
                             f"{state.num_tokens} tokens by at least one")
        if state.tokens is not None and (len(state.tokens) != state.num_tokens
                                         or state.tokens != prompt_ids[:state.num_tokens]):
            state.tokens = None      # the caller's state holds other tokens than it claims: don't cache it
        scoring = continuations is not None
        return Generation(self, prompt_ids, self.sampler(params, prompt_ids), 0 if scoring else max_new_tokens,
                          set(int(t) for t in stop_token_ids), state, hooks, checkpoints,
                          prompt_logprobs=prompt_logprobs, continuations=continuations, score_top=score_top)

    def score(self, prompt_ids: Sequence[int], continuations: Sequence[Sequence[int]], top: int = 0,
              state: Optional[ModelState] = None) -> list[ContinuationScore]:
        """Each continuation's log-likelihood after ``prompt_ids`` (in the order given), from one
        prefill of the prompt: every continuation is fed from a copy of the prompt's state."""
        run = self.start(prompt_ids, max_new_tokens=0, state=state, continuations=continuations, score_top=top)
        for _ in run:
            pass
        run.close()
        return run.scores

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams = SamplingParams(),
                 max_new_tokens: int = 256, stop_token_ids: Iterable[int] = (),
                 state: Optional[ModelState] = None, hooks: Sequence[TokenHook] = ()) -> Generation:
        """``start`` under its older name: iterate the result for the token ids."""
        return self.start(prompt_ids, params, max_new_tokens, stop_token_ids, state, hooks)
