import sys
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, "scratch")
import decode_keys_m as km
from pallas_flash import decode
from pallas_flash.mosaic import decode as mosaic
def plan(b, h, group, q_len, max_len, splits, chunk, d):
    return decode.DecodePlan(batch=b, q_len=q_len, q_heads=h * group, kv_heads=h, head_dim=d, group=group,
        rows=group * q_len, max_len=max_len, pages_per_seq=None, page_size=None, num_splits=splits, chunk=chunk,
        scale=d ** -0.5, softcap=None, window_left=None, dtype=jnp.dtype(jnp.bfloat16), interpret=True)
for (b, h, group, q_len, max_len, splits, chunk, d, lens) in [
    (2, 2, 8, 1, 512, 2, 256, 128, [1, 512]),
    (2, 1, 4, 2, 512, 4, 128, 64, [3, 300]),
    (1, 2, 2, 1, 256, 1, 256, 128, [200]),
    (2, 2, 4, 2, 1024, 4, 256, 128, [0, 1000]),
]:
    p = plan(b, h, group, q_len, max_len, splits, chunk, d)
    ks = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(ks[0], (b, h, p.rows, d), p.dtype)
    kc = jax.random.normal(ks[1], (b, max_len, h, d), p.dtype)
    vc = jax.random.normal(ks[2], (b, max_len, h, d), p.dtype)
    L = jnp.array(lens, jnp.int32)
    o1, l1 = km.partial(p, q, kc, vc, L)
    o2, l2 = mosaic.partial(p, q, kc, vc, L, None)
    same_inf = bool(jnp.all(jnp.isinf(l1) == jnp.isinf(l2)))
    print(b, h, group, q_len, d, lens, "o", float(jnp.max(jnp.abs(o1 - o2))),
          "lse", float(jnp.max(jnp.abs(jnp.where(jnp.isinf(l2), 0, l1 - l2)))), "inf pattern same", same_inf,
          "nan", bool(jnp.any(jnp.isnan(o1))))
