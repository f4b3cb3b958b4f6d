"""Speculative decoding: a drafter proposes a few tokens per sequence, the target checks them all
in one pass of the engine (the sequence's last token and its drafts, logits for each), and the
accepted prefix stays while the rejected cells are trimmed.

Two drafters: a small model of the same vocabulary (its own KV cells, a sequence per target
sequence, drafting one token per pass for every speculating sequence at once), and prompt
lookup (the tokens that followed the latest earlier occurrence of the last n-gram of the prompt
and the text so far; no model, so drafting is free).

Exact: the target's distribution p at each position is its sampler's final distribution (the
filters, penalties and temperature applied), so a drafted token x drawn from the drafter's q is
accepted with probability min(1, p(x) / q(x)), and the first rejected one is replaced by a draw
from max(0, p - q), normalized; with every draft accepted, one more token comes from p. The
tokens are then distributed as plain sampling's (Leviathan et al. 2023); at temperature 0, p is
a point mass on the argmax and the tokens are plain greedy decoding's, one for one.

Adaptive: each step plans how many tokens each sequence drafts from what was measured here,
on this machine and backend: the seconds of a target pass by its number of tokens, of a draft
pass by its tokens (a draft that fell behind runs the tokens it missed first), and each
sequence's acceptance rate. It picks the plan with the most expected tokens per second, and no
drafts at all unless that beats plain decoding by a margin (estimates are noisy; a draft that
barely pays is not worth the risk). Sizes of pass never measured are priced along the measured
ones (interpolated; one size past the largest measured as cheap as the largest, so that it
is tried, and larger ones along the slope of the two largest). Acceptance forgets per checked
token, so a collapse shows within a few passes; before any is checked, a draft model's
acceptance is taken as its p_min (it proposes only tokens it is that sure of), lookup's as
ACCEPT_PRIOR. A drafter the plan declines is probed with a one-token draft at once, then
after a wait that doubles with each probe the plan does not follow, as long as the probe is
cheap (a draft model far behind would first read all it missed).

Where the backend chains greedy steps on the device (CUDA), steps for which nothing is
drafted run chained, ever longer as a stretch without drafts goes on (quiet_steps), and
drafts must beat a chained step. Where it captures each pass size (a CUDA graph), the engine
captures the checking passes when speculation is switched on; a size not captured that way
is priced with its capture (PassCosts.one_time), spread over the reply so far.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from fastrun.formats.errors import FastrunError
from fastrun.runner.batch import MAX_STEP_TOKENS, Batch
from fastrun.runner.sampling import Candidates, Sampler

LOOKUP_NGRAMS = (4, 3, 2, 1)  # n-gram lengths prompt lookup matches, longest first
WATCH_NGRAM = 3  # lookup matches this long keep the plans looking at every step (no chains)
CONFIDENCE_CANDIDATES = 10  # draft tokens whose probabilities judge --draft-p-min
VOCAB_SLACK = 128  # tokens a draft's vocabulary may have more or fewer than the target's
WARM_UP_PASSES = 1  # passes of each size not measured (compilation, a CUDA graph's capture)
COST_WEIGHT = 0.3  # of each new measurement of a pass's seconds in its running average
LOAD_WEIGHT = 0.1  # of a measurement's surprise passed on to the other sizes (the load)
SURPRISE_MAX = 2.0  # one measurement moves an estimate by this factor at most (outliers)
STALE_SECONDS = 10.0  # a size not measured for this long beside fresher ones is tried again
ACCEPT_PRIOR = 0.5  # acceptance assumed before any draft was checked (a draft model: its p_min)
ACCEPT_DECAY = 0.92  # per checked drafted token: a window of about 12 tokens
MIN_SPEEDUP = 1.05  # drafts must promise this much over plain decoding, or none are drafted
PROBE_WAIT_FIRST = 8  # declined steps after the first probe (at once) before the next one
PROBE_WAIT_MAX = 64  # the longest wait (it doubles with each probe the plan does not follow)
PROBE_COST_MAX = 2.0  # plain steps a probe may cost beyond its step (a draft's catch-up)
# On the CPU a draft model's logits cover the first DRAFT_HEAD_ROWS ids of a vocabulary of at
# least twice as many (Transformer.limit_head). 2-core Ice Lake, Qwen2.5-0.5B drafting for the
# 1.5B: a draft step 30.5 -> 25.5 ms, code prompts 1.35 -> 1.42x plain decoding in one run
# (32768 rows: 23 ms, but 1.24 -> 1.20x: drafts ended at the identifiers past them). Not on
# CUDA, where a small model's step is bound by its launches more than by its bytes.
DRAFT_HEAD_ROWS = 65536


@dataclass(frozen=True)
class SpeculativeSettings:
    draft_max: int = MAX_STEP_TOKENS - 1  # most tokens drafted per sequence and step
    draft_min: int = 0  # fewer than this: draft nothing (0: any number)
    draft_p_min: float = 0.75  # a draft model stops where its token is less likely than this

    def __post_init__(self):
        if not 0 <= self.draft_min <= self.draft_max <= MAX_STEP_TOKENS - 1:
            raise FastrunError(
                f"--draft-min {self.draft_min} and --draft-max {self.draft_max}: need "
                f"0 <= min <= max <= {MAX_STEP_TOKENS - 1}"
            )
        if not 0.0 <= self.draft_p_min <= 1.0:
            raise FastrunError(f"--draft-p-min must be within 0 and 1, not {self.draft_p_min}")


@dataclass
class Draft:
    """Tokens proposed for one sequence, and the distribution each was drawn from (ids,
    probabilities); None: lookup's point masses."""

    label: str  # which drafter (and for lookup, which n-gram length) proposed it
    tokens: list[int]
    dists: list[tuple[np.ndarray, np.ndarray]] | None = None


# -- checking a draft ------------------------------------------------------------------------------


def _probability(dist: tuple[np.ndarray, np.ndarray], token: int) -> float:
    ids, probs = dist
    where = np.flatnonzero(ids == token)
    return float(probs[where[0]]) if where.size else 0.0


def _residual(p: tuple, q: tuple | None, token: int) -> tuple[np.ndarray, np.ndarray]:
    """max(0, p - q) normalized: what to draw from after q's token was rejected (q None: a
    point mass on token)."""
    ids, probs = p
    rest = probs.copy()
    if q is None:
        rest[ids == token] = 0.0
    else:
        q_ids, q_probs = q
        order = np.argsort(q_ids)
        at = np.searchsorted(q_ids[order], ids).clip(0, len(order) - 1)
        found = q_ids[order][at] == ids
        rest -= np.where(found, q_probs[order][at], 0.0)
        np.maximum(rest, 0.0, out=rest)
    total = rest.sum()
    if total <= 0.0:  # p <= q everywhere only if p == q up to rounding: p itself is exact
        return p
    return ids, rest / total


def _draw(sampler: Sampler, dist: tuple[np.ndarray, np.ndarray]) -> int:
    ids, probs = dist
    if len(ids) == 1:
        return int(ids[0])
    return int(ids[sampler.rng.choice(len(ids), p=probs)])


def check_draft(draft: Draft, target, sampler: Sampler) -> tuple[list[int], int]:
    """The tokens a sequence keeps from a draft, and how many of them are drafted ones.

    target(j): the target's distribution (ids, probabilities) at position j, after the
    sequence's last token and the first j drafted tokens (0 <= j <= len(draft.tokens)); it is
    asked only for the positions needed. Rejection sampling: the kept tokens are distributed
    as draws from the target alone, the last of them always the target's own."""
    kept: list[int] = []
    for j, token in enumerate(draft.tokens):
        p = target(j)
        q = None if draft.dists is None else draft.dists[j]
        p_x = _probability(p, token)
        q_x = 1.0 if q is None else _probability(q, token)
        # no random number where the answer is certain: greedy decoding draws none
        if p_x > 0.0 and (p_x >= q_x or sampler.rng.random() * q_x < p_x):
            kept.append(token)
            continue
        kept.append(_draw(sampler, _residual(p, q, token)))
        return kept, j
    kept.append(_draw(sampler, target(len(draft.tokens))))
    return kept, len(draft.tokens)


# -- what passes cost, how often drafts are accepted, how much to draft ---------------------------


class PassCosts:
    """Seconds of a pass by its number of tokens, as measured here: running averages in
    ratios, each measurement's surprise clipped (a stall of the machine is not a new cost)
    and in part passed on to every size (and to the costs that share_load links: the draft
    model's), as the machine's load slows passes of any size alike and a size the plans avoid
    is not measured again. A size last measured STALE_SECONDS before the latest measurement
    counts as not measured (a load spike then is not its cost for ever): it is priced from
    the fresh sizes, so that a plan tries it again."""

    def __init__(
        self, unknown: float | None = None, clock=time.perf_counter, one_time: bool = False
    ):
        self.seconds: dict[int, float] = {}
        self.measured_at: dict[int, float] = {}
        self.seen: Counter[int] = Counter()
        self.unknown = unknown  # the estimate while nothing is measured (None: no estimate)
        self.clock = clock
        self.peers: list[PassCosts] = []  # other passes on this machine: its load is theirs
        self.first: dict[int, float] = {}  # seconds of each size's first pass
        self.captures = one_time  # whether a size's first pass costs once more (one_time)

    def warmed(self, n: int) -> None:
        """A pass of n tokens was run (and captured) before any was measured: n costs nothing
        once more, and its first measured pass counts."""
        self.seen[n] = max(self.seen[n], WARM_UP_PASSES)

    def one_time(self, n: int) -> float:
        """Seconds a size never run costs once beyond its pass (a CUDA graph's capture: tens
        of ms, dozens of a small model's steps): the median of what the first passes of the
        sizes measured since cost beyond their later ones; 0 for a size that ran, and where
        passes are not captured (a CPU's first pass may be slow for reasons of its own)."""
        if not self.captures or self.seen[n]:
            return 0.0
        surplus = sorted(
            max(first - self.seconds[m], 0.0)
            for m, first in self.first.items()
            if m in self.seconds
        )
        return surplus[len(surplus) // 2] if surplus else 0.0

    def share_load(self, other: PassCosts) -> None:
        if other is not self and other not in self.peers:
            self.peers.append(other)
            other.peers.append(self)

    def _scale(self, factor: float) -> None:
        for m in self.seconds:
            self.seconds[m] *= factor

    def record(self, n: int, seconds: float) -> None:
        self.seen[n] += 1
        if self.seen[n] == 1:
            self.first[n] = seconds
        if self.seen[n] <= WARM_UP_PASSES:
            return
        old = self.seconds.get(n)
        restart = old is None or self.measured_at[n] < self._latest() - STALE_SECONDS
        self.measured_at[n] = self.clock()
        if restart or old <= 0.0 or seconds <= 0.0:
            self.seconds[n] = seconds
            return
        surprise = min(max(seconds / old, 1.0 / SURPRISE_MAX), SURPRISE_MAX)
        for m in self.seconds:
            self.seconds[m] *= surprise ** (COST_WEIGHT if m == n else LOAD_WEIGHT)
        for peer in self.peers:
            peer._scale(surprise**LOAD_WEIGHT)

    def _latest(self) -> float:
        return max(self.measured_at.values(), default=0.0)

    def _fresh(self) -> dict[int, float]:
        since = self._latest() - STALE_SECONDS
        return {m: t for m, t in self.seconds.items() if self.measured_at[m] >= since}

    def as_ms(self) -> dict[int, float]:
        return {n: round(self.seconds[n] * 1e3, 2) for n in sorted(self.seconds)}

    def estimate(self, n: int) -> float | None:
        """The measured seconds of n tokens; for a size not measured, a line through the
        measured sizes around it; below the smallest, in proportion to it. Above the largest:
        the next size up is priced as the largest, so that a plan tries it once and then
        knows it, and sizes past it along the slope of the two largest (never less than the
        largest). A CPU's first extra token costs the most (2-core Qwen-1.5B: 1.18, 1.36,
        1.56 steps for 2-4 tokens): along the slope of 1 and 2 alone, 3 and 4 looked too
        dear to try where they paid."""
        if n <= 0:
            return 0.0
        seconds = self._fresh()
        if n in seconds:
            return seconds[n]
        if not seconds:
            return self.unknown
        sizes = sorted(seconds)
        below = [m for m in sizes if m < n]
        above = [m for m in sizes if m > n]
        if below and above:
            lo, hi = below[-1], above[0]
            t_lo, t_hi = seconds[lo], seconds[hi]
            return t_lo + (t_hi - t_lo) * (n - lo) / (hi - lo)
        if above:
            return seconds[above[0]] * n / above[0]
        top = seconds[sizes[-1]]
        if len(sizes) == 1:
            return top
        prev = sizes[-2]
        slope = max((top - seconds[prev]) / (sizes[-1] - prev), 0.0)
        return top + slope * (n - sizes[-1] - 1)  # the next size up as the largest


@dataclass
class Acceptance:
    """How often drafted tokens were accepted: successes over trials, a trial being each drafted
    token checked up to and including the first rejected one; each trial weighs ACCEPT_DECAY
    times the next one, so a collapse lowers the rate within a few checking passes."""

    accepted: float = 0.0
    trials: float = 0.0

    def record(self, drafted: int, accepted: int) -> None:
        trials = accepted + (accepted < drafted)
        older = ACCEPT_DECAY**trials
        self.accepted = self.accepted * older + accepted
        self.trials = self.trials * older + trials

    def rate(self, prior: float, weight: float = 2.0) -> float:
        return (self.accepted + weight * prior) / (self.trials + weight)


@dataclass
class Probing:
    """When a drafter the plans decline is tried again: at a request's first declined step
    (a draft model has just read the prompt, so its probe runs one token: later, behind by
    the steps it missed, its probes cost ever more), then a one-token draft after `wait`
    declined steps, the wait doubling with each probe (up to PROBE_WAIT_MAX) until the plan
    drafts on its own again. A probe costs at most a pass of two tokens and a draft step
    where the drafter is a model; it refreshes the acceptance that plans read."""

    wait: int = 1
    declined: int = 0

    def due(self) -> bool:
        """A declined step: whether it is time for a probe."""
        self.declined += 1
        if self.declined < self.wait:
            return False
        self.declined = 0
        self.wait = min(max(2 * self.wait, PROBE_WAIT_FIRST), PROBE_WAIT_MAX)
        return True

    def drafting(self) -> None:
        self.wait, self.declined = PROBE_WAIT_FIRST, 0


def expected_tokens(rate: float, k: int) -> float:
    """Tokens a pass that checks k drafts yields in expectation: its own and each drafted one
    kept with the chance that it and all before it are accepted."""
    return sum(rate**j for j in range(k + 1))


def plan_drafts(
    offers: list[tuple[float, int, int]],
    n_plain: int,
    target: PassCosts,
    draft: PassCosts | None,
    min_speedup: float = MIN_SPEEDUP,
    plain: float | None = None,
    horizon: float = float("inf"),
) -> list[int]:
    """How many tokens each sequence drafts this step.

    offers: per sequence, its acceptance rate a, the most tokens it may draft (its j-th drafted
    token then adds a**j tokens in expectation), and the tokens a draft model runs before its
    first draft (its last token and any it has not seen yet; 0: a free drafter, lookup).
    n_plain: the tokens of the step without drafts (one per decoding sequence). target: the
    seconds of target passes by tokens; draft: of draft passes (None: no draft model). The
    plan maximizes expected tokens per second (a draft model's passes batch the sequences
    that draft a j-th token); all zeros unless it beats plain decoding by `min_speedup`, or
    while the cost of plain decoding is not known yet. plain: the seconds of a step without
    drafts where that is not target's pass of n_plain tokens (steps chained on the device).
    horizon: the tokens over which a size's one-time cost (PassCosts.one_time, a graph's
    capture) is spread: the sequences' tokens so far, as a reply tends to go on about as long
    as it has lasted (a short reply on a fresh process does not pay for captures that a long
    one, or the requests after it, would)."""
    step = target.estimate(n_plain)
    if not step:
        return [0] * len(offers)
    plain = plain or step
    # drafted tokens in the order of their expected gain; any prefix is a plan
    gains = (
        (min(a, 0.999) ** j, s, j)
        for s, (a, most, _) in enumerate(offers)
        for j in range(1, most + 1)
    )
    extra = sorted(gains, key=lambda c: (-c[0], c[1], c[2]))
    best_rate, best = min_speedup * n_plain / plain, 0
    gain, drafting = 0.0, 0.0
    draft_pass = Counter()  # draft_pass[j]: tokens of the draft model's j-th pass
    for i, (g, s, j) in enumerate(extra, start=1):
        gain += g
        lead = offers[s][2]
        if lead and draft is not None:
            before = draft_pass[j]
            draft_pass[j] += lead if j == 1 else 1
            drafting += (draft.estimate(draft_pass[j]) or 0.0) - (draft.estimate(before) or 0.0)
        # over the horizon's tokens, this size's one-time cost is paid per token
        once = target.one_time(n_plain + i) * (n_plain + gain) / horizon
        rate = (n_plain + gain) / (target.estimate(n_plain + i) + drafting + once)
        if rate > best_rate:
            best_rate, best = rate, i
    plan = [0] * len(offers)
    for _g, s, _j in extra[:best]:
        plan[s] += 1
    return plan


# -- drafters --------------------------------------------------------------------------------------


class NgramIndex:
    """Where each n-gram of a token list last occurred, as the position of the token after it;
    extended as the list grows. The latest occurrence: in an edit of given code, the place
    being copied now."""

    def __init__(self, sizes=LOOKUP_NGRAMS):
        self.sizes = sizes
        self.tokens: list[int] = []
        self.follower: dict[tuple[int, ...], int] = {}

    def extend(self, tokens) -> None:
        for token in tokens:
            at = len(self.tokens)
            for n in self.sizes:
                if at >= n:
                    self.follower[tuple(self.tokens[at - n : at])] = at
            self.tokens.append(int(token))

    def propose(self, most: int) -> tuple[int, list[int]]:
        """The longest n-gram ending the list that occurred before, and up to `most` tokens that
        followed it there; (0, []) where none did."""
        for n in self.sizes:
            if len(self.tokens) < n:
                continue
            at = self.follower.get(tuple(self.tokens[-n:]))
            if at is not None:
                return n, self._continue(at, most)
        return 0, []

    def _continue(self, at: int, most: int) -> list[int]:
        """Tokens from position `at` on; past the end of the list, the proposal repeats itself
        (a match close to the end is a period: 'a b a b' continues 'a b')."""
        tokens, end = self.tokens, len(self.tokens)
        proposal: list[int] = []
        for i in range(at, at + most):
            proposal.append(tokens[i] if i < end else proposal[i - end])
        return proposal


@dataclass
class SequenceState:
    """One sequence's speculation: its acceptance by drafter label, its lookup index or its
    draft sampler, the offer of this step."""

    acceptance: dict[str, Acceptance] = field(default_factory=dict)
    probing: dict[str, Probing] = field(default_factory=dict)
    index: NgramIndex | None = None
    sampler: Sampler | None = None
    offer: Draft | None = None  # lookup: the tokens proposed before the plan trims them
    quiet: int = 0  # steps in a row without a draft of the plans (chained steps count each)


class LookupDrafter:
    """Prompt lookup: drafts are the tokens that followed the last n-gram's previous
    occurrence in the prompt and the text so far. Drafting costs nothing measurable."""

    kind = "lookup"
    costs = None

    def lead(self, request, label: str) -> int:
        return 0

    def prior(self, label: str) -> float:
        """The acceptance assumed before any of this label's drafts was checked."""
        return ACCEPT_PRIOR

    def prefill(self, requests) -> None:
        pass

    def start(self, request, state: SequenceState) -> None:
        state.index = NgramIndex()
        state.index.extend(request.prompt)

    def offer(self, request, state: SequenceState, most: int) -> str | None:
        """The label of what it can propose and keeps the proposal; None: nothing."""
        index = state.index
        index.extend(request.completion.tokens[len(index.tokens) - len(request.prompt) :])
        n, tokens = index.propose(most)
        state.offer = Draft(f"lookup{n}", tokens) if tokens else None
        return None if state.offer is None else state.offer.label

    def most(self, state: SequenceState) -> int:
        return len(state.offer.tokens)

    def watching(self, state: SequenceState) -> bool:
        """Whether the plans should look at the sequence's next step, not chain past it: its
        last WATCH_NGRAM tokens or more occurred before, where a copy may be starting (a
        reply's story falling into a loop: chains of 8 steps past such matches cost SmolLM2
        lookup a third of its gain in scripts/spec_replay.py)."""
        offer = state.offer
        return offer is not None and int(offer.label.removeprefix("lookup")) >= WATCH_NGRAM

    def draft(self, jobs) -> dict:
        return {request: Draft(st.offer.label, st.offer.tokens[:k]) for request, st, k in jobs}

    def rolled_back(self, request, kept: int) -> None:
        pass

    def shifted(self, request, keep: int, discard: int) -> None:
        pass


class ModelDrafter:
    """A small model of the target's vocabulary drafts with the request's own sampling
    settings, one token per pass for every speculating sequence at once, in KV cells of its
    own (sequence i drafts for the target's sequence i)."""

    kind = "draft"

    def __init__(self, transformer, tokenizer, n_seq: int, n_ctx: int, p_min: float, chunk: int):
        self.transformer = transformer
        if transformer.backend.name == "cpu" and 2 * DRAFT_HEAD_ROWS <= transformer.config.n_vocab:
            transformer.limit_head(DRAFT_HEAD_ROWS)
        self.tokenizer = tokenizer
        self.cells = transformer.new_cells(n_seq, n_ctx, max(chunk, MAX_STEP_TOKENS))
        self.p_min = p_min
        self.chunk = chunk  # tokens of one catch-up pass at most (a new prompt, a shift)
        self.costs = PassCosts(unknown=0.0)  # free until measured: the first draft tries it
        self.n_vocab = None  # the target's, set by the Speculator: drafts must be ids it has

    def start(self, request, state: SequenceState) -> None:
        # the target's settings, so that q is close to p; a seed of its own
        params = request.params
        seed = None if params.seed is None else (params.seed + 1) % (1 << 64)
        banned = frozenset(request.sampler.banned.tolist())
        state.sampler = Sampler(dataclasses.replace(params, seed=seed), banned)

    def offer(self, request, state: SequenceState, most: int) -> str | None:
        return self.kind

    def most(self, state: SequenceState) -> int:
        return MAX_STEP_TOKENS - 1

    def watching(self, state: SequenceState) -> bool:
        return False

    def _cache(self, request):
        return self.cells.sequences[request.cache.index]

    @staticmethod
    def _context(request) -> list[int]:
        return request.cache.tokens + [request.next_token]

    def _seen(self, request, context: list[int]) -> int:
        """Tokens of the context the draft's cells keep; the last token always runs again:
        its logits give the first draft."""
        return self._cache(request).reusable_prefix(context, len(context) - 1)

    def prior(self, label: str) -> float:
        """It proposes only tokens it gives at least p_min: about that share is right."""
        return max(ACCEPT_PRIOR, self.p_min)

    def lead(self, request, label: str) -> int:
        """Tokens the draft's first pass runs for this sequence: the ones it has not seen."""
        context = self._context(request)
        return len(context) - self._seen(request, context)

    def prefill(self, requests) -> None:
        """Run new prompts through the draft beside the target's prefill (as llama.cpp's
        speculative example does), so that the first draft runs one token."""
        todo = {}
        for request in requests:
            cache = self._cache(request)
            cache.trim(cache.reusable_prefix(request.prompt, len(request.prompt)))
            todo[request] = (None, 0, request.prompt[cache.length :], None)
        self._catch_up(todo, leave=0)

    def draft(self, jobs) -> dict:
        """Draft up to k tokens for each (request, state, k): catch the draft's cells up with
        the target's tokens, then one pass per drafted token; a sequence stops early at a
        token less likely than p_min, or at an end-of-generation token."""
        todo = {}  # request -> (state, k, tokens to run next, Draft)
        for request, state, k in jobs:
            context = self._context(request)
            cache = self._cache(request)
            cache.trim(self._seen(request, context))
            todo[request] = (state, k, context[cache.length :], Draft(self.kind, [], []))
        self._catch_up(todo, leave=self.chunk)
        drafts = {request: entry[3] for request, entry in todo.items()}
        while todo:
            todo = self._draft_one(todo)
        return {r: d for r, d in drafts.items() if d.tokens}

    def _catch_up(self, todo: dict, leave: int) -> None:
        """Long catch-ups (a new prompt, a context shift) first, in chunks that want no
        logits; every sequence is then at most `leave` tokens behind."""
        while True:
            behind = [(r, e) for r, e in todo.items() if len(e[2]) > leave]
            if not behind:
                return
            batch = Batch()
            for request, (state, k, pending, d) in behind:
                run = min(self.chunk, len(pending))
                batch.add(self._cache(request), pending[:run], "none")
                todo[request] = (state, k, pending[run:], d)
            self.transformer.run(batch, self.cells)

    def _draft_one(self, todo: dict) -> dict:
        started = time.perf_counter()
        batch, places = Batch(), {}
        for request, (_state, _k, pending, _d) in todo.items():
            places[request] = batch.add(self._cache(request), pending)
        needs = [e[0].sampler.candidates for e in todo.values()]
        top_k = 0 if 0 in needs else max(max(needs), CONFIDENCE_CANDIDATES)
        logits = self.transformer.run(batch, self.cells, top_k)
        going = {}
        for request, (state, k, _pending, draft) in todo.items():
            row = places[request]
            choice = Candidates(logits[0][row], logits[1][row]) if top_k else logits[row]
            dist = state.sampler.distribution(choice, self._cache(request).tokens)
            token = _draw(state.sampler, dist)
            if token >= self.n_vocab:  # beyond the target's vocabulary: never accepted
                continue
            draft.tokens.append(token)
            draft.dists.append(dist)
            if len(draft.tokens) < k and not self._stops(token, choice):
                going[request] = (state, k, [token], draft)
        self.costs.record(batch.n, time.perf_counter() - started)
        return going

    def _stops(self, token: int, choice) -> bool:
        """Whether drafting ends after this token: an end of generation, or a token the draft
        itself finds less likely than p_min (its softmax at temperature 1, whatever the
        sampling settings; over the top candidates where only those came back)."""
        if token in self.tokenizer.eog_ids:
            return True
        if isinstance(choice, Candidates):
            values, at = choice.logits, int(np.flatnonzero(choice.ids == token)[0])
        else:
            values, at = choice, token
        values = np.asarray(values, np.float64)
        top = values[np.isfinite(values)].max(initial=-np.inf)
        if not np.isfinite(values[at]) or not np.isfinite(top):
            return True
        mass = np.exp(values[np.isfinite(values)] - top).sum()
        return float(np.exp(values[at] - top) / mass) < self.p_min

    def rolled_back(self, request, kept: int) -> None:
        """The target kept `kept` tokens of its cache: the draft's cells past them go."""
        cache = self._cache(request)
        cache.trim(min(cache.length, kept))

    def shifted(self, request, keep: int, discard: int) -> None:
        """The target's context shift, mirrored, so the draft does not run the kept tail again."""
        cache = self._cache(request)
        if cache.length > keep + discard:
            cache.shift(keep, discard, self.transformer.layer_ropes(cache.cells))
        else:
            cache.trim(keep)


class LookupThenModel:
    """Prompt lookup where it finds a match (free), the draft model elsewhere: `--lookup`
    with `--draft`."""

    kind = "lookup+draft"

    def __init__(self, lookup: LookupDrafter, model: ModelDrafter):
        self.lookup, self.model = lookup, model
        self.costs = model.costs

    @property
    def n_vocab(self):
        return self.model.n_vocab

    @n_vocab.setter
    def n_vocab(self, n: int) -> None:
        self.model.n_vocab = n

    def lead(self, request, label: str) -> int:
        return self.model.lead(request, label) if label == self.model.kind else 0

    def prior(self, label: str) -> float:
        return (self.model if label == self.model.kind else self.lookup).prior(label)

    def prefill(self, requests) -> None:
        self.model.prefill(requests)

    def start(self, request, state: SequenceState) -> None:
        self.lookup.start(request, state)
        self.model.start(request, state)

    def offer(self, request, state: SequenceState, most: int) -> str | None:
        return self.lookup.offer(request, state, most) or self.model.offer(request, state, most)

    def most(self, state: SequenceState) -> int:
        return (self.lookup if state.offer else self.model).most(state)

    def watching(self, state: SequenceState) -> bool:
        return self.lookup.watching(state)

    def draft(self, jobs) -> dict:
        by_lookup = [job for job in jobs if job[1].offer is not None]
        by_model = [job for job in jobs if job[1].offer is None]
        return {**self.lookup.draft(by_lookup), **(self.model.draft(by_model) if by_model else {})}

    def rolled_back(self, request, kept: int) -> None:
        self.model.rolled_back(request, kept)

    def shifted(self, request, keep: int, discard: int) -> None:
        self.model.shifted(request, keep, discard)


def check_vocabularies(target_tokenizer, draft_tokenizer, draft_name: str) -> None:
    """A draft must tokenize as the target does: the same tokenizer kind and the same token
    texts for their common ids, their vocabularies differing by a little at most."""
    t, d = target_tokenizer, draft_tokenizer
    problem = None
    if t.model != d.model:
        problem = f"its tokenizer is {d.model}, the target's {t.model}"
    elif abs(t.n_vocab - d.n_vocab) > VOCAB_SLACK:
        problem = f"its vocabulary has {d.n_vocab} tokens, the target's {t.n_vocab}"
    else:
        n = min(t.n_vocab, d.n_vocab)
        differ = next((i for i in range(n) if t.tokens[i] != d.tokens[i]), None)
        if differ is not None:
            problem = f"token {differ} is {d.tokens[differ]!r} there, {t.tokens[differ]!r} here"
        elif (t.bos_id, t.eos_id) != (d.bos_id, d.eos_id):
            problem = "its BOS/EOS tokens differ from the target's"
    if problem:
        raise FastrunError(f"draft {draft_name} does not share the target's vocabulary: {problem}")


# -- the engine's side -----------------------------------------------------------------------------


@dataclass
class SpeculativeTotals:
    rounds: int = 0  # target passes that checked drafts (per sequence)
    drafted: int = 0
    accepted: int = 0

    def add(self, drafted: int, accepted: int) -> None:
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted

    def as_dict(self) -> dict:
        return {
            "rounds": self.rounds,
            "drafted_tokens": self.drafted,
            "accepted_tokens": self.accepted,
            "acceptance_rate": round(self.accepted / self.drafted, 4) if self.drafted else 0.0,
            "mean_accepted_length": round(self.accepted / self.rounds, 3) if self.rounds else 0.0,
        }


class Speculator:
    """What the engine asks of speculation each step: drafts for its decoding sequences
    (planned by measured costs and acceptance), then what was kept of them."""

    def __init__(
        self,
        drafter,
        settings: SpeculativeSettings,
        n_vocab: int,
        target_costs: PassCosts | None = None,
        chained_costs: PassCosts | None = None,
        acceptance: dict | None = None,
    ):
        self.drafter = drafter
        self.settings = settings
        drafter.n_vocab = n_vocab
        # seconds of a target step by its tokens: the target's, whichever drafter runs
        self.target_costs = target_costs if target_costs is not None else PassCosts()
        if drafter.costs is not None:  # one machine: the load slows both models alike
            self.target_costs.share_load(drafter.costs)
        # over every sequence, by drafter label (the Model's, kept across drafter switches:
        # what a label's drafts are worth is learned once for the model)
        self.acceptance: dict[str, Acceptance] = {} if acceptance is None else acceptance
        self.totals = SpeculativeTotals()
        # seconds of one step of greedy steps chained on the device, by sequences: what a
        # step without drafts costs where the engine can chain them (Backend.chain_steps)
        if chained_costs is None:
            chained_costs = PassCosts(clock=self.target_costs.clock)
        self.chained_costs = chained_costs
        self.target_costs.share_load(self.chained_costs)

    @property
    def kind(self) -> str:
        return self.drafter.kind

    def start(self, request) -> None:
        request.speculation = SequenceState()
        self.drafter.start(request, request.speculation)

    def _rate(self, state: SequenceState, label: str) -> float:
        overall = self.acceptance.setdefault(label, Acceptance())
        prior = self.drafter.prior(label)
        return state.acceptance.setdefault(label, Acceptance()).rate(overall.rate(prior))

    def drafts(self, requests: list, budget: int, chainable: bool = False) -> dict:
        """Drafts for some of the decoding requests (each then runs 1 + len(draft) tokens);
        budget: tokens the step may add. chainable: steps without drafts would be chained
        (quiet_steps), so drafts must beat a chained step's cost."""
        s = self.settings
        offers, labels = [], []
        for request in requests:
            state = request.speculation
            room = min(
                s.draft_max,
                request.cache.free_slots - 1,  # its last token and the drafts must fit
                request.params.max_tokens - len(request.completion.tokens) - 1,
                budget,
            )
            label = None
            if room >= max(1, s.draft_min):
                label = self.drafter.offer(request, state, room)
            labels.append(label)
            if label is None:
                offers.append((0.0, 0, 0))
                continue
            most = min(room, self.drafter.most(state))
            lead = self.drafter.lead(request, label)
            offers.append((self._rate(state, label), most, lead))
        plain = self.chained_costs.estimate(len(requests)) if chainable else None
        horizon = self._horizon(requests)
        costs = self.target_costs, self.drafter.costs
        plan = plan_drafts(offers, len(requests), *costs, plain=plain, horizon=horizon)
        jobs = []
        for request, label, k, offer in zip(requests, labels, plan, offers, strict=True):
            if label is None:
                continue
            # one wait per sequence whatever the label (lookup's n-gram lengths): a failed
            # probe costs a pass of two tokens, which on a CPU is a third of a step more
            probing = request.speculation.probing.setdefault(self.kind, Probing())
            if k >= max(1, s.draft_min):
                probing.drafting()
                request.speculation.quiet = -1  # the plan drafts: quiet no more
            elif self._probe_now(probing, offer[2], len(requests), horizon):
                k = max(1, s.draft_min)  # the plan declines: a one-token probe now and then
            else:
                continue
            jobs.append((request, request.speculation, k))
        drafts = self.drafter.draft(jobs) if jobs else {}
        drafts = {r: d for r, d in drafts.items() if len(d.tokens) >= s.draft_min}
        for request in requests:  # a probe leaves the count going
            state = request.speculation
            state.quiet = 0 if state.quiet < 0 else state.quiet + (request not in drafts)
        return drafts

    def quiet_steps(self, requests: list, most: int) -> int:
        """After a step in which no sequence drafted: how many steps without drafts, that one
        included, may run before the plans look again (the engine chains them on the device,
        each cheaper than a step alone). As many as every sequence has gone without a draft
        (a stretch that drafts do not fit tends to go on about as long as it has lasted, so
        chains double: 1, 2, 4, 8 steps), up to `most` and to any sequence's next probe;
        one step where a drafter is watching a sequence (lookup: a copy may be starting)."""
        steps = most
        for request in requests:
            state = request.speculation
            steps = min(steps, state.quiet)
            if self.drafter.watching(state):
                steps = 1
            for probing in state.probing.values():
                steps = min(steps, probing.wait - probing.declined)
        return max(steps, 1)

    def chained(self, requests: list, steps: int, seconds: float) -> None:
        """`steps` greedy steps ran chained (quiet_steps); the first was this step's, the
        rest count as declined steps too."""
        for request in requests:
            state = request.speculation
            state.quiet += steps - 1
            for probing in state.probing.values():
                probing.declined += steps - 1
        self.chained_costs.record(len(requests), seconds / steps)

    @staticmethod
    def _horizon(requests: list) -> float:
        """Tokens over which a one-time cost is spread (plan_drafts): the fewest any of the
        sequences has generated so far (at least one)."""
        return float(max(1, min(len(r.completion.tokens) for r in requests)))

    def _probe_now(self, probing: Probing, lead: int, n_plain: int = 1, horizon=1.0) -> bool:
        """A declined step: whether to probe the drafter. When its wait is up, if the probe is
        cheap; and a draft model is probed at the last step its probe is still cheap (it falls
        a token further behind each step), so that a reply whose first drafts failed (an
        explanation before the code) still finds the drafts that pay later."""
        due = probing.due()
        once = self.target_costs.one_time(n_plain + 1) * n_plain / horizon  # a size never run
        if not self._cheap_probe(lead, once):
            return False
        # two tokens short of dear: the costs drift from step to step
        return due or (lead > 0 and not self._cheap_probe(lead + 2))

    def _cheap_probe(self, lead: int, once: float = 0.0) -> bool:
        """Whether a one-token probe costs at most PROBE_COST_MAX plain steps beyond its own
        step: a draft model that fell far behind must first read every token it missed, so
        a drafter declined for long stays off for the rest of the request; `once`: its
        share of a size's one-time cost (plan_drafts' horizon), which this request alone
        pays, so held to PROBE_COST_MAX times less."""
        one = self.target_costs.estimate(1)
        if not one:  # no step measured yet: whether a new size costs a capture is not known
            return False
        if not (lead or once):
            return True
        extra = (self.target_costs.estimate(2) or one) - one
        catch_up = (self.drafter.costs.estimate(lead) or 0.0) if lead else 0.0
        held = PROBE_COST_MAX * once if once else 0.0
        return catch_up + extra + held <= PROBE_COST_MAX * one

    def checked(self, request, draft: Draft, accepted: int) -> None:
        """A draft was checked; `accepted` of its tokens were right."""
        n = len(draft.tokens)
        if accepted:  # a probe that was right: the plans look at the next steps again
            request.speculation.quiet = 0
        request.speculation.acceptance[draft.label].record(n, accepted)
        self.acceptance[draft.label].record(n, accepted)
        self.totals.add(n, accepted)
        out = request.completion
        out.draft_rounds += 1
        out.drafted_tokens += n
        out.accepted_tokens += accepted

    def rolled_back(self, request) -> None:
        self.drafter.rolled_back(request, request.cache.length)

    def prefill(self, requests: list) -> None:
        """These requests' prompts were run through the target: the drafter reads them too."""
        self.drafter.prefill(requests)

    def step_done(self, n_tokens: int, seconds: float) -> None:
        """A target step of only decoding sequences' tokens took `seconds`."""
        self.target_costs.record(n_tokens, seconds)

    def shifted(self, request, keep: int, discard: int) -> None:
        self.drafter.shifted(request, keep, discard)

    def stats(self) -> dict:
        """Totals of drafts, and the measured milliseconds of a pass by its tokens (the
        target's and the draft model's) that the plans read."""
        costs = {
            "target_pass_ms": self.target_costs.as_ms(),
            "chained_step_ms": self.chained_costs.as_ms(),
        }
        if self.drafter.costs is not None:
            costs["draft_pass_ms"] = self.drafter.costs.as_ms()
        return {"kind": self.kind, **self.totals.as_dict(), **costs}
