"""Where a fused-backward CTA spends its time, from Mosaic GPU's on-device trace (GPU only).

    PYTHONPATH=. python3 benchmarks/fused_profile.py --out DIR [--case 2x8192x16x16x128]
        [--causal 1,0] [--trace-dir /tmp/fused_trace]

The fused kernel's named scopes (fused_backward.profile_params) are recorded per warpgroup and
CTA, with the SM each CTA ran on, when MosaicBackwardConfig.fused_profile_dir is set. This
script times the kernel without the trace, runs it once with it (the makespan against the
untraced time shows the trace's own cost), then reduces the trace (tens of MB) to a few numbers, printed and written
to <out>/fused_profile.json:

  sm_busy        sum of CTA lifetimes / (SMs x makespan): what the grid's gaps and tail cost;
  gap_us         between one CTA's end and the next CTA's start on the same SM (launch);
  per-CTA means  kv_wait (K / V load), steps, writer_tail, store of compute warpgroup 0;
  fit            steps = a + b x n_steps over the CTAs (n_steps from the mask per key tile):
                 b is the time per step, a the per-CTA cost inside the step loop (stalls
                 before the first adds, pipeline fill);
  waits          per step, by step index (first 4 against the rest): slot_wait (compute waits
                 for the writer to free a dQ slot), ds_wait (the two compute warpgroups'
                 exchange of dS^T), chain_wait (the writer waits for the tile below to add).

Grid order assumed: (head, tile, batch), batch fastest (fused_backward._fused), so a CTA's
linear index is (head x n_tiles + tile) x batch + b; the fit's R^2 says whether that holds.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import json
import math
import os
import shutil
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

WARPGROUPS = 4       # compute 0, compute 1, copy, writer


def reduce_trace(events, n_tiles: int, batch: int, steps_per_tile) -> dict:
    """The summary described in the module docstring, from a list of trace events (dicts with
    name, ph 'B' / 'E', ts in microseconds, pid = 1 + SM, tid = 1 + warpgroup + 4 x CTA)."""
    spans = collections.defaultdict(list)       # (cta, wg, name) -> [durations in order]
    first = collections.defaultdict(lambda: math.inf)
    last = collections.defaultdict(lambda: -math.inf)
    sm_of = {}
    stacks = collections.defaultdict(list)
    for ev in sorted(events, key=lambda e: (e["tid"], e["ts"], e["ph"] == "B")):
        cta, wg = divmod(ev["tid"] - 1, WARPGROUPS)
        sm_of[cta] = ev["pid"] - 1
        first[cta] = min(first[cta], ev["ts"])
        last[cta] = max(last[cta], ev["ts"])
        if ev["ph"] == "B":
            stacks[(cta, wg)].append(ev)
        elif stacks[(cta, wg)]:
            begin = stacks[(cta, wg)].pop()
            spans[(cta, wg, begin["name"])].append(ev["ts"] - begin["ts"])
    ctas = sorted(sm_of)
    start = np.array([first[c] for c in ctas])
    end = np.array([last[c] for c in ctas])
    sms = np.array([sm_of[c] for c in ctas])
    makespan = end.max() - start.min()
    n_sms = len(set(sms.tolist()))
    gaps = []
    for sm in set(sms.tolist()):
        idx = np.flatnonzero(sms == sm)
        order = idx[np.argsort(start[idx])]
        gaps.extend((start[order[1:]] - end[order[:-1]]).tolist())

    def total(cta, wg, name):
        return float(np.sum(spans.get((cta, wg, name), [0.0])))

    steps_time = np.array([total(c, 0, "steps") for c in ctas])
    tiles = np.array([(c // batch) % n_tiles for c in ctas])
    n_steps = np.asarray(steps_per_tile)[tiles].astype(float)
    fit = {}
    if np.ptp(n_steps) > 0:
        design = np.stack([np.ones_like(n_steps), n_steps], 1)
        coef, *_ = np.linalg.lstsq(design, steps_time, rcond=None)
        pred = design @ coef
        r2 = 1 - np.sum((steps_time - pred) ** 2) / np.sum((steps_time - steps_time.mean()) ** 2)
        fit = dict(a_us=float(coef[0]), b_us_per_step=float(coef[1]), r2=float(r2))
    else:
        fit = dict(b_us_per_step=float(np.mean(steps_time / np.maximum(n_steps, 1))))

    def by_index(wg, name):
        seqs = [spans.get((c, wg, name), []) for c in ctas]
        head = [s[i] for s in seqs for i in range(min(4, len(s)))]
        rest = [x for s in seqs for x in s[4:]]
        return dict(first4_us=float(np.mean(head)) if head else 0.0,
                    rest_us=float(np.mean(rest)) if rest else 0.0,
                    per_cta_us=float(np.mean([sum(s) for s in seqs])))

    mean = lambda wg, name: float(np.mean([total(c, wg, name) for c in ctas]))  # noqa: E731
    return dict(
        ctas=len(ctas), sms=n_sms, makespan_us=float(makespan),
        sm_busy=float(np.sum(end - start) / (n_sms * makespan)),
        gap_us=dict(mean=float(np.mean(gaps)) if gaps else 0.0,
                    median=float(np.median(gaps)) if gaps else 0.0,
                    p90=float(np.percentile(gaps, 90)) if gaps else 0.0),
        cta_us=float(np.mean(end - start)),
        compute0=dict(kv_wait=mean(0, "kv_wait"), steps=mean(0, "steps"),
                      writer_tail=mean(0, "writer_tail"), store=mean(0, "store")),
        stream_us=mean(2, "stream"), fit=fit,
        slot_wait=by_index(0, "slot_wait"), ds_wait=by_index(0, "ds_wait"),
        ds_wait_wg1=by_index(1, "ds_wait"), chain_wait=by_index(3, "chain_wait"),
        mean_steps=float(n_steps.mean()))


def main():
    import jax
    import jax.numpy as jnp
    from jax import lax

    import pallas_flash as pf
    from benchmarks.check_log import timed
    from pallas_flash import bench
    from pallas_flash.masking import make_mask_spec
    from pallas_flash.mosaic import backward as mb
    from pallas_flash.mosaic import fused_backward as fb
    from pallas_flash.spec import AttentionSpec
    from pallas_flash.triton import forward as tf

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", default="2x8192x16x16x128")
    p.add_argument("--causal", default="1,0")
    p.add_argument("--trace-dir", default="/tmp/fused_trace")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    results = []
    for causal in (bool(int(x)) for x in args.causal.split(",")):
        case = bench.Case(*bench.parse_case(args.case), causal=causal)
        q, k, v, do = bench.make_inputs(case, jnp.bfloat16, jax.random.key(0))
        d, s = case.head_dim, case.seq
        mask = make_mask_spec(s, s, causal=causal)
        spec = AttentionSpec(mask=mask, scale=1.0 / math.sqrt(d), softcap=None,
                             has_segments=False, precision=lax.Precision.DEFAULT,
                             config=pf.default_config(d, jnp.bfloat16), interpret=False)
        out, st = jax.jit(lambda q, k, v: tf.forward(spec, q, k, v))(q, k, v)
        dlse = jax.random.normal(jax.random.key(1), st.m.shape, jnp.float32)
        res = (q, k, v, out, st, do, dlse)
        cfg = mb.default_backward_config(d)
        plain = jax.jit(lambda *a: mb.backward(spec, *a, config=cfg))
        _, t_plain = timed(plain, res, 10)
        shutil.rmtree(args.trace_dir, ignore_errors=True)
        os.makedirs(args.trace_dir)
        traced_cfg = dataclasses.replace(cfg, fused_profile_dir=args.trace_dir)
        traced = jax.jit(lambda *a: mb.backward(spec, *a, config=traced_cfg))
        jax.block_until_ready(traced(*res))          # compile, trace once
        jax.effects_barrier()
        files = sorted(glob.glob(os.path.join(args.trace_dir, "*.json")))
        with open(files[0]) as f:
            events = json.load(f)["traceEvents"]
        n_tiles = -(-s // fb.CTA_KEYS)
        with jax.ensure_compile_time_eval():
            lo, _, _, hi = jax.vmap(lambda x: mask.q_blocks(x, fb.CTA_KEYS, fb.BLOCK_Q, s, s))(
                jnp.arange(n_tiles, dtype=jnp.int32) * fb.CTA_KEYS)
        steps = np.asarray(hi - lo) * (case.q_heads // case.kv_heads)
        row = dict(case=args.case, causal=causal, ms=t_plain * 1e3, events=len(events),
                   **reduce_trace(events, n_tiles, case.batch, steps))
        results.append(row)
        print(json.dumps(row, indent=1), flush=True)
    with open(os.path.join(args.out, "fused_profile.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
