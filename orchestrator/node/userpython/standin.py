"""Warm start: torchrun's worker in its place, the stand-in. torchrun runs ``python -S -c LOADER
SCRIPT ARGS`` for each rank; the stand-in asks the node's warm interpreter (its socket:
SOCKET_VAR, which torchrun was given) for the rank, with its own stdin, stdout and stderr,
environment and working directory; passes every signal torchrun or ddp-up sends it on to the
rank; and ends as the rank ended (its code, or the same signal). Without a warm interpreter to
answer, it becomes the cold worker itself (exec): torchrun's own line, `python -u SCRIPT ARGS`.
Run from its file in the job's own Python, stdlib only.
"""

import array
import json
import os
import signal
import socket
import sys

from .names import PACKAGE, STUB_MARK

SOCKET_VAR = "DDP_UP_WARM_SOCKET"  # torchrun's environment under warm start: where its stand-ins ask
# and the signals they pass on to their rank: those torchrun stops its workers with. Not SIGUSR1 or
# SIGUSR2 unless the job stops with one: ddp-up and Slurm send those to every rank straight, and
# Slurm to every process of its step, the stand-in too (which ignores them, as torchrun does).
PASS_VAR = "DDP_UP_WARM_PASS_ON"
CODE_VAR = "DDP_UP_WARM_CODE"  # the directory this room is imported from (LOADER)
# The stand-in's command line, torchrun's worker's under warm start (the plan writes it): this
# module from CODE_VAR's directory, or, with none given, the cold worker at once.
LOADER = (STUB_MARK + "import os,sys\nc=os.environ.pop('%s','')\nif c:sys.path[0]=c;from %s.standin import main;main()\n"
          "os.execv(sys.executable,[sys.executable,'-u']+sys.argv[1:])" % (CODE_VAR, PACKAGE))


def main():
    here = os.getcwd()
    where, passed = os.environ.pop(SOCKET_VAR, ""), os.environ.pop(PASS_VAR, "SIGTERM,SIGINT,SIGHUP,SIGQUIT")
    pid, answers = ask(where, here)
    def pass_on(sig, _):
        try:
            os.kill(pid, sig)
        except OSError:
            pass  # the rank has ended: its status is on its way (its end is not this signal's failure)
    for name in passed.split(","):
        signal.signal(getattr(signal, name), pass_on)
    line = answers.readline()
    if not line:  # the interpreter is gone, and the rank's exit status with it: said, and the rank waited for
        sys.stderr.write("ddp-up: warm start: the warm interpreter that forked this rank is gone; its exit status is lost\n")
        sys.stderr.flush()
        wait_gone(pid)
    end_as(json.loads(line)["code"] if line else 1)


def ask(where, here):
    """(the rank's pid, the interpreter's answers to come) once the interpreter at ``where`` forked
    it; else this process becomes the cold worker (exec), told why where the interpreter said so."""
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        os.chdir(os.path.dirname(where) or "/nonexistent")
        s.connect(os.path.basename(where))
        os.chdir(here)
        s.sendmsg([b"\n"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0, 1, 2]))])
        s.sendall(json.dumps({"argv": sys.argv[1:], "env": dict(os.environ), "cwd": here}).encode() + b"\n")
        answers = s.makefile("rb")
        answer = json.loads(answers.readline())
        if "cold" in answer:
            sys.stderr.write("ddp-up: warm start: %s; this rank starts cold\n" % answer["cold"])
            sys.stderr.flush()  # before the exec below: block-buffered on Python 3.8
        return answer["pid"], answers
    except Exception:
        os.chdir(here)
        os.execv(sys.executable, [sys.executable, "-u"] + sys.argv[1:])


def wait_gone(pid):
    """Until the rank ``pid`` has ended (its new parent reaps it)."""
    import time
    while True:
        try:
            os.kill(pid, 0)
            with open("/proc/%d/stat" % pid, "rb") as stat:
                if stat.read().rsplit(b")", 1)[-1].split()[:1] == [b"Z"]:
                    return
        except OSError:
            return
        time.sleep(0.2)


def end_as(code):
    """This process ends as its rank did: its code, or the same signal (SIGKILL's disposition
    cannot be set)."""
    if code < 0:
        -code == signal.SIGKILL or signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)
