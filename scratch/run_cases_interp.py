"""Every compiled-only case of tests/test_mosaic_decode.py, in interpret mode (CPU)."""
import sys, time, traceback
sys.path.insert(0, "tests")
import test_mosaic_decode as t
from pallas_flash.mosaic import decode as mosaic
for case in t.CASES:
    args = case.values
    for poison in (False, True):
        start = time.time()
        try:
            t._run(*args, interpret=True, poison=poison)
            print("ok  ", case.id, "poison" if poison else "", f"{time.time() - start:.0f}s", flush=True)
        except Exception as e:
            print("FAIL", case.id, "poison" if poison else "", type(e).__name__, str(e)[:300], flush=True)
