"""A rank that ends its script, then dies in the C library's exit after Python's own teardown, as
torch's threads can abort it ("terminate called without an active exception"): the C library's
exit list gets abort(), which runs after every Python atexit handler and finalizer.

    teardown.py [--barrier DIR] [--only-rank R] [--exit N | --raise | --end HOW N]

--barrier: every rank waits for the others' scripts to end too (files in DIR), and the abort comes a
second after: no rank's abort (and its launcher's stop of the others) cuts another's script short.
--exit N, --raise: end the script with sys.exit(N), or an uncaught exception, first.
--only-rank R: only rank R dies in its teardown; the others end as usual.
--end HOW N: end it another way Python has: raise (SystemExit(N)), exit, quit (the builtins), _exit
(os._exit(N): no teardown at all), kill (signal N to itself).
"""

import ctypes
import os
import signal
import sys
import time

libc = ctypes.CDLL(None)
if "--only-rank" not in sys.argv or os.environ.get("RANK") == sys.argv[sys.argv.index("--only-rank") + 1]:
    libc.__cxa_atexit(ctypes.cast(libc.abort, ctypes.c_void_p), None, None)
print(f"SCRIPT ENDED rank={os.environ.get('RANK')}", flush=True)
if "--barrier" in sys.argv:
    where = sys.argv[sys.argv.index("--barrier") + 1]
    os.makedirs(where, exist_ok=True)
    open(os.path.join(where, os.environ["RANK"]), "w").close()
    deadline = time.monotonic() + 60
    while len(os.listdir(where)) < int(os.environ["WORLD_SIZE"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    # the exit list runs last in, first out: this sleep, then the abort
    libc.__cxa_atexit(ctypes.cast(libc.sleep, ctypes.c_void_p), ctypes.c_void_p(1), None)
if "--raise" in sys.argv:
    raise RuntimeError("boom before the teardown")
if "--exit" in sys.argv:
    sys.exit(int(sys.argv[sys.argv.index("--exit") + 1]))
if "--end" in sys.argv:
    how, n = sys.argv[sys.argv.index("--end") + 1], int(sys.argv[sys.argv.index("--end") + 2])
    if how == "raise":
        raise SystemExit(n)
    if how == "_exit":
        sys.stdout.flush()
        os._exit(n)
    if how == "kill":
        os.kill(os.getpid(), n)
    {"exit": exit, "quit": quit}[how](n)
