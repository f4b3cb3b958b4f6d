"""The CPU backend's thread policy: its decisions on synthetic step times, and its seam."""

import pytest

from fastrun.backends.cpu.threads import AdaptiveSettings, AdaptiveThreads, FixedThreads, candidates

KEY = (1, 1)  # a one-token decode step's key


def decode(policy, step_seconds, steps: int, key=KEY) -> list[int]:
    """Run `steps` steps, each taking step_seconds(threads); the counts they ran on."""
    used = []
    for _ in range(steps):
        threads = policy.for_step(key)
        policy.record(key, threads, step_seconds(threads))
        used.append(threads)
    return used


QUIET = {1: 0.017, 2: 0.010}.get  # two free cores: 2 threads are faster
BUSY = {1: 0.018, 2: 0.048}.get  # one core busy: 2 threads wait on the descheduled one


def test_a_free_machine_keeps_every_thread_and_probes_rarely():
    policy = AdaptiveThreads(2)
    used = decode(policy, QUIET, 1000)  # 10 s of decode
    assert policy.current(KEY) == 2
    # probes double their interval while they confirm; one step each: 1 thread is hopeless
    assert used.count(1) <= 8


def test_a_busy_core_moves_decode_to_one_thread_within_the_first_probe():
    policy = AdaptiveThreads(2)
    used = decode(policy, BUSY, 400)
    first_probe = AdaptiveSettings().first_probe / BUSY(2)
    assert policy.current(KEY) == 1
    assert used[int(first_probe) + 6 :].count(2) <= 12  # re-probes only, each cut short


def test_load_that_starts_midway_is_noticed_by_the_slowdown_not_the_interval():
    policy = AdaptiveThreads(2)
    decode(policy, QUIET, 2000)  # probes now come every 3 s: 300 steps
    steps = 0
    while policy.current(KEY) == 2:
        decode(policy, BUSY, 1)
        steps += 1
    assert steps <= 12  # a few recent steps slower than before, then a probe


def test_load_that_ends_brings_the_threads_back_at_the_next_probe():
    policy = AdaptiveThreads(2)
    decode(policy, BUSY, 500)
    assert policy.current(KEY) == 1
    longest = AdaptiveSettings().longest_interval
    decode(policy, QUIET, int(longest / QUIET(1)) + 10)
    assert policy.current(KEY) == 2


def test_a_count_within_the_margin_does_not_switch():
    policy = AdaptiveThreads(2)
    decode(policy, {1: 0.0100, 2: 0.0102}.get, 1000)
    assert policy.current(KEY) == 2


def test_step_sizes_are_measured_apart():
    policy = AdaptiveThreads(2)
    decode(policy, BUSY, 400, key=(1, 1))
    decode(policy, QUIET, 400, key=(8, 1))
    assert policy.current((1, 1)) == 1 and policy.current((8, 1)) == 2


def test_many_cores_probe_the_neighbouring_counts():
    assert candidates(2) == [1, 2]
    assert candidates(16) == [1, 8, 15, 16]
    policy = AdaptiveThreads(16)
    one_core_busy = {1: 0.1, 8: 0.02, 15: 0.01, 16: 0.05}.get
    used = decode(policy, one_core_busy, 200)
    assert policy.current(KEY) == 15
    assert 1 not in used  # never tried: not a neighbour of 16 or 15


def test_fixed_threads_never_change():
    policy = FixedThreads(2)
    assert set(decode(policy, BUSY, 200)) == {2}
    assert policy.describe() == "2"


@pytest.mark.parametrize("threads, expect", [(None, AdaptiveThreads), (1, FixedThreads)])
def test_the_backend_consults_its_policy_for_decode_steps(threads, expect):
    import numba
    import numpy as np

    from fastrun.backends.cpu import CPUBackend

    backend = CPUBackend(threads=threads)
    assert isinstance(backend.thread_policy, expect)
    seen = []

    class Spy(type(backend.thread_policy)):
        def for_step(self, key):
            return 1

        def record(self, key, threads, seconds):
            seen.append((key, threads, numba.get_num_threads()))

    backend.thread_policy = Spy(backend.threads)
    out = backend.run_step(None, (1, 0), lambda x: x * 2, np.ones(3, np.float32))
    assert out.tolist() == [2, 2, 2]
    assert seen == [((1, 0), 1, 1)]
    assert numba.get_num_threads() == backend.threads  # other passes: every thread


def test_threads_reach_the_cpu_backend_through_auto(tiny_model):
    from fastrun.backends.cuda import cuda_available
    from fastrun.runner.api import Model

    if cuda_available():
        pytest.skip("auto picks the GPU here")
    model = Model(tiny_model, backend="auto", threads=1, n_ctx=32)
    try:
        assert isinstance(model.backend.thread_policy, FixedThreads)
    finally:
        model.close()
