"""pallas_flash.bench.trace: bursts of stream kernels on hand-made traces, and device_times'
attribution of bursts to programs (the profiler faked; off a GPU it measures nothing)."""

import contextlib

import jax
import jax.numpy as jnp
import pytest

from pallas_flash.bench import trace


def _meta(tid, name):
    return {"ph": "M", "pid": 1, "tid": tid, "name": "thread_name", "args": {"name": name}}


def _span(tid, name, ts, dur):
    return {"ph": "X", "pid": 1, "tid": tid, "name": name, "ts": ts, "dur": dur}


def test_bursts_split_at_idle_gaps_only():
    events = [_meta(7, "Stream #7(Compute)"), _meta(3, "XLA Ops"),
              _span(7, "a", 0, 10), _span(7, "b", 5, 30),  # overlapping: one burst to 35
              _span(7, "c", 40, 5),  # 5 us after b's end: same burst
              _span(7, "d", 2000, 4), _span(7, "e", 2010, 1),
              _span(3, "host", 0, 5000)]  # not a stream track
    kernels = trace.stream_kernels(events)
    assert [e["name"] for e in kernels] == ["a", "b", "c", "d", "e"]
    found = trace.bursts(kernels, gap_us=100)
    assert [[e["name"] for e in b] for b in found] == [["a", "b", "c"], ["d", "e"]]
    assert [trace.span_us(b) for b in found] == [45, 11]
    # A gap measured from the latest end so far, not the previous kernel's: "c" starts 5 us
    # after b's end though 35 us after a's.
    assert len(trace.bursts(kernels, gap_us=6)) == 2
    assert trace.bursts([], gap_us=1) == []


def test_device_times_on_this_backend():
    # On a GPU, the real profiler: three positive times per job. Elsewhere nothing to read.
    f = jax.jit(lambda x: jnp.sin(x) @ x.T)
    jobs = [(f, (jnp.ones((256, 256)),)), (f, (jnp.ones((512, 512)),))]
    for job in jobs:
        jax.block_until_ready(job[0](*job[1]))
    times = trace.device_times(jobs)
    if jax.default_backend() != "gpu":
        assert times == [None, None]
        return
    assert all(len(t) == 3 and all(0 < x < 0.01 for x in t) for t in times), times


@pytest.fixture
def fake_profiler(monkeypatch):
    """device_times as on a GPU: each call of a job appends its burst (job i: i + 1 kernels of
    10 us, 1 us apart; a job given as "split" splits its second call in two, one given as
    "vary" runs one kernel more each call)."""
    calls, clock = [], [0.0]

    def job(i, split=False, vary=False):
        def f(x):
            n = 0 if split and sum(c == i for c in calls) == 1 else i + 1
            n += sum(c == i for c in calls) if vary else 0
            t = clock[0]
            calls.append(i)
            burst = [_span(7, f"k{i}", t + 11 * k, 10) for k in range(n or 2)]
            if n == 0:  # a gap inside the program: two bursts
                burst[1]["ts"] += 10 * trace.SPLIT_S * 1e6
            events.extend(burst)
            clock[0] = max(e["ts"] + e["dur"] for e in burst) + 10 * trace.SPLIT_S * 1e6
            return x
        return f

    events = [_meta(7, "Stream #7(Compute)")]
    monkeypatch.setattr(trace.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(trace.jax.profiler, "trace",
                        lambda *a, **k: contextlib.nullcontext())
    monkeypatch.setattr(trace, "find_trace", lambda log_dir: "fake")
    monkeypatch.setattr(trace, "load_events", lambda path: events)
    monkeypatch.setattr(trace, "PAUSE_S", 0.0)
    return job, calls


def test_device_times_attributes_bursts_in_round_order(fake_profiler):
    job, calls = fake_profiler
    jobs = [(job(0), (1,)), (job(1), (1,)), (job(2), (1,))]
    times = trace.device_times(jobs, rounds=3)
    assert calls == [0, 1, 2, 2, 1, 0, 0, 1, 2]
    # Job i's burst: i + 1 kernels, 10 us each, 11 us apart.
    assert times == [[pytest.approx((11 * i + 10) * 1e-6)] * 3 for i in range(3)]


def test_device_times_refuses_what_the_trace_cannot_tell(fake_profiler):
    job, calls = fake_profiler
    # One program whose kernels split into two bursts: the count of bursts no longer matches
    # the calls, so no job can be told apart.
    times = trace.device_times([(job(0), (1,)), (job(1, split=True), (1,))], rounds=2)
    assert times == [None, None]


def test_device_times_refuses_a_job_whose_kernels_vary(fake_profiler):
    job, calls = fake_profiler
    times = trace.device_times([(job(0), (1,)), (job(1, vary=True), (1,))], rounds=2)
    assert times[0] == [pytest.approx(10e-6)] * 2 and times[1] is None


def test_device_times_survive_a_profiler_that_fails(fake_profiler, monkeypatch):
    job, calls = fake_profiler

    def broken(*args, **kwargs):
        raise RuntimeError("no CUPTI")
    monkeypatch.setattr(trace.jax.profiler, "trace", broken)
    with pytest.warns(UserWarning, match="no CUPTI"):
        assert trace.device_times([(job(0), (1,))]) == [None]


def test_device_times_of_skips_the_jobs_that_raised(fake_profiler):
    job, calls = fake_profiler
    jobs = [(job(0), (1,)), (job(1), (1,)), (job(2), (1,))]
    results = [([1.0], None), (ValueError("no"), None), ([1.0], None)]
    times = trace.device_times_of(jobs, results)
    assert set(calls) == {0, 2} and times[1] is None
    assert times[0] == [pytest.approx(10e-6)] * 3 and times[2] == [pytest.approx(32e-6)] * 3


def test_smaller_time():
    assert trace.smaller_time(2.0, [1.0, 3.0, 1.5]) == (1.5, "gpu")
    assert trace.smaller_time(1.2, [1.0, 3.0, 1.5]) == (1.2, "wall")
    assert trace.smaller_time(1.2, None) == (1.2, "wall")
