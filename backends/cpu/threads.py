"""How many threads each decode step of the CPU backend runs on.

Numba's parallel loops (OpenMP layer) split every loop statically, one equal chunk per thread,
and end in a barrier: a step waits for its slowest chunk. A decode step is a few hundred such
loops of tens of microseconds each, so when another process holds one of the cores, the thread
that shares that core is descheduled for whole time slices (milliseconds) and every loop
waits for it: on 2 cores with one busy, 2 threads decode at a fraction of 1 thread's speed.
Static splitting cannot know which core is free; dynamic splitting would still wait for a
chunk held by a descheduled thread. What works is to run on fewer threads while the load
lasts, and that is decided by measuring: the step times say which count is faster now.

`FixedThreads` is `--threads N`. `AdaptiveThreads` times decode steps and, every so often (and
at once when the steps of the current count slow down suddenly), runs a few steps on the
neighbouring counts, keeping whichever is fastest. Outputs do not depend on the thread count
(each output is computed in the same order whatever the split), so switching is invisible.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field


class FixedThreads:
    """The same count for every step (`--threads N` pins it)."""

    def __init__(self, count: int):
        self.most = self.count = count

    def for_step(self, key) -> int:
        return self.count

    def record(self, key, threads: int, seconds: float) -> None:
        pass

    def describe(self) -> str:
        return str(self.count)


@dataclass(frozen=True)
class AdaptiveSettings:
    """first_probe: seconds of decode (of one step size) before the first probe; probes
    then come after intervals that double while they confirm the current count, up to
    longest_interval (back to after_switch after a switch, first_probe after a slowdown).
    rounds: steps per candidate in a probe, interleaved. margin: how much faster (as a
    fraction) another count must be to switch. slowdown: the current count's recent steps
    this many times slower than before it starts a probe at once. give_up: a probed count
    whose step took this many times the current count's median runs no more rounds (a
    probe costs what its losers lose)."""

    first_probe: float = 0.1  # a fresh process under load learns within a few steps
    after_switch: float = 0.5  # the interval a switch restarts from (a probe costs steps)
    longest_interval: float = 3.0
    rounds: int = 2
    margin: float = 0.05
    slowdown: float = 1.6
    give_up: float = 1.5
    recent: int = 4  # steps compared with the ones before them, for a slowdown
    history: int = 16


def candidates(most: int) -> list[int]:
    """Counts worth trying on `most` cores: all of them, or for many cores the usual loads'
    answers (one core busy, half busy, one free)."""
    if most <= 4:
        return list(range(1, most + 1))
    return sorted({1, most // 2, most - 1, most})


@dataclass
class _StepSize:
    """The controller's state for steps of one size (their times differ by size)."""

    current: int
    times: deque = field(default_factory=deque)  # recent step seconds at `current`
    decode_seconds: float = 0.0  # time spent in these steps, a clock that stops when idle
    next_probe: float = 0.0
    interval: float = 0.0
    probe: list[int] = field(default_factory=list)  # counts still to run, in order
    samples: dict[int, list[float]] = field(default_factory=dict)


class AdaptiveThreads:
    """The thread count for each decode step, from the measured step times (module doc)."""

    def __init__(self, most: int, settings: AdaptiveSettings | None = None):
        self.most = most
        self.settings = s = settings or AdaptiveSettings()
        self.counts = candidates(most)
        self._sizes: dict = {}
        self._fresh = lambda: _StepSize(
            most, deque(maxlen=s.history), next_probe=s.first_probe, interval=s.first_probe
        )

    def describe(self) -> str:
        return f"auto (1-{self.most})"

    def current(self, key) -> int:
        """The count that steps of this key run on outside probes."""
        state = self._sizes.get(key)
        return self.most if state is None else state.current

    def for_step(self, key) -> int:
        state = self._sizes.get(key)
        if state is None:
            state = self._sizes[key] = self._fresh()
        return state.probe[0] if state.probe else state.current

    def record(self, key, threads: int, seconds: float) -> None:
        state = self._sizes.get(key)
        if state is None:
            return
        state.decode_seconds += seconds
        if state.probe:
            if threads == state.probe[0]:
                state.samples.setdefault(threads, []).append(seconds)
                state.probe.pop(0)
                if threads != state.current and self._hopeless(state, seconds):
                    state.probe = [c for c in state.probe if c != threads]
            if not state.probe:
                self._decide(state)
            return
        if threads != state.current:
            return
        state.times.append(seconds)
        if self._slowed_down(state):
            state.interval = self.settings.first_probe
            self._start_probe(state)
        elif state.decode_seconds >= state.next_probe:
            self._start_probe(state)

    def _slowed_down(self, state: _StepSize) -> bool:
        s = self.settings
        times = list(state.times)
        if len(times) < 2 * s.recent:
            return False
        before = statistics.median(times[: -s.recent])
        return statistics.median(times[-s.recent :]) > s.slowdown * before

    def _hopeless(self, state: _StepSize, seconds: float) -> bool:
        if not state.times:
            return False
        return seconds > self.settings.give_up * statistics.median(state.times)

    def _start_probe(self, state: _StepSize) -> None:
        """Queue the rounds: the current count and its neighbours among the candidates,
        interleaved so that a change of load while probing touches them alike."""
        at = self.counts.index(state.current)
        tried = self.counts[max(0, at - 1) : at + 2]
        state.probe = [c for _ in range(self.settings.rounds) for c in tried]
        state.samples = {}

    def _decide(self, state: _StepSize) -> None:
        """Keep the current count unless another was faster by the margin; the probe's
        samples of the winner start its history (the load may have changed the times)."""
        mean = {c: statistics.fmean(v) for c, v in state.samples.items()}
        best = min(mean, key=mean.get)
        if mean[best] < mean[state.current] * (1 - self.settings.margin):
            state.current = best
            state.interval = self.settings.after_switch
        else:
            state.interval = min(2 * state.interval, self.settings.longest_interval)
        state.times.clear()
        state.times.extend(state.samples[state.current])
        state.next_probe = state.decode_seconds + state.interval
