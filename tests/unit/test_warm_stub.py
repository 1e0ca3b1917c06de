"""torchrun's worker under warm start (userpython/standin.py), against a stand-in for the warm
interpreter: a stop signal that reaches it after its rank ended (and was reaped) is no failure of
its own: it ends with the rank's status, without a traceback."""

import array
import json
import os
import signal
import socket
import subprocess
import sys
import threading

from orchestrator.node.local.procs import catches
from orchestrator.node.local.ourcode import written
from orchestrator.node.userpython.standin import CODE_VAR, LOADER, PASS_VAR, SOCKET_VAR
from tests.harness.procs import wait_for


def test_a_stop_after_the_rank_ended_ends_the_stand_in_with_the_ranks_status(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that no longer exists: the rank, reaped by its interpreter
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "s"))
    listener.listen(1)
    asked, signalled = threading.Event(), threading.Event()

    def interpreter():
        conn, _ = listener.accept()
        with conn, conn.makefile("rb") as lines:
            _, extra, _, _ = conn.recvmsg(1, socket.CMSG_SPACE(3 * 4))  # the stand-in's stdio, as the interpreter
            for _, _, data in extra:                                       # takes them: closed here, or its
                for fd in array.array("i", data[:len(data) - len(data) % 4]):  # pipes never end
                    os.close(fd)
            lines.readline()
            conn.sendall(json.dumps({"pid": gone.pid}).encode() + b"\n")
            asked.set()
            signalled.wait(10)  # the stop reached the stand-in before the rank's status
            conn.sendall(json.dumps({"code": 0}).encode() + b"\n")

    serving = threading.Thread(target=interpreter, daemon=True)
    serving.start()
    env = dict(os.environ, **{SOCKET_VAR: str(tmp_path / "s"), PASS_VAR: "SIGTERM", CODE_VAR: written(str(tmp_path))})
    stub = subprocess.Popen([sys.executable, "-S", "-c", LOADER, "train.py"], env=env, cwd=tmp_path,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        # the stand-in has its handler in place: it passes signals on
        assert asked.wait(10) and wait_for(lambda: catches(stub.pid, signal.SIGTERM), timeout=10, interval=0.01)
        stub.send_signal(signal.SIGTERM)
        signalled.set()
        _, err = stub.communicate(timeout=10)
    finally:
        stub.kill()
        listener.close()
    assert stub.returncode == 0 and b"Traceback" not in err, err

