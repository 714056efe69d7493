"""PNG plots of benchmark results (matplotlib, optional: each function returns False without it)."""

from __future__ import annotations


def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot_speed(rows: list[dict], path: str) -> bool:
    """TFLOP/s vs sequence length; panels fwd/bwd x non-causal/causal.

    Colour = implementation, marker = head layout (q heads/kv heads, head_dim):
    seq alone does not fix the shape, so points of one layout are joined.
    """
    plt = _pyplot()
    if plt is None:
        return False
    from matplotlib.lines import Line2D
    impls = sorted({r["impl"] for r in rows})
    shapes = sorted({(r["q_heads"], r["kv_heads"], r["head_dim"]) for r in rows})
    markers = "os^Dvp*hX"
    fig, axes = plt.subplots(2, 2, figsize=(12, 8), squeeze=False)
    for col, causal in enumerate((False, True)):
        for row_i, pass_ in enumerate(("fwd", "bwd")):
            ax = axes[row_i][col]
            for ci, impl in enumerate(impls):
                for si, shape in enumerate(shapes):
                    pts = sorted((r["seq"], r[f"{pass_}_tflops"]) for r in rows
                                 if r["impl"] == impl and r["causal"] == causal
                                 and (r["q_heads"], r["kv_heads"], r["head_dim"]) == shape
                                 and r.get(f"{pass_}_tflops"))
                    if pts:
                        ax.plot(*zip(*pts), color=f"C{ci}", marker=markers[si % len(markers)],
                                linestyle="-" if len(pts) > 1 else "none")
            ax.set_xscale("log", base=2)
            ax.set_ylim(bottom=0)  # so heights read as fractions of the ceiling
            ax.set_xlabel("sequence length")
            ax.set_ylabel("TFLOP/s")
            ax.set_title(f"{pass_} {'causal' if causal else 'non-causal'}")
            ax.grid(True, alpha=0.3)
    handles = [Line2D([], [], color=f"C{i}", label=n) for i, n in enumerate(impls)]
    handles += [Line2D([], [], color="gray", linestyle="none", marker=markers[i % len(markers)],
                       label=f"heads {hq}/{hkv}, D {d}")
                for i, (hq, hkv, d) in enumerate(shapes)]
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=8)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_cases(rows: list[dict], path: str, title: str = "") -> bool:
    """TFLOP/s of every case as grouped horizontal bars, one panel per pass (forward,
    backward), one colour per implementation; rows that did not run leave a gap."""
    plt = _pyplot()
    if plt is None:
        return False
    # Ours first, then the baselines.
    impls = sorted({r["impl"] for r in rows},
                   key=lambda n: (not n.startswith("pallas_flash"), n != "pallas_flash", n))
    cases = list(dict.fromkeys((r["case"], r["causal"]) for r in rows))
    by_key = {(r["case"], r["causal"], r["impl"]): r for r in rows}
    height = 0.8 / max(len(impls), 1)
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.55 * len(cases) + 2.2), sharey=True,
                             squeeze=False)
    for ax, (pass_, label) in zip(axes[0], (("fwd", "forward"), ("bwd", "backward"))):
        for ii, impl in enumerate(impls):
            ys, xs = [], []
            for ci, (case, causal) in enumerate(cases):
                value = (by_key.get((case, causal, impl)) or {}).get(f"{pass_}_tflops")
                if value:
                    ys.append(ci + (ii - (len(impls) - 1) / 2) * height)
                    xs.append(value)
            ax.barh(ys, xs, height=height, color=f"C{ii}", label=impl)
        ax.set_title(f"{label} TFLOP/s")
        ax.set_xlim(left=0)
        ax.grid(True, axis="x", alpha=0.3)
    axes[0][0].set_yticks(range(len(cases)))
    axes[0][0].set_yticklabels([f"{case} {'causal' if causal else 'full'}"
                                for case, causal in cases], fontsize=8)
    axes[0][0].invert_yaxis()
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="lower center", ncol=len(impls),
               fontsize=9)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_memory(memory: dict, path: str) -> bool:
    """Peak memory vs sequence length per implementation, with the floor."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 5))
    points = memory["points"]
    for impl in sorted({p["impl"] for p in points}):
        pts = sorted((p["seq"], p["peak_bytes"] / 2**30) for p in points
                     if p["impl"] == impl and p.get("peak_bytes"))
        if pts:
            ax.plot(*zip(*pts), marker="o", label=impl)
    floor = sorted({(p["seq"], p["floor_bytes"] / 2**30) for p in points})
    ax.plot(*zip(*floor), "k--", label="floor (q,k,v,o,dq,dk,dv,dO)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length")
    ax.set_ylabel("peak GiB, one fwd+bwd step")
    ax.legend()
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
