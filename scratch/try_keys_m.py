import sys, time, traceback
import jax, jax.numpy as jnp
sys.path.insert(0, "scratch")
import decode_keys_m as km
from pallas_flash import decode
def plan(interpret, b=1, h=2, group=4, q_len=1, max_len=1024, splits=4, chunk=256, d=128):
    return decode.DecodePlan(batch=b, q_len=q_len, q_heads=h * group, kv_heads=h, head_dim=d, group=group,
        rows=group * q_len, max_len=max_len, pages_per_seq=None, page_size=None, num_splits=splits, chunk=chunk,
        scale=d ** -0.5, softcap=None, window_left=None, dtype=jnp.dtype(jnp.bfloat16), interpret=interpret)
mode = sys.argv[1]
if mode == "lower":
    p = plan(False)
    q = jnp.zeros((p.batch, p.kv_heads, p.rows, p.head_dim), p.dtype)
    cache = jnp.zeros((p.batch, p.max_len, p.kv_heads, p.head_dim), p.dtype)
    fn = jax.jit(lambda q, k, v, n: km.partial(p, q, k, v, n))
    t = time.time()
    try:
        text = fn.trace(q, cache, cache, jnp.zeros((p.batch,), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
        print("lowered", "mosaic_gpu" in text, time.time() - t)
    except Exception as e:
        traceback.print_exc(limit=3); print("ERR", str(e)[:1500])
else:
    from pallas_flash.mosaic import decode as mosaic
    import numpy as np
    p = plan(True)
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (p.batch, p.kv_heads, p.rows, p.head_dim), p.dtype)
    kc = jax.random.normal(ks[1], (p.batch, p.max_len, p.kv_heads, p.head_dim), p.dtype)
    vc = jax.random.normal(ks[2], (p.batch, p.max_len, p.kv_heads, p.head_dim), p.dtype)
    lens = jnp.array([700], jnp.int32)
    o1, l1 = km.partial(p, q, kc, vc, lens)
    o2, l2 = mosaic.partial(p, q, kc, vc, lens, None)
    print("o diff", float(jnp.max(jnp.abs(o1 - o2))), "lse diff", float(jnp.nanmax(jnp.abs(jnp.where(jnp.isinf(l2), 0, l1 - l2)))))
    print(np.asarray(l1[0,0,:,:]), np.asarray(l2[0,0,:,:]))
