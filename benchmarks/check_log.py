"""The record of an unattended one-shot GPU check run (mosaic_check.py, mosaic_bwd_check.py),
and the timing loop those scripts and mosaic_tune.py share (`timed`).

Such a run gets one chance on a lent machine and nobody watches it, so it must leave a readable
record whatever happens, even when a kernel deadlocks (a barrier hang is not an exception and
never returns). `CheckLog` gives that:

- one flushed line per check (PASS / FAIL / SKIP), so a run cut short still shows how far it got;
- <out>/<prefix>.json with every row so far, rewritten atomically after each row;
- <out>/<prefix>_errors.log with every failure in full, <out>/<prefix>_first_failure.log with
  the first one;
- `guarded`, which runs one check and turns any exception into a FAIL row (or skips the check
  when too little of the total budget is left);
- a watchdog thread that, when one check runs past `hang_s` or the whole run past
  `total_budget_s` (+5 s), writes the stacks of all threads and a final FAIL row, then exits.
"""

from __future__ import annotations

import faulthandler
import json
import os
import threading
import time
import traceback


def timed(fn, args, iters: int) -> tuple[float, float]:
    """(seconds of the first call, which compiles; best of 3 means of `iters` back-to-back calls,
    device synchronised once per mean). Shared by the GPU check and sweep scripts."""
    import jax  # here, not at the top: the check scripts import jax under their own guard

    t0 = time.monotonic()
    jax.block_until_ready(fn(*args))
    first = time.monotonic() - t0
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(iters):
            res = fn(*args)
        jax.block_until_ready(res)
        best = min(best, (time.perf_counter() - t0) / iters)
    return first, best


def error_lines(exc, n):
    """The first `n` non-blank lines of "Type: message"."""
    lines = [ln for ln in f"{type(exc).__name__}: {exc}".splitlines() if ln.strip()]
    return lines[:n]


class CheckLog:
    def __init__(self, out_dir, prefix, *, total_budget_s, hang_s):
        self.start = time.monotonic()
        self.out_dir, self.prefix = out_dir, prefix
        self.total_budget_s, self.hang_s = total_budget_s, hang_s
        os.makedirs(out_dir, exist_ok=True)
        self.rows, self.env = [], {}
        self.first_written = False
        self.lock = threading.Lock()
        self.current, self.since = None, None

    def path(self, suffix):
        """<out>/<prefix><suffix>, e.g. path(".json"), path("_errors.log")."""
        return os.path.join(self.out_dir, self.prefix + suffix)

    def elapsed(self):
        return time.monotonic() - self.start

    def time_left(self):
        return self.total_budget_s - self.elapsed()

    def dump(self):
        """Write the JSON atomically (a reader never sees half a file)."""
        with self.lock:
            data = {"env": self.env, "rows": list(self.rows), "elapsed_s": round(self.elapsed(), 2)}
        tmp = self.path(".json.tmp")
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1, default=str)
        os.replace(tmp, self.path(".json"))

    def note_failure(self, check, text, first_text=None):
        """Append `text` to the errors log; the first failure also goes to its own file (as
        `first_text` when given)."""
        with open(self.path("_errors.log"), "a") as f:
            f.write(f"===== {check} =====\n{text}\n")
        if not self.first_written:
            self.first_written = True
            with open(self.path("_first_failure.log"), "w") as f:
                f.write(f"check: {check}\n"
                        + (f"{first_text}\n" if first_text is not None else f"\n{text}\n"))

    def row(self, status, check, **fields):
        fields = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in fields.items()}
        rec = {"status": status, "check": check, "t_s": round(self.elapsed(), 1), **fields}
        with self.lock:
            self.rows.append(rec)
        shown = " ".join(f"{k}={v}" for k, v in fields.items() if k != "error")
        print(f"[{rec['t_s']:6.1f}s] {status:4s} {check} {shown}", flush=True)
        for line in str(fields.get("error", "")).splitlines()[:6]:
            print(f"           | {line}", flush=True)
        self.dump()

    def fail(self, check, exc, **fields):
        """A FAIL row for an exception; its full traceback goes to the logs."""
        text = "".join(traceback.format_exception(exc))
        self.note_failure(check, text, first_text=f"fields: {fields}\n\n{text}" if fields else None)
        self.row("FAIL", check, error="\n".join(error_lines(exc, 8)),
                 error_type=type(exc).__name__, **fields)

    def guarded(self, check, fn, min_left=5.0, **fields):
        """fn() under the watchdog; an exception becomes a FAIL row and None. Skipped (None)
        when less than `min_left` seconds of the total budget remain."""
        if self.time_left() < min_left:
            self.row("SKIP", check, reason=f"time budget ({self.time_left():.0f} s left)",
                     **fields)
            return None
        self.current, self.since = check, time.monotonic()
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 -- every failure becomes a FAIL row
            self.fail(check, exc, **fields)
            return None
        finally:
            self.current = None

    def finish(self):
        """Print the summary line, write the JSON; the exit code (1 if anything failed)."""
        n_fail = sum(r["status"] == "FAIL" for r in self.rows)
        n_pass = sum(r["status"] == "PASS" for r in self.rows)
        print(f"done: {n_pass} PASS, {n_fail} FAIL in {self.elapsed():.1f} s; "
              f"JSON: {self.path('.json')}", flush=True)
        self.dump()
        return 0 if n_fail == 0 else 1

    def start_watchdog(self):
        threading.Thread(target=self._watchdog, daemon=True).start()

    def _watchdog(self):
        while True:
            time.sleep(1.0)
            now = self.elapsed()
            hung = self.current is not None and time.monotonic() - self.since > self.hang_s
            if hung or now > self.total_budget_s + 5:
                why = (f"check {self.current!r} still running after {self.hang_s:.0f} s "
                       "(a deadlock in the kernel's barriers, or a very slow compile)"
                       if hung else f"total time budget {self.total_budget_s:.0f} s exceeded")
                print(f"[{now:6.1f}s] FAIL watchdog: {why}; stacks follow, then exit",
                      flush=True)
                try:
                    with open(self.path("_errors.log"), "a") as f:
                        f.write(f"===== watchdog =====\n{why}\n")
                        faulthandler.dump_traceback(file=f, all_threads=True)
                    if not self.first_written:
                        with open(self.path("_first_failure.log"), "w") as f:
                            f.write(f"watchdog: {why}\n")
                    with self.lock:
                        self.rows.append({"status": "FAIL", "check": "watchdog", "error": why,
                                          "t_s": round(now, 1)})
                    self.dump()
                finally:
                    os._exit(3)
