"""Tests of the benchmark harness (pallas_flash.bench) that run on the CPU.

The smoke run goes through the whole pipeline in-process (timing, ratios,
sampled-row reference, JSON); on a CPU cuDNN is missing, which must come out
as an error row rather than a crash.
"""

import json
import math

import jax
import jax.numpy as jnp
import pytest

from pallas_flash.bench import accuracy, cases, impls, report, timing
from pallas_flash.bench.__main__ import main


def test_flops_formula_by_hand():
    # 4 * 8 * 16 * 2048 * 2048 * 128 = 274_877_906_944
    dense = cases.attention_flops(8, 2048, 2048, 16, 128, causal=False)
    assert dense == 274_877_906_944
    assert cases.attention_flops(8, 2048, 2048, 16, 128, causal=True) == 137_438_953_472
    assert cases.attention_flops(8, 2048, 2048, 16, 128, True, "bwd") == 343_597_383_680
    assert cases.attention_flops(8, 2048, 2048, 16, 128, True, "fwdbwd") == 481_036_337_152
    # MLA: QK^T at 192 and PV at 128, 2 * (192 + 128) = 4 * 160.
    assert (cases.attention_flops(8, 2048, 2048, 16, 192, False, head_dim_v=128)
            == cases.attention_flops(8, 2048, 2048, 16, 160, False))


def test_attended_pairs_of_variants():
    case = cases.Case(1, 16, 1, 1, 8, True, "window")
    # window 4 over 16 keys: rows 0..3 see 1..4 keys, rows 4..15 see 5 keys.
    assert cases.attended_pairs(case, {"window": (4, 0)}) == (1 + 2 + 3 + 4) + 12 * 5
    ids = jnp.array([[0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2]], jnp.int32)
    pairs = cases.attended_pairs(case, {"q_segment_ids": ids, "kv_segment_ids": ids})
    assert pairs == 3 * 4 / 2 + 2 * 3 / 2 + 11 * 12 / 2


def test_packed_segment_ids_cover_all_documents():
    ids = cases.packed_segment_ids(jax.random.key(1), 1024, 12)
    assert ids.shape == (1, 1024)
    counts = jnp.bincount(ids[0], length=12)
    assert int(counts.min()) >= 1 and int(counts.sum()) == 1024
    assert bool(jnp.all(jnp.diff(ids[0]) >= 0))


def test_parse_helpers():
    assert cases.parse_case("2x8192x32x8x128") == (2, 8192, 32, 8, 128)
    assert cases.parse_case("1x8192x16x16x192x128") == (1, 8192, 16, 16, 192, 128)
    assert [cases.parse_seq(s) for s in ("32k", "1M", "300")] == [32768, 1 << 20, 300]
    assert cases.seq_label(4 << 20) == "4M"


@pytest.mark.parametrize("opts", [
    dict(causal=False),
    dict(causal=True),
    dict(causal=True, window=(5, 0)),
    dict(causal=False, window=(3, 2)),
    dict(causal=True, softcap=5.0),
    dict(causal=True, segments=True),
])
def test_reference_rows_matches_reference_attention(opts):
    """The sampled-row reference equals the library's full reference, sliced."""
    import pallas_flash

    opts = dict(opts)
    key = jax.random.key(0)
    kq, kk, kv, ks = jax.random.split(key, 4)
    b, s, hq, hkv, d = 2, 40, 4, 2, 16
    q = jax.random.normal(kq, (b, s, hq, d), jnp.float32)
    k = jax.random.normal(kk, (b, s, hkv, d), jnp.float32)
    v = jax.random.normal(kv, (b, s, hkv, d), jnp.float32)
    if opts.pop("segments", False):
        ids = jnp.broadcast_to(cases.packed_segment_ids(ks, s, 4), (b, s))
        opts.update(q_segment_ids=ids, kv_segment_ids=ids)
    rows = jnp.array([0, 3, 17, 39])
    got = accuracy.reference_rows(q, k, v, rows, **opts)
    want = pallas_flash.reference_attention(q, k, v, **opts)[:, rows]
    assert jnp.allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    result = main(["--smoke", "--out", str(out)])
    return result, out


def test_smoke_writes_json(smoke):
    result, out = smoke
    files = list(out.glob("bench_*.json"))
    assert len(files) == 1
    saved = json.loads(files[0].read_text())
    assert saved["meta"]["jax_version"] == jax.__version__
    assert saved["meta"]["gpu"] and saved["meta"]["date_utc"]
    assert saved["complete"] is True
    impls = {(r["impl"], r["causal"]) for r in saved["results"]}
    assert {i for i, _ in impls} == {"pallas_flash", "cudnn", "xla"}
    assert len(saved["results"]) == len(impls)  # one row per (impl, causal)
    assert not list(out.glob("*.png"))  # no plot unless asked


def _finite_positive(x):
    return x is not None and math.isfinite(x) and x > 0


def test_smoke_numbers(smoke):
    result, _ = smoke
    for r in result["results"]:
        if r["impl"] == "cudnn":
            continue
        assert r["status"] == "ok", r
        # The backward is timed on its own (not as a difference of two medians, which could
        # come out negative), so every timing is positive.
        for field in ("fwd_ms", "bwd_ms", "fwdbwd_ms", "fwd_tflops", "bwd_tflops",
                      "fwdbwd_tflops", "err_vs_ref"):
            assert _finite_positive(r[field]), (r["impl"], field, r[field])
        assert len(r["bwd_times_ms"]) == len(r["fwdbwd_times_ms"])
        assert r["ref_rows"] < r["seq"]  # the sampled-row path was exercised


def test_progress_line_reports_each_row_as_it_finishes():
    ok = {"status": "ok", "fwd_ms": 1.7334, "fwd_tflops": 634.51, "bwd_ms": 5.637,
          "bwd_tflops": 487.62}
    assert timing.progress_line(ok) == "fwd 1.733 ms 634.5 TF/s, bwd 5.637 ms 487.6 TF/s"
    assert timing.progress_line({**ok, "bwd_ms": None, "bwd_tflops": None}) == (
        "fwd 1.733 ms 634.5 TF/s")
    assert timing.progress_line({"status": "error", "error": "OOM: out of memory"}) == (
        "error: OOM: out of memory")


def test_smoke_cudnn_is_an_error_row_on_cpu(smoke):
    result, _ = smoke
    if jax.default_backend() != "cpu":
        pytest.skip("cuDNN may work here")
    rows = [r for r in result["results"] if r["impl"] == "cudnn"]
    assert rows and all(r["status"] == "error" and r["error"] for r in rows)
    assert all(r["err_vs_cudnn"] is None for r in result["results"])


def test_smoke_accuracy(smoke):
    result, _ = smoke
    for r in result["results"]:
        if r["impl"] in ("pallas_flash", "xla"):
            assert r["err_vs_ref"] < 2e-2, r


def test_failing_impl_does_not_stop_the_run(tmp_path, monkeypatch):
    def boom(q, k, v, causal, **kw):
        raise RuntimeError("kaboom\nsecond line")

    monkeypatch.setitem(impls.IMPLS, "boom", boom)
    result = main(["--smoke", "--impls", "boom,xla", "--causal", "no",
                         "--out", str(tmp_path)])
    by_impl = {r["impl"]: r for r in result["results"]}
    assert by_impl["boom"]["status"] == "error"
    assert by_impl["boom"]["error"] == "RuntimeError: kaboom"
    assert by_impl["xla"]["status"] == "ok"
    assert "error: RuntimeError: kaboom" in report.format_table(result["results"])


def test_memory_children_may_use_most_of_the_device(monkeypatch):
    """Without preallocation JAX's allocator stops at 75% of the device unless told a share:
    the children get MEMORY_FRACTION, and a share the caller set stands."""
    from pallas_flash.bench import memory
    for name in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION"):
        monkeypatch.delenv(name, raising=False)
    env = memory.child_env()
    assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert env["XLA_CLIENT_MEM_FRACTION"] == memory.MEMORY_FRACTION
    for name in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION"):
        monkeypatch.setenv(name, "0.5")
        env = memory.child_env()
        assert env[name] == "0.5"
        assert sum(k.endswith("MEM_FRACTION") for k in env) == 1
        monkeypatch.delenv(name)


def test_memory_mode_runs_children(tmp_path):
    """Plumbing of --memory: one fresh subprocess per point, JSON back."""
    result = main(["--memory", "--memory-seqs", "256", "--impls", "xla",
                         "--no-plot", "--out", str(tmp_path)])
    (point,) = result["memory"]["points"]
    assert point["status"] == "ok", point
    assert point["floor_bytes"] == 8 * 256 * 16 * 128 * 2
    assert point["step_s"] > 0
    assert result["memory"]["longest_seq_ok"] == {"xla": 256}
    assert list(tmp_path.glob("memory_*.json"))
    # Fewer heads (a shorter step at the longest lengths): the child and the floor take them.
    result = main(["--memory", "--memory-seqs", "256", "--impls", "xla", "--memory-heads", "2",
                   "--no-plot", "--out", str(tmp_path)])
    (point,) = result["memory"]["points"]
    assert point["status"] == "ok", point
    assert point["floor_bytes"] == 8 * 256 * 2 * 128 * 2
    assert result["memory"]["shape"]["q_heads"] == 2


def test_mla_case_small(tmp_path):
    """A case with V's own head_dim: inputs, FLOPs and the sampled-row reference follow it;
    jax.nn's implementations have no such case and leave error rows."""
    result = main(["--smoke", "--cases", "1x64x2x1x32x16", "--causal", "yes",
                   "--impls", "pallas_flash,xla", "--out", str(tmp_path)])
    rows = {r["impl"]: r for r in result["results"]}
    ours = rows["pallas_flash"]
    assert ours["status"] == "ok", ours
    assert ours["case"] == "1x64x2x1x32x16" and ours["head_dim_v"] == 16
    assert ours["fwd_flops"] == cases.attention_flops(1, 64, 64, 2, 32, True, head_dim_v=16)
    assert ours["err_vs_ref"] < 2e-2
    assert rows["xla"]["status"] != "ok"


def test_variants_small(tmp_path, monkeypatch):
    """Variant plumbing on tiny shapes: options reach each impl, plain row, n.a. rows."""
    monkeypatch.setattr(cases, "WINDOW", (12, 0))
    monkeypatch.setattr(cases, "variant_cases", lambda: [
        cases.Case(1, 64, 1, 1, 16, True, "packed"),
        cases.Case(1, 64, 1, 1, 16, True, "window"),
        cases.Case(1, 64, 1, 1, 16, True, "softcap"),
        cases.Case(1, 64, 2, 1, 16, True, "sinks"),
    ])
    result = main(["--smoke", "--cases", "none", "--variants",
                         "--impls", "pallas_flash,xla", "--out", str(tmp_path)])
    rows = {(r["variant"], r["impl"]): r for r in result["results"]}
    assert len(rows) == 12
    assert rows[("softcap", "xla")]["status"] == "n.a."
    assert rows[("sinks", "xla")]["status"] == "n.a."
    for (variant, impl), r in rows.items():
        if r["status"] == "n.a.":
            continue
        assert r["status"] == "ok", r
        # xla expresses segments as a dense mask and the window through
        # local_window_size: agreeing with the reference checks the translation.
        assert r["err_vs_ref"] < 2e-2, r
        heads = 2 if variant == "sinks" else 1
        if impl == cases.PLAIN or variant == "sinks":
            assert r["fwd_flops"] == cases.attention_flops(1, 64, 64, heads, 16, True)
        elif variant != "softcap":
            assert r["fwd_flops"] < cases.attention_flops(1, 64, 64, 1, 16, True)
    assert "n.a.: no softcap" in report.format_table(result["results"])
    # Named variants run alone, each beside its plain row.
    result = main(["--smoke", "--cases", "none", "--variants", "sinks",
                   "--impls", "pallas_flash", "--out", str(tmp_path)])
    assert {(r["variant"], r["impl"]) for r in result["results"]} == {
        ("sinks", "pallas_flash"), ("sinks", cases.PLAIN)}
    with pytest.raises(SystemExit):
        main(["--smoke", "--cases", "none", "--variants", "sinks,dropout", "--out",
              str(tmp_path)])


def test_comparators_take_the_dense_mask_as_an_argument(tmp_path, monkeypatch):
    """APIs without segment ids get the packed case's dense mask built once, before the timed
    functions, as a jit argument (a model holds its mask); ours get the segment ids."""
    seen = {}

    def spy(name, fn):
        def wrapped(q, k, v, causal, **kw):
            seen.setdefault(name, set()).update(kw)
            return fn(q, k, v, causal, **kw)
        return wrapped

    for name in ("pallas_flash", "xla"):
        monkeypatch.setitem(impls.IMPLS, name, spy(name, impls.IMPLS[name]))
    monkeypatch.setattr(cases, "variant_cases", lambda: [cases.Case(1, 64, 1, 1, 16, True,
                                                                    "packed")])
    result = main(["--smoke", "--cases", "none", "--variants", "packed",
                   "--impls", "pallas_flash,xla", "--out", str(tmp_path)])
    assert {r["status"] for r in result["results"]} == {"ok"}
    assert impls.DENSE_MASK in seen["xla"] and impls.DENSE_MASK not in seen["pallas_flash"]
    assert "q_segment_ids" in seen["pallas_flash"]
    mask = impls.dense_segment_mask(jnp.array([[0, 0, 1]]), jnp.array([[0, 1, 1]]))
    kw = {"q_segment_ids": 0, "kv_segment_ids": 0, impls.DENSE_MASK: mask}
    assert impls.pop_segment_mask(kw) is mask and not kw


def test_runs_started_in_one_second_get_their_own_files(tmp_path):
    # Two benchmark processes started in the same second (one per GPU of a host) must not
    # write the same bench_<stamp>.json.
    first = report.claim_stem(str(tmp_path), "bench", "20261130-031413")
    second = report.claim_stem(str(tmp_path), "bench", "20261130-031413")
    assert first == "bench_20261130-031413"
    assert second == "bench_20261130-031413-2"
    assert {p.name for p in tmp_path.iterdir()} == {first + ".json", second + ".json"}


@pytest.mark.parametrize("pipelined", [False, True])
def test_timer_calls_and_times(pipelined):
    """Per call: one time per call. Pipelined: one mean per batch of back-to-back calls, three
    batches. Either way the warmup calls come first and the last result is returned."""
    calls = []

    def f(x):
        calls.append(1)
        return x + len(calls)

    times, out = timing.time_calls(f, (jnp.zeros(3),), iters=4, warmup=2, pipelined=pipelined)
    assert len(times) == (3 if pipelined else 4) and all(t > 0 for t in times)
    assert len(calls) == 2 + (3 * 4 if pipelined else 4)
    assert float(out[0]) == len(calls)


@pytest.mark.parametrize("pipelined", [False, True])
def test_interleaved_timer_alternates_and_keeps_failures(pipelined):
    """Each function's warmup calls first; then rounds that time one batch of every function
    in turn, the order reversed each round; a function that raises, or an exception in place of
    one, is that job's result and the others are timed as if it were not there."""
    log = []

    def make(name):
        def f(x):
            log.append(name)
            return x + len(log)
        return f

    def broken(x):
        raise ValueError("no kernel for this case")

    uncompiled = RuntimeError("failed to compile")
    jobs = [(make("a"), (jnp.zeros(3),)), (broken, (jnp.zeros(3),)), (make("b"), (jnp.zeros(3),)),
            (uncompiled, (jnp.zeros(3),))]
    results = timing.time_interleaved(jobs, iters=3, warmup=2, pipelined=pipelined)
    (ta, out_a), (tb, out_b), (tc, out_c), (td, out_d) = results
    assert isinstance(tb, ValueError) and out_b is None
    assert td is uncompiled and out_d is None
    per_batch = 3 if pipelined else 1
    assert len(ta) == len(tc) == 3 and all(t > 0 for t in ta + tc)
    # Warmups a a b b, then rounds: a b | b a | a b, each a batch of per_batch calls.
    rounds = ["a", "b", "b", "a", "a", "b"]
    assert log == ["a", "a", "b", "b"] + [n for n in rounds for _ in range(per_batch)]
    assert float(out_c[0]) == len(log)


def test_smoke_renders_as_markdown(smoke):
    """A run's own JSON goes through the report: one table row per result row, the failing
    cuDNN rows with their error; the headline falls back to the cases the run has."""
    result, _ = smoke
    speed = report.markdown_speed([("bench.json", result)])
    table = [line for line in speed.splitlines() if line.startswith("| 1 × 128 × 2 × 1 × 32 |")]
    assert len(table) == len(result["results"])
    headline = report.markdown_headline([("bench.json", result)])
    assert headline.count("| 1 × 128, 2 q / 1 kv heads, d 32 |") == 2  # both masks


def test_short_error_names_the_allocation_that_failed():
    from pallas_flash.bench.impls import short_error
    oom = RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 60.30GiB "
                       "with allocator GPU_0_bfc on device 0.\nmore")
    assert short_error(oom) == "OOM: could not allocate 60.30GiB"
    assert short_error(RuntimeError("CUDA: out of memory")) == "OOM: CUDA: out of memory"
    assert short_error(ValueError("bad\nline two")) == "ValueError: bad"


def test_tokamax_is_an_implementation_that_says_when_it_is_absent():
    import importlib.util

    from pallas_flash.bench.impls import IMPLS, NotApplicable
    if importlib.util.find_spec("tokamax") is not None:
        pytest.skip("tokamax is installed: the benchmark times it on a GPU")
    x = jnp.ones((1, 8, 2, 16), jnp.float32)
    with pytest.raises(NotApplicable, match="tokamax is not importable"):
        IMPLS["tokamax"](x, x, x, True)


def test_reference_rows_take_sinks():
    # The sampled-rows reference with sinks agrees with reference_attention's.
    import pallas_flash as pf
    keys = jax.random.split(jax.random.PRNGKey(7), 4)
    q = jax.random.normal(keys[0], (2, 40, 4, 16), jnp.float32)
    k, v = (jax.random.normal(kk, (2, 40, 2, 16), jnp.float32) for kk in keys[1:3])
    sinks = 2.0 * jax.random.normal(keys[3], (4,), jnp.float32)
    rows = jnp.array([0, 7, 39])
    got = accuracy.reference_rows(q, k, v, rows, causal=True, sinks=sinks)
    want = pf.reference_attention(q, k, v, causal=True, sinks=sinks)[:, rows]
    assert accuracy.rel_err(got, want) < 1e-5
    plain = accuracy.reference_rows(q, k, v, rows, causal=True)
    assert accuracy.rel_err(plain, want) > 1e-3   # the sinks change the result


def test_a_run_cut_in_its_accuracy_check_keeps_its_timed_rows(tmp_path, monkeypatch):
    """A time limit can cut a long case after its timings, while the accuracy check runs: the
    JSON already holds every timed row, with its ratios, and says the run is incomplete."""
    class Cut(Exception):
        pass

    def cut(*args, **kwargs):
        raise Cut

    monkeypatch.setattr(timing, "add_accuracy", cut)
    with pytest.raises(Cut):
        main(["--smoke", "--impls", "pallas_flash,xla", "--causal", "no", "--out",
              str(tmp_path)])
    saved = json.loads(next(tmp_path.glob("bench_*.json")).read_text())
    assert saved["complete"] is False
    assert [r["impl"] for r in saved["results"]] == ["pallas_flash", "xla"]
    assert all(_finite_positive(r["fwd_ms"]) for r in saved["results"])
