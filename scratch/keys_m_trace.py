"""Split kernels alone, rows-as-M (pallas_flash.mosaic.decode) against keys-as-M (the
prototype), timed from a profiler trace of chained calls; one line per (kernel, case)."""
import os, sys
import jax, jax.numpy as jnp
sys.path.insert(0, os.path.join(os.path.dirname(__file__)))
sys.path.insert(0, "benchmarks")
from decode_trace import breakdown
from ring_trace import find_trace, load_events
from pallas_flash import decode
from pallas_flash.mosaic import decode as mosaic
from pallas_flash.bench.decode import repeated
OUT = os.environ.get("OUT", "/tmp")
CALLS = 16
for spec in (sys.argv[1:] or ["1:4096", "1:16384", "1:131072", "4:16384"]):
    b, ctx = (int(x) for x in spec.split(":"))
    h, group, d = 8, 4, 128
    splits = decode.choose_num_splits(b, h, ctx, decode._sm_count())
    splits, chunk = decode.split_geometry(ctx, splits, 64)
    plan = decode.DecodePlan(batch=b, q_len=1, q_heads=h * group, kv_heads=h, head_dim=d, group=group,
        rows=group, max_len=ctx, pages_per_seq=None, page_size=None, num_splits=splits, chunk=chunk,
        scale=d ** -0.5, softcap=None, window_left=None, dtype=jnp.dtype(jnp.bfloat16), interpret=False)
    ks = jax.random.split(jax.random.key(0), 3)
    qs = [jax.random.normal(jax.random.fold_in(ks[0], i), (b, h, group, d), jnp.bfloat16) for i in range(CALLS)]
    shape = (b, ctx, h, d)
    caches = [(jax.random.normal(jax.random.fold_in(ks[1], c), shape, jnp.bfloat16),
               jax.random.normal(jax.random.fold_in(ks[2], c), shape, jnp.bfloat16)) for c in range(4)]
    lens = jnp.full((b,), ctx, jnp.int32)
    ref = None
    rows_tiles = mosaic.DecodeTiles(64, 2, 1)
    keys_tiles = mosaic.DecodeTiles(64, 2, 1, keys_as_m=True)
    def rows_layout(o):   # d-major [.., d, n] -> [.., rows, d]
        return jnp.swapaxes(o, -1, -2)[..., :plan.rows, :]
    for name, fn in (("rows_m", lambda q, k, v, n: mosaic.partial(plan, q, k, v, n, None, tiles=rows_tiles)[0]),
                     ("keys_m", lambda q, k, v, n: rows_layout(mosaic.partial(plan, q, k, v, n, None, tiles=keys_tiles)[0])),
                     ("keys_m_4st", lambda q, k, v, n: rows_layout(mosaic.partial(plan, q, k, v, n, None, tiles=mosaic.DecodeTiles(64, 4, 1, keys_as_m=True))[0]))):
        try:
            run = jax.jit(repeated(fn, CALLS))
            outs = jax.block_until_ready(run(qs, caches, lens))
            for _ in range(2):
                jax.block_until_ready(run(qs, caches, lens))
            log_dir = os.path.join(OUT, f"kt_{name}_{spec.replace(':', '_')}")
            with jax.profiler.trace(log_dir, create_perfetto_trace=True):
                jax.block_until_ready(run(qs, caches, lens))
            r = breakdown(load_events(find_trace(log_dir)), CALLS)
            kern = [k for k in r["kernels"] if "pallas_flash" in k["name"]]
            gbps = b * ctx * h * d * 2 * 2 / (kern[0]["mean_us"] * 1e-6) / 1e9 if kern else None
            print(f"{spec:>10} splits {splits:3d} {name}: kernel {kern[0]['mean_us'] if kern else None:.2f} us"
                  f" ({gbps:.0f} GB/s), call {r['per_call_us']:.2f} us", flush=True)
            if name == "rows_m":
                ref = outs
            elif ref is not None:
                err = max(float(jnp.max(jnp.abs(a - c))) for a, c in zip(outs, ref))
                print(f"{'':>10} max |keys_m - rows_m| over the outputs: {err:.3g}", flush=True)
        except Exception as e:
            print(spec, name, "ERROR", type(e).__name__, str(e)[:600], flush=True)
