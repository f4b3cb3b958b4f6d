"""Speculative decoding: greedy output token for token that of plain decoding (tiny synthetic
models in mixed batches, SmolLM2), rejection sampling that keeps the target's distribution
(a statistical test on a tiny target/draft pair), the plans from costs, prompt lookup."""

import json
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import write_tiny_model

from fastrun.backends import get_backend
from fastrun.formats import GGUFFile
from fastrun.formats.errors import FastrunError
from fastrun.runner import speculative
from fastrun.runner.api import Model
from fastrun.runner.batch import MAX_STEP_TOKENS
from fastrun.runner.models import model_class
from fastrun.runner.sampling import Sampler, SamplingParams
from fastrun.runner.speculative import (
    COST_WEIGHT,
    MIN_SPEEDUP,
    PROBE_WAIT_FIRST,
    STALE_SECONDS,
    SURPRISE_MAX,
    WARM_UP_PASSES,
    Acceptance,
    Draft,
    LookupDrafter,
    NgramIndex,
    PassCosts,
    Probing,
    SpeculativeSettings,
    Speculator,
    check_draft,
    expected_tokens,
    plan_drafts,
)

REPEATING = [5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9, 10, 11, 5, 6, 7]  # lookup finds matches


@pytest.fixture(scope="module")
def draft_model(tmp_path_factory):
    """Another tiny model of the same vocabulary: its drafts are often wrong."""
    return write_tiny_model(tmp_path_factory.mktemp("draft") / "draft.gguf", seed=5, n_layer=1)


def _settings(i: int) -> dict:
    kinds = [dict(), dict(repeat_penalty=1.3), dict(frequency_penalty=0.4, presence_penalty=0.2)]
    return dict(max_tokens=30, temperature=0, ignore_eos=i % 2 == 0, **kinds[i % len(kinds)])


@pytest.mark.parametrize("drafter", ["lookup", "self", "other", "both"])
def test_greedy_speculation_equals_plain_decoding_in_mixed_batches(
    tiny_model, draft_model, drafter
):
    """Six sequences joining at once, batch_size 24: decode tokens, drafts and prefill chunks
    share passes; penalties read the history of accepted drafts."""
    rng = np.random.default_rng(0)
    prompts = [REPEATING[: rng.integers(3, 17)] + rng.integers(0, 296, 20).tolist()]
    prompts += [rng.integers(0, 296, rng.integers(2, 40)).tolist() for _ in range(5)]
    kind = {"plain": {}, "lookup": dict(lookup=True), "self": dict(draft=tiny_model),
            "other": dict(draft=draft_model),
            "both": dict(draft=draft_model, lookup=True)}  # fmt: skip
    got = {}
    for name in ("plain", drafter):
        m = Model(tiny_model, backend="cpu", n_ctx=128, parallel=6, batch_size=24, **kind[name])
        streams = [m.generate(p, **_settings(i)) for i, p in enumerate(prompts)]
        got[name] = []
        for s in streams:
            for _ in s:
                pass
            got[name].append(s.completion.tokens)
        stats = m.stats().get("speculative")
        m.close()
    assert got[drafter] == got["plain"]
    assert stats["rounds"] > 0 and stats["drafted_tokens"] > 0
    if drafter == "self":  # a model drafting for itself is always right
        assert stats["acceptance_rate"] == 1.0


def test_one_loaded_model_switches_drafters_between_requests(tiny_model, draft_model):
    """Model.speculate: plain, lookup and the draft from one load, each greedy output plain
    decoding's; the draft reads the prompt in the prefill, so its passes while drafting run
    a token or two (never the prompt); refused while a request runs, or without a draft."""
    prompt = REPEATING + list(range(40, 60))
    m = Model(tiny_model, backend="cpu", n_ctx=128, parallel=1, draft=draft_model)
    settings = dict(max_tokens=40, temperature=0, ignore_eos=True)
    m.speculate(None)
    expect = m.complete(prompt, **settings).tokens
    for kind in ("lookup", "draft", "lookup+draft", None, "draft"):
        m.speculate(kind)
        assert m.complete(prompt, **settings).tokens == expect, kind
    # probes' catch-ups at most (none where the measured costs said drafting does not pay)
    assert max(m._draft_model.costs.seen, default=0) < len(prompt)
    stream = m.generate(prompt, max_tokens=10**6, ignore_eos=True)  # runs until closed
    next(iter(stream))
    with pytest.raises(FastrunError, match="no request runs"):
        m.speculate("lookup")
    stream.close()
    with pytest.raises(FastrunError, match="unknown speculation"):
        m.speculate("ngram")
    m.close()
    plain = Model(tiny_model, backend="cpu", n_ctx=64, parallel=1)
    with pytest.raises(FastrunError, match="needs a draft model"):
        plain.speculate("draft")
    plain.close()


@pytest.mark.parametrize("plans", ["decline", "as measured"])
@pytest.mark.parametrize("drafter", ["lookup", "draft"])
def test_steps_that_draft_nothing_run_chained_as_plain_decoding(
    tiny_model, draft_model, monkeypatch, drafter, plans
):
    """On a backend that chains greedy steps (chain_steps 4 here, on the CPU), the steps a
    speculating request drafts nothing for run chained, 2 then 4 at a time, between probes;
    its tokens are plain decoding's, also where a chain ends inside a context shift's reach
    and a draft model falls behind by whole chains."""
    prompt = REPEATING + list(range(40, 60))
    settings = dict(max_tokens=70, temperature=0)  # no banned ids: argmax alone
    plain = Model(tiny_model, backend="cpu", n_ctx=64, parallel=1)
    expect = plain.complete(prompt, **settings)
    plain.close()
    kind = dict(lookup=True) if drafter == "lookup" else dict(draft=draft_model)
    m = Model(tiny_model, backend="cpu", n_ctx=64, parallel=1, **kind)
    transformer = m.engine.transformer
    monkeypatch.setattr(transformer.backend, "chain_steps", 4)
    if plans == "decline":
        monkeypatch.setattr(speculative, "plan_drafts", lambda offers, *a, **k: [0] * len(offers))
    chains, run_chain = [], transformer.run_chain
    monkeypatch.setattr(
        transformer, "run_chain", lambda b, c, steps: chains.append(steps) or run_chain(b, c, steps)
    )
    done = m.complete(prompt, **settings)
    stats = m.stats()["speculative"]
    m.close()
    assert done.tokens == expect.tokens and done.context_shifts == expect.context_shifts > 0
    if plans == "decline":
        assert chains[:2] == [2, 4] and stats["rounds"] >= 2  # probes go on between chains
        assert stats["chained_step_ms"]
    assert all(2 <= c <= 4 for c in chains)


def test_checking_passes_are_captured_before_any_request(tiny_model, monkeypatch):
    """Where the backend captures steps (CUDA), switching speculation on runs a checking
    pass of every size drafts can make and a one-token step, once, on an emptied free
    sequence, so that no
    request pays a capture (the CPU captures nothing: patched here); the plans then know
    those sizes cost nothing once more; output unchanged."""
    prompt = REPEATING + list(range(40, 60))
    settings = dict(max_tokens=30, temperature=0)
    m = Model(tiny_model, backend="cpu", n_ctx=96, parallel=2, draft_max=6)
    expect = m.complete(prompt, **settings).tokens
    transformer = m.engine.transformer
    monkeypatch.setattr(transformer.backend, "captures_steps", True)
    sizes, run = [], transformer.run
    monkeypatch.setattr(
        transformer, "run", lambda b, c, k=0, *a: sizes.append((b.n, k)) or run(b, c, k, *a)
    )
    m.speculate("lookup")
    assert sizes == [(n, 1) for n in range(1, 8)] and m.engine._warmed == set(range(1, 8))
    assert all(m._target_costs.one_time(n) == 0.0 for n in range(1, 8))
    lookup = m.engine.speculator
    m.speculate(None)
    m.speculate("lookup")  # once for these cells, whose prefixes then stay
    assert len(sizes) == 7
    assert m.engine.speculator.acceptance is lookup.acceptance  # learned once for the model
    done = m.complete(prompt, **settings)
    m.close()
    # the least recently used sequence ran them: the other kept the prompt's cells
    assert done.tokens == expect and done.prefilled_tokens < len(prompt)


def test_sequences_that_draft_nothing_chain_together(tiny_model, monkeypatch):
    """Three greedy sequences at once, the plans declining: their steps chain together (the
    shortest stretch of any decides), each sequence's tokens its own run's alone."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 296, n).tolist() for n in (9, 20, 14)]
    settings = [dict(max_tokens=n, temperature=0) for n in (40, 25, 33)]
    plain = Model(tiny_model, backend="cpu", n_ctx=96, parallel=1)
    expect = [plain.complete(p, **s).tokens for p, s in zip(prompts, settings, strict=True)]
    plain.close()
    m = Model(tiny_model, backend="cpu", n_ctx=96, parallel=3, lookup=True)
    transformer = m.engine.transformer
    monkeypatch.setattr(transformer.backend, "chain_steps", 4)
    monkeypatch.setattr(speculative, "plan_drafts", lambda offers, *a, **k: [0] * len(offers))
    sizes, run_chain = [], transformer.run_chain
    monkeypatch.setattr(
        transformer,
        "run_chain",
        lambda b, c, steps: sizes.append(len(b.caches)) or run_chain(b, c, steps),
    )
    streams = [m.generate(p, **s) for p, s in zip(prompts, settings, strict=True)]
    for stream in streams:
        for _ in stream:
            pass
    m.close()
    assert [s.completion.tokens for s in streams] == expect
    assert 3 in sizes


def test_greedy_speculation_past_the_context_and_with_stops(tiny_model, draft_model):
    """Context shifts (the draft's cells shift too), max_tokens and stop strings cut a run of
    accepted tokens where plain decoding stops."""
    for kind in (dict(lookup=True), dict(draft=draft_model)):
        for settings in (dict(max_tokens=90, ignore_eos=True), dict(max_tokens=17)):
            plain = Model(tiny_model, backend="cpu", n_ctx=32, parallel=1)
            expect = plain.complete([5, 6, 7], temperature=0, **settings)
            m = Model(tiny_model, backend="cpu", n_ctx=32, parallel=1, **kind)
            done = m.complete([5, 6, 7], temperature=0, **settings)
            assert done.tokens == expect.tokens and done.finish_reason == expect.finish_reason
            assert done.context_shifts == expect.context_shifts
            stop = expect.text[5:7]
            if stop:
                a = plain.complete([5, 6, 7], temperature=0, stop=stop, **settings)
                b = m.complete([5, 6, 7], temperature=0, stop=stop, **settings)
                assert (a.text, a.finish_reason) == (b.text, b.finish_reason)


def _distributions(path, context, params):
    """The sampler's final distribution after `context` and after context + [x] for each x in
    its support: (p0, {x: p1(.|x)})."""
    with GGUFFile(str(path)) as f:
        tf = model_class(f.architecture)(f, get_backend("cpu"))
        sampler = Sampler(params)
        cache = tf.new_cache(64)
        p0 = sampler.distribution(tf.forward(context, cache)[0], context)
        after = {}
        for x in p0[0]:
            cache.trim(len(context))
            after[int(x)] = sampler.distribution(tf.forward([int(x)], cache)[0], [*context, x])
        return p0, after


def _dense(dist, n=300):
    out = np.zeros(n)
    out[dist[0]] = dist[1]
    return out


def test_rejection_sampling_keeps_the_target_distribution(tiny_model):
    """Drafts of two tokens from the draft model's distribution q, checked against the target's
    p: the first two tokens kept (with a plain draw after an early rejection) must be
    distributed as p0(a) p1(b | a), by a chi-square test over the cells."""
    params = SamplingParams(temperature=1.5, top_k=4, top_p=1.0, min_p=0.0)
    context = [5, 6, 7, 8]
    p0, p1 = _distributions(tiny_model, context, params)
    # the draft: the same weights sampled colder and wider, a q that overlaps p but is not p
    q0, q1 = _distributions(tiny_model, context, SamplingParams(0.7, top_k=6, top_p=1.0, min_p=0))
    target = {
        (int(a), int(b)): pa * pb
        for a, pa in zip(*p0, strict=True)
        for b, pb in zip(*p1[int(a)], strict=True)
    }
    rng = np.random.default_rng(11)
    sampler = SimpleNamespace(rng=rng)
    counts: dict = {}
    n = 8000
    accepted = 0
    for _ in range(n):
        x1 = int(q0[0][rng.choice(len(q0[0]), p=q0[1])])
        x2 = int(q1[x1][0][rng.choice(len(q1[x1][0]), p=q1[x1][1])])
        draft = Draft("draft", [x1, x2], [q0, q1[x1]])

        def target_dist(j, x1=x1):  # p1 is asked for only after x1 is accepted: p0 draws it
            return p0 if j == 0 else p1[x1]

        kept, n_accepted = check_draft(draft, target_dist, sampler)
        accepted += n_accepted
        if len(kept) < 2:
            a = kept[0]
            kept.append(int(p1[a][0][rng.choice(len(p1[a][0]), p=p1[a][1])]))
        key = (kept[0], kept[1])
        counts[key] = counts.get(key, 0) + 1
    assert set(counts) <= set(target)
    cells = sorted(target)
    observed = np.array([counts.get(c, 0) for c in cells])
    expected = np.array([target[c] for c in cells]) * n
    assert 0 < accepted < 2 * n  # the pair disagrees sometimes, agrees sometimes
    chi2, dof = float(((observed - expected) ** 2 / expected).sum()), len(cells) - 1
    assert chi2 < dof + 6 * np.sqrt(2 * dof), (chi2, dof)  # six sd above chi-square's mean


def test_lookup_point_mass_and_greedy_checks():
    """Lookup's q is a point mass: accept with p(x), else draw from p without x. Greedy: the
    argmax, with no random number drawn."""
    p = (np.array([3, 1, 2]), np.array([0.5, 0.3, 0.2]))
    rng = np.random.default_rng(0)
    sampler = SimpleNamespace(rng=rng)
    kept = [check_draft(Draft("lookup1", [1]), lambda j: p, sampler)[0][0] for _ in range(20000)]
    freq = np.bincount(kept, minlength=4)[1:] / len(kept)
    np.testing.assert_allclose(freq, [0.3, 0.2, 0.5], atol=0.02)
    greedy = (np.array([7]), np.ones(1))
    silent = SimpleNamespace(rng=None)  # any draw would fail
    assert check_draft(Draft("lookup2", [7, 7]), lambda j: greedy, silent) == ([7, 7, 7], 2)
    four = (np.array([4]), np.ones(1))
    assert check_draft(Draft("draft", [7, 4], [greedy, four]), lambda j: greedy, silent) == (
        [7, 7],
        1,
    )


def _costs(seconds_of) -> PassCosts:
    costs = PassCosts()
    for n in range(1, 17):
        for _ in range(WARM_UP_PASSES + 1):
            costs.record(n, seconds_of(n))
    return costs


def test_plans_follow_costs_and_acceptance():
    flat = _costs(lambda n: 0.010 + 0.0002 * n)  # a GPU: a pass of 16 costs little more
    linear = _costs(lambda n: 0.010 * n)  # a pass per token: checking never pays
    assert plan_drafts([(0.7, 15, 0)], 1, flat, None)[0] >= 6
    assert plan_drafts([(0.7, 15, 0)], 1, linear, None) == [0]
    assert plan_drafts([(0.05, 15, 0)], 1, flat, None)[0] <= 1
    drafting = _costs(lambda n: 0.010)  # a draft pass as slow as the target's: never pays
    assert plan_drafts([(0.9, 15, 1)], 1, flat, drafting) == [0]
    assert plan_drafts([(0.9, 15, 0)], 1, flat, drafting)[0] > 3  # lookup's, beside it
    cheap = _costs(lambda n: 0.001 * n)
    assert 3 <= plan_drafts([(0.8, 15, 1)], 1, flat, cheap)[0] <= 15
    # a draft that fell far behind must first run what it missed: not worth it for one step
    assert plan_drafts([(0.6, 15, 16)], 1, flat, _costs(lambda n: 0.003 * n)) == [0]
    # two sequences: the likelier one drafts more
    a, b = plan_drafts([(0.9, 15, 0), (0.4, 15, 0)], 2, flat, None)
    assert a > b
    assert plan_drafts([(0.9, 8, 0)], 1, PassCosts(), None) == [0]  # nothing measured yet


# A 2-core CPU: a pass of n tokens costs 1 + 0.15 (n - 1) decode steps, a draft step 0.37 of
# one (Qwen2.5-Coder 0.5B drafting for 1.5B). What pays follows from these and the acceptance.
CPU_TARGET = _costs(lambda n: 0.100 * (1 + 0.15 * (n - 1)))
CPU_DRAFT = _costs(lambda n: 0.037 * (1 + 0.2 * (n - 1)))


def _best_k(rate: float, target: PassCosts, draft_step: float, most: int = 15) -> int:
    """The k of the most expected tokens per second, 0 unless it beats plain decoding by
    MIN_SPEEDUP: the plan of one sequence, by brute force."""
    speed = [expected_tokens(rate, k) / (target.estimate(k + 1) + k * draft_step)
             for k in range(most + 1)]  # fmt: skip
    k = int(np.argmax(speed))
    return k if speed[k] > MIN_SPEEDUP * speed[0] else 0


@pytest.mark.parametrize("rate", [0.1, 0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95])
@pytest.mark.parametrize("costly", [False, True])
def test_plans_choose_no_drafts_when_speculation_cannot_pay_and_the_best_k_when_it_does(
    rate, costly
):
    draft_step = CPU_DRAFT.estimate(1) if costly else 0.0
    plan = plan_drafts([(rate, 15, int(costly))], 1, CPU_TARGET, CPU_DRAFT if costly else None)
    assert plan == [_best_k(rate, CPU_TARGET, draft_step)]
    if costly and rate <= 0.5:  # the 0.5B's own steps cost too much for a draft this poor
        assert plan == [0]
    if not costly and rate >= 0.5:  # lookup is free: a draft of a few tokens pays
        assert plan[0] >= 2


def test_pass_costs_estimates_of_sizes_not_measured():
    costs = PassCosts()
    costs.record(1, 9.0)  # warm-up: not measured
    assert costs.estimate(1) is None
    costs.record(1, 1.0)
    assert costs.estimate(2) == 1.0  # one size known: a larger one is tried once, then known
    costs.record(9, 0.0)
    costs.record(9, 3.0)
    assert costs.estimate(1) == 1.0 and costs.estimate(9) == 3.0
    assert costs.estimate(5) == pytest.approx(2.0)  # on the line between 1 and 9
    assert costs.estimate(10) == 3.0  # the next size up: tried once, then known
    assert costs.estimate(17) == pytest.approx(4.75)  # past it, along the slope of 1 and 9
    costs.record(12, 0.0)
    costs.record(12, 2.0)  # cheaper than 9 (noise): never less than the largest
    assert costs.estimate(20) == 2.0


def test_pass_costs_follow_the_load_and_shrug_off_a_stall():
    costs = PassCosts()
    for n, seconds in ((1, 1.0), (4, 2.0)):
        costs.record(n, seconds)
        costs.record(n, seconds)
    costs.record(1, 50.0)  # the machine stalled once
    assert costs.estimate(1) <= SURPRISE_MAX**COST_WEIGHT
    for _ in range(30):  # the load doubles: only passes of 4 tokens run
        costs.record(4, 4.0)
    assert costs.estimate(4) == pytest.approx(4.0, rel=0.05)
    assert costs.estimate(1) > 1.5  # a size the plans avoid follows in part


def test_stale_pass_costs_are_tried_again_and_the_load_is_shared():
    now = [0.0]
    costs, draft = PassCosts(clock=lambda: now[0]), PassCosts(clock=lambda: now[0])
    costs.share_load(draft)
    for n, seconds in ((1, 1.0), (3, 9.0)):  # 3 measured in a load spike
        costs.record(n, seconds)
        costs.record(n, seconds)
    draft.record(1, 0.4)
    draft.record(1, 0.4)
    now[0] = STALE_SECONDS + 1
    costs.record(1, 1.0)
    assert costs.estimate(3) == 1.0  # stale: priced as the fresh size, so a plan tries it
    costs.record(3, 1.5)
    costs.record(3, 1.5)
    assert costs.estimate(3) == pytest.approx(1.5, rel=0.1)  # a fresh start, not an average
    for _ in range(10):  # the machine gets twice as fast
        costs.record(1, 0.5)
    assert draft.estimate(1) < 0.4 * 0.85  # the draft, not running, follows in part
    assert draft.estimate(1) == draft.seconds[1]  # its own sizes are all it has: not stale


def test_acceptance_rate_backs_off_quickly_when_drafts_collapse():
    a = Acceptance()
    assert a.rate(0.5) == 0.5
    for _ in range(20):
        a.record(drafted=4, accepted=4)
    assert a.rate(0.5) > 0.9
    for _ in range(4):  # four passes whose first drafted token is wrong
        a.record(drafted=4, accepted=0)
    assert a.rate(0.5) < 0.75
    for _ in range(8):
        a.record(drafted=1, accepted=0)
    assert a.rate(0.5) < 0.45


def test_declined_drafters_are_probed_with_one_token_ever_more_rarely():
    p = Probing()
    due = [step for step in range(1, 301) if p.due()]
    # at once (a draft model is in step with the target after the prompt), then ever rarer
    assert due[:4] == [1, 1 + PROBE_WAIT_FIRST, 1 + 3 * PROBE_WAIT_FIRST, 1 + 7 * PROBE_WAIT_FIRST]
    assert len(due) <= 8  # 300 declined steps: a handful of probes, PROBE_WAIT_MAX apart
    p.drafting()
    assert [p.due() for _ in range(PROBE_WAIT_FIRST)][-1]


def test_probes_of_a_draft_model_stay_cheap():
    """A declined draft model falls behind by a token per step: probed while its catch-up
    is cheap, then left off."""
    drafter = SimpleNamespace(costs=CPU_DRAFT)
    spec = Speculator(_AlwaysOffers(), SpeculativeSettings(), 300, CPU_TARGET)
    spec.drafter = drafter  # only its costs matter here
    assert spec._cheap_probe(0) and spec._cheap_probe(2)
    assert not spec._cheap_probe(64)


class _Request:
    """A request as the Speculator sees it: its cache, settings and completion so far."""

    def __init__(self, max_tokens=1000):
        self.cache = SimpleNamespace(free_slots=1000, length=10, tokens=list(range(10)))
        self.params = SimpleNamespace(max_tokens=max_tokens)
        self.completion = SimpleNamespace(
            tokens=[], draft_rounds=0, drafted_tokens=0, accepted_tokens=0
        )
        self.next_token = 3


class _AlwaysOffers(LookupDrafter):
    def __init__(self, label="lookup4"):
        self.label = label

    def start(self, request, state):
        pass

    def offer(self, request, state, most):
        state.offer = Draft(self.label, [1] * most)
        return state.offer.label


@pytest.mark.parametrize("acceptance", [0.0, 1.0])
def test_speculator_stops_drafting_when_drafts_fail_and_keeps_on_when_they_succeed(acceptance):
    """Steps on CPU-like costs: drafts that are never right end in plain decoding with rare
    one-token probes; drafts always right keep a long draft going."""
    spec = Speculator(_AlwaysOffers(), SpeculativeSettings(draft_max=15), 300, CPU_TARGET)
    request = _Request()
    spec.start(request)
    sizes = []
    for _ in range(200):
        drafts = spec.drafts([request], budget=511)
        draft = drafts.get(request)
        sizes.append(0 if draft is None else len(draft.tokens))
        if draft is not None:
            spec.checked(request, draft, round(acceptance * len(draft.tokens)))
    late = sizes[50:]
    if acceptance == 0.0:
        assert sum(sizes) < 25 and max(late) <= 1 and sum(late) <= 5
    else:
        assert min(late) >= 8


def test_a_size_never_run_costs_its_capture_spread_over_the_reply_so_far():
    """A CUDA graph's capture makes a size's first pass dear (SmolLM2: about 45 ms, 60
    steps): plans take a size never run only where the reply so far, taken as what is left
    of it, pays the capture back; a probe of it waits as long."""
    assert PassCosts().one_time(2) == 0.0  # passes not captured (the CPU's)
    costs = PassCosts(one_time=True)
    for seconds in (0.045, 0.001, 0.001):  # the first step: its capture
        costs.record(1, seconds)
    assert costs.one_time(1) == 0.0 and costs.one_time(2) == pytest.approx(0.044)
    offer = [(0.9, 15, 0)]
    assert plan_drafts(offer, 1, costs, None, horizon=20) == [0]
    assert plan_drafts(offer, 1, costs, None, horizon=10_000)[0] > 3
    spec = Speculator(_AlwaysOffers("lookup1"), SpeculativeSettings(), 300, costs)
    assert not spec._probe_now(Probing(), 0, horizon=20)
    assert spec._probe_now(Probing(), 0, horizon=1000)


def test_steps_without_drafts_chain_ever_longer_up_to_the_next_probe():
    """Where the engine chains greedy steps: after a step that drafts nothing, as many steps
    without drafts may run as the sequence has gone without one (1, 2, 4, then the most),
    never past its next probe, which comes after as many tokens as without chains; a plan
    must then beat a chained step, not a step alone."""
    target = _costs(lambda n: 0.010 + 0.004 * (n - 1))  # a GPU: 2 tokens 1.4 steps
    chained = _costs(lambda n: 0.006)  # a chained step: 0.6 of a step alone
    assert plan_drafts([(0.6, 15, 0)], 1, target, None)[0] > 0
    assert plan_drafts([(0.6, 15, 0)], 1, target, None, plain=chained.estimate(1)) == [0]

    def run(chains: bool, drafter=None) -> list:
        spec = Speculator(
            drafter or _AlwaysOffers("lookup1"), SpeculativeSettings(draft_max=15), 300,
            _costs(target.estimate), chained_costs=_costs(chained.estimate),
        )  # fmt: skip
        request = _Request()
        spec.start(request)
        steps = []  # per step: -k a draft of k (never right), else the steps run
        while sum(abs(s) or 1 for s in steps) < 400:
            draft = spec.drafts([request], budget=511, chainable=chains).get(request)
            if draft is not None:
                spec.checked(request, draft, 0)
                steps.append(-len(draft.tokens))
                continue
            n = spec.quiet_steps([request], 8 if chains else 1)
            if n > 1:
                spec.chained([request], n, n * 0.006)
            steps.append(n)
        return steps

    alone, chained_run = run(False), run(True)
    assert max(alone) == 1 and max(chained_run) == 8
    probes = [s for s in chained_run if s < 0]
    assert probes and probes[-1] == -1  # never right: one-token probes at the end

    def probe_tokens(steps):  # where each late probe comes, in tokens decoded
        at, where = 0, []
        for s in steps:
            if s == -1:
                where.append(at)
            at += 1 if s < 0 else s
        return where[-3:]

    gaps = np.diff(probe_tokens(chained_run))
    assert list(gaps) == list(np.diff(probe_tokens(alone)))  # chains do not delay probes
    assert chained_run[1:4] == [1, 2, 4]  # after the first probe (at once)
    assert chained_run.count(1) == 1  # a failed probe does not start the count again
    assert max(run(True, _AlwaysOffers("lookup3"))) == 1  # a copy may start: no chains


def test_ngram_index_proposes_what_followed_the_latest_match():
    index = NgramIndex()
    index.extend([1, 2, 3, 4, 9, 2, 3, 5, 6])
    index.extend([2, 3])
    assert index.propose(3) == (2, [5, 6, 2])  # the latest "2 3"; past the end: repeats
    index.extend([7])
    assert index.propose(4) == (0, [])
    periodic = NgramIndex()
    periodic.extend([8, 8, 8])
    assert periodic.propose(5) == (2, [8, 8, 8, 8, 8])


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_a_head_over_the_first_ids(tiny_model, backend):
    """Transformer.limit_head (a CPU draft model's): the whole head's logits of those ids, bit
    for bit; -inf past them where every logit comes back; top_k picks among them alone."""
    f = GGUFFile(tiny_model)
    model = model_class(f.architecture)(f, get_backend(backend))
    n_vocab = model.config.n_vocab
    cache = model.new_cache(64)
    whole = model.forward([5, 6, 7, 250, 251], cache, all_logits=True)
    model.limit_head(100)
    cache.trim(0)
    part = model.forward([5, 6, 7, 250, 251], cache, all_logits=True)
    assert part.shape == (5, n_vocab)
    np.testing.assert_array_equal(part[:, :100], whole[:, :100])
    assert np.all(part[:, 100:] == -np.inf)
    cache.trim(4)
    ids, logits = model.forward([251], cache, top_k=20)
    assert ids.max() < 100 and logits.max() == part[-1].max()
    model.limit_head(n_vocab)
    cache.trim(0)
    np.testing.assert_array_equal(model.forward([5, 6, 7, 250, 251], cache, True), whole)


def test_greedy_speculation_with_a_draft_head_of_the_first_ids(
    tiny_model, draft_model, monkeypatch
):
    """A draft model's head limited to its first ids (DRAFT_HEAD_ROWS, where the vocabulary
    has twice as many): the drafts it cannot make are rejected; the output is still plain
    decoding's."""
    monkeypatch.setattr("fastrun.runner.speculative.DRAFT_HEAD_ROWS", 128)
    # a probe of the draft is always cheap enough: whether the plan drafts must not hang on
    # this machine's timings (the draft first reads the whole prompt, a catch-up that a slow
    # moment prices above a probe's limit; CI saw no draft at all once)
    monkeypatch.setattr("fastrun.runner.speculative.PROBE_COST_MAX", float("inf"))
    prompt = REPEATING + list(range(40, 60)) + [260, 270, 280]
    settings = dict(max_tokens=40, temperature=0, ignore_eos=True)
    m = Model(tiny_model, backend="cpu", n_ctx=128, parallel=1, draft=tiny_model)
    expect = m.complete(prompt, **settings).tokens
    assert m.draft_transformer.head_rows == 128
    m.speculate("draft")
    done = m.complete(prompt, **settings)
    m.close()
    assert done.tokens == expect and done.drafted_tokens > 0
    assert any(t >= 128 for t in expect)  # tokens the draft could not propose


def test_settings_and_vocabularies_are_checked(tiny_model, smollm2_path):
    with pytest.raises(FastrunError, match="--draft-min"):
        SpeculativeSettings(draft_max=4, draft_min=5)
    with pytest.raises(FastrunError, match="vocabulary") as error:
        Model(tiny_model, backend="cpu", n_ctx=64, draft=smollm2_path)
    assert "\n" not in str(error.value)
    with pytest.raises(FastrunError, match="no draft"):
        Model(tiny_model, backend="cpu", n_ctx=64, draft="auto")
    from fastrun.runner.registry import paired_draft

    assert paired_draft("qwen2.5-coder-1.5b-instruct") == "qwen2.5-coder-0.5b-instruct"


def test_cli_json_timings_report_drafts(tiny_model):
    r = subprocess.run(
        [sys.executable, "-m", "fastrun.runner.cli", "run", str(tiny_model), "abcabcabcabc",
         "-n", "40", "--temp", "0", "--ignore-eos", "--json", "--backend", "cpu", "--lookup"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    timings = json.loads(r.stdout)["timings"]
    assert timings["drafted_tokens"] > 0 and 0 <= timings["acceptance_rate"] <= 1
    assert timings["mean_accepted_length"] == pytest.approx(
        timings["accepted_tokens"] / timings["draft_rounds"], abs=1e-3
    )


CODE_EDIT = """Add type hints to this function and return it whole:

def mean_of(values, skip_none):
    total = 0
    count = 0
    for value in values:
        if value is None and skip_none:
            continue
        total += value
        count += 1
    return total / count
"""


def test_smollm2_greedy_speculation_equals_plain(smollm2_path):
    """A real model: prompt lookup, and the model drafting for itself."""
    messages = [{"role": "user", "content": CODE_EDIT}]
    plain = Model(smollm2_path, backend="cpu", n_ctx=512, parallel=1, threads=1)
    expect = plain.complete(plain.chat_prompt(messages), max_tokens=48, temperature=0).tokens
    for kind in (dict(lookup=True), dict(draft=smollm2_path)):
        m = Model(smollm2_path, backend="cpu", n_ctx=512, parallel=1, threads=1, **kind)
        done = m.complete(m.chat_prompt(messages), max_tokens=48, temperature=0)
        assert done.tokens == expect, kind
        assert done.drafted_tokens > 0
        m.close()


# -- CUDA (skipped without CuPy and a GPU; run on the GPU machine) ------------------------------


def _cuda():
    from fastrun.backends.cuda import cuda_available

    if not cuda_available():
        pytest.skip("no CUDA GPU")


@pytest.mark.gpu
def test_cuda_checking_pass_is_a_captured_step_equal_to_an_eager_one(tiny_model):
    """A pass of a sequence's last token and 8 drafts beside another sequence's decode token
    replays a CUDA graph, with the logits of an eager run."""
    _cuda()
    from fastrun.runner.batch import Batch

    with GGUFFile(str(tiny_model)) as f:
        tf = model_class(f.architecture)(f, get_backend("cuda"))
        cells = tf.new_cells(2, 64)
        a, b = cells.sequences
        tf.forward([5, 6, 7, 8], a)
        tf.forward([9, 10], b)
        outs = []
        for capture in (True, True, False):  # capture, replay, eager
            a.trim(4), b.trim(2)
            batch = Batch()
            batch.add(a, [11, 12, 13, 14, 15, 16, 17, 18, 19], "all")
            batch.add(b, [20])
            assert batch.is_decode
            outs.append(tf.run(batch, cells, capture=capture))
        assert any(key[0] == id(cells) for key in tf.backend._graphs)
        np.testing.assert_array_equal(outs[0], outs[1])
        np.testing.assert_allclose(outs[1], outs[2], atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["lookup", "draft"])
def test_cuda_greedy_speculation_equals_plain(tiny_model, draft_model, smollm2_path, kind):
    _cuda()
    prompts = [REPEATING, [7, 8, 9]]
    for path, draft in ((tiny_model, draft_model), (smollm2_path, smollm2_path)):
        plain = Model(path, backend="cuda", n_ctx=256, parallel=2)
        expect = [c.tokens for c in plain.generate_batch(prompts, **LONG_GREEDY)]
        plain.close()
        extra = dict(lookup=True) if kind == "lookup" else dict(draft=draft)
        m = Model(path, backend="cuda", n_ctx=256, parallel=2, **extra)
        got = m.generate_batch(prompts, **LONG_GREEDY)
        for prompt, completion, wanted in zip(prompts, got, expect, strict=True):
            _equal_up_to_a_near_tie(m, prompt, completion.tokens, wanted)
        m.close()
        assert sum(c.drafted_tokens for c in got) > 0


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["lookup", "draft"])
def test_cuda_greedy_speculation_alone_is_plain_decoding(tiny_model, kind):
    """A request alone: each checking pass is one sequence's, which CUDA computes bit for bit
    as one-token steps (EXACT_PASS_TOKENS), so greedy speculation gives plain decoding's
    tokens exactly, no near tie let through. The model drafting for itself is always right,
    so its passes grow to the largest (matmul_exact's 9-16 tokens: rows of whole chunks)."""
    _cuda()
    prompts = [REPEATING, [7, 8, 9], list(range(20, 60))]
    plain = Model(tiny_model, backend="cuda", n_ctx=256, parallel=1)
    expect = [plain.complete(p, **LONG_GREEDY).tokens for p in prompts]
    plain.close()
    extra = dict(lookup=True) if kind == "lookup" else dict(draft=tiny_model)
    m = Model(tiny_model, backend="cuda", n_ctx=256, parallel=1, **extra)
    got = [m.complete(p, **LONG_GREEDY) for p in prompts]
    m.close()
    assert [c.tokens for c in got] == expect
    assert sum(c.drafted_tokens for c in got) > 0


@pytest.mark.gpu
def test_cuda_lookup_requests_capture_no_checking_pass(tiny_model):
    """With lookup on, the engine captures a greedy sequence's checking passes of every size
    before any request: the requests then capture none (a capture costs a short reply more
    than its whole decode), and their tokens are plain decoding's."""
    _cuda()
    from fastrun.backends.cuda.graphs import StepGraph

    greedy = dict(max_tokens=80, temperature=0)  # no banned ids: one candidate, as warmed
    plain = Model(tiny_model, backend="cuda", n_ctx=256, parallel=1)
    expect = plain.complete(REPEATING, **greedy).tokens
    plain.close()
    m = Model(tiny_model, backend="cuda", n_ctx=256, parallel=1, lookup=True)
    graphs, cells = m.engine.transformer.backend._graphs, m.engine.cells

    def passes():  # the captured checking passes: steps of 2 tokens or more of these cells
        return {
            k for k, g in graphs.items()
            if type(g) is StepGraph and k[0] == id(cells) and k[2][0] > 1
        }  # fmt: skip

    warmed = passes()
    assert len(warmed) == MAX_STEP_TOKENS - 1
    done = m.complete(REPEATING, **greedy)
    m.close()
    assert done.tokens == expect and done.drafted_tokens > 0
    assert passes() == warmed


def _equal_up_to_a_near_tie(model, prompt, tokens, wanted, tie=0.5):
    """Greedy tokens equal until the first position where the plain run's two best choices
    lie within `tie`: two requests side by side share passes of several sequences, which CUDA
    multiplies through the tensor-core kernel and splits attention for as a batch (not a
    one-token step's bits: a one-sequence pass only is exact, EXACT_PASS_TOKENS), and each
    layer's 8-bit requantization carries the last bits on: on SmolLM2 a 5-9 token pass's
    logits differed from one-token steps' by up to 0.4-1.0 (the largest over the vocabulary;
    measured on the H200, 2026-12-02)."""
    same = next((i for i, (a, b) in enumerate(zip(tokens, wanted, strict=False)) if a != b), None)
    if same is None:
        assert len(tokens) == len(wanted)
        return
    logprobs = model.logprobs(list(prompt) + list(wanted[:same]))[-1]
    best, second = np.sort(logprobs)[-2:][::-1]
    assert best - second < tie, f"departs at token {same} where the margin is {best - second:.3f}"


LONG_GREEDY = dict(max_tokens=120, temperature=0, ignore_eos=True)
