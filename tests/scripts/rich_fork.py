"""A DataLoader worker forked while Rich's live display holds its console lock (its refresh thread,
mid-refresh, here a thread that holds it): the worker's first print goes through Rich's redirected
stdout. Says CHILD ENDED, or CHILD HUNG after 5 s (then kills it)."""

import os, sys, threading, time
import rich
from rich.live import Live
from rich.text import Text
console = rich.get_console()
held, release = threading.Event(), threading.Event()
with Live(Text("bar"), console=console, auto_refresh=False, redirect_stdout=True, redirect_stderr=True):
    def holder():  # as Rich's refresh thread, in the middle of a refresh
        with console._lock:
            held.set()
            release.wait(30)
    threading.Thread(target=holder, daemon=True).start()
    held.wait()
    pid = os.fork()
    if pid == 0:  # a DataLoader worker's first print
        print("worker printed", flush=True)
        os._exit(0)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if os.waitpid(pid, os.WNOHANG)[0]:
            sys.__stdout__.write("CHILD ENDED\n"); break
        time.sleep(0.05)
    else:
        os.kill(pid, 9); os.waitpid(pid, 0); sys.__stdout__.write("CHILD HUNG\n")
    sys.__stdout__.flush()
    release.set()
os._exit(0)
