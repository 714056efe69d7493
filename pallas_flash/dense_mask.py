"""Dense boolean masks given to the `dot_product_attention` drop-in: whether the kernels can
serve one, and under which segment ids.

jax.nn takes a dense [B, N, T, S] mask. The kernels take structure instead (causal, window,
lengths, segment ids), so `recognise` reads segment ids off the mask and checks, element by
element, that the kernels' rule under those ids gives the mask back. The check runs on the
device, so a traced mask is judged at run time, and the drop-in switches on its answer.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_flash.masking import PAD_KEY_ID, PAD_QUERY_ID, make_mask_spec

__all__ = ["PLAIN", "CAUSAL", "FALLBACK", "allowed_by_options", "recognise"]

# What `recognise` finds a mask to be: the branch of the drop-in's run-time switch that serves it.
PLAIN, CAUSAL, FALLBACK = 0, 1, 2


def allowed_by_options(q_pos, k_pos, *, is_causal, window, seq_q, seq_kv, q_lengths, kv_lengths):
    """What the structured options let query q_pos see of key k_pos: a boolean array
    broadcastable to [B, 1, len(q_pos), len(k_pos)], or None when they allow everything."""
    allowed = make_mask_spec(seq_q, seq_kv, causal=is_causal, window=window).visible(q_pos, k_pos)
    allowed = None if allowed is None else allowed[None, None]
    for pos, lengths in ((q_pos, q_lengths), (k_pos, kv_lengths)):
        if lengths is not None:
            inside = pos[None, None] < lengths[:, None, None, None]
            allowed = inside if allowed is None else allowed & inside
    return allowed


@functools.partial(jax.jit, static_argnames=("batch", "seq_q", "seq_kv", "is_causal", "window"))
def recognise(mask, q_lengths, kv_lengths, *, batch, seq_q, seq_kv, is_causal, window):
    """Segment ids under which the kernels see what jax.nn would, and the kernel that serves.

    jax.nn lets query t see key s when E[b, n, t, s] = mask and the structured options (causal,
    window, lengths) all allow it. Each row's id is the index of its first visible key; each
    column's is the id of the first row that sees it; a row or column that sees nothing gets
    the padding id the kernels use for lengths (masking.fold_lengths), which matches nothing.
    These are the ids of the segments when the mask has that structure, so the check below,
    that the kernels' rule, (s <= t, for the causal kernel) and id[t] == id[s] and the
    structured options, equals E at every element, holds exactly when it does. The ids are
    read off the mask within the causal rule and the lengths but not within the window, which
    would move a row's first visible key off its segment's first key.

    Returns int32 q_ids [batch, seq_q], kv_ids [batch, seq_kv] and the branch: CAUSAL or
    PLAIN (the kernels with causal on or off serve the call) or FALLBACK.
    """
    q_pos = jnp.arange(seq_q, dtype=jnp.int32)[:, None]
    k_pos = jnp.arange(seq_kv, dtype=jnp.int32)[None, :]
    allowed_options = functools.partial(allowed_by_options, q_pos, k_pos, is_causal=is_causal,
                                        seq_q=seq_q, seq_kv=seq_kv, q_lengths=q_lengths,
                                        kv_lengths=kv_lengths)
    allowed = allowed_options(window=window)
    mask = jnp.broadcast_to(mask, (*mask.shape[:2], seq_q, seq_kv))
    visible = mask if allowed is None else mask & allowed
    if window is not None:
        within = allowed_options(window=None)
        mask = mask if within is None else mask & within
    else:
        mask = visible
    seen = jnp.any(mask, axis=1)                                     # [B or 1, T, S]
    q_ids = jnp.where(jnp.any(seen, axis=2), jnp.argmax(seen, axis=2).astype(jnp.int32),
                      jnp.int32(PAD_QUERY_ID))
    first_row = jnp.argmax(seen, axis=1)
    kv_ids = jnp.where(jnp.any(seen, axis=1), jnp.take_along_axis(q_ids, first_row, axis=1),
                       jnp.int32(PAD_KEY_ID))
    implied = q_ids[:, :, None] == kv_ids[:, None, :]
    if allowed is not None:
        implied = implied & allowed[:, 0]
    plain_ok = jnp.all(visible == implied[:, None])
    causal_ok = jnp.all(visible == (implied & (k_pos <= q_pos))[:, None])
    branch = jnp.where(causal_ok, CAUSAL, jnp.where(plain_ok, PLAIN, FALLBACK))
    return (jnp.broadcast_to(q_ids, (batch, seq_q)), jnp.broadcast_to(kv_ids, (batch, seq_kv)),
            branch.astype(jnp.int32))
