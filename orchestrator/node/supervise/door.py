"""Where a detached job's agents meet: the supervisor's listening socket (Door) and the
handshake every other node's agent passes there, proving it knows the job's token (an HMAC of the
supervisor's challenge). Nothing more of a connection that does not prove it is read or kept.
"""

import os
import socket
import threading

from ..attempt.checks import listen_on
from ..protocol import wire

JOIN_TIMEOUT = 10.0  # for a connection to the supervisor to prove it belongs to the job, in all
JOIN_MAX = 4096  # bytes of a Join frame: an unauthenticated peer is read no further
JOINING_MAX = 64  # connections still proving themselves at once; more are closed unread


def proof(token, nonce):
    # hashlib (with OpenSSL) and hmac: imported only where a detached job's agents meet, not in
    # every agent's start (they are a tenth of it)
    import hashlib
    import hmac

    return hmac.new(token.encode(), nonce.encode(), hashlib.sha256).hexdigest()


def proof_ok(token, nonce, given):
    import hmac

    return isinstance(given, str) and hmac.compare_digest(proof(token, nonce), given)


def listen_for_peers(addr):
    """The supervisor's listening socket: on the master address the peers were given, where it
    is an IPv4 address of this host's; else on every address (a host name: resolved here it may
    be another address than the peers get, such as Debian's 127.0.1.1 for the host's own name;
    or an address behind a NAT). Authentication guards it either way; this narrows who can knock."""
    if addr and is_ipv4(addr):
        try:
            return listen_on(0, addr)
        except OSError:
            pass  # not this host's own
    return listen_on(0)


def is_ipv4(text):
    try:
        socket.inet_pton(socket.AF_INET, text)
        return True
    except OSError:
        return False


def handshake(conn, spec):
    """(the node a connection proves to be, its stream), or (None, None): the challenge, then its
    Join (an HMAC of the challenge under the job's token). The whole handshake has JOIN_TIMEOUT (a
    peer that sends a byte now and then is cut all the same) and JOIN_MAX bytes: nothing more of
    an unauthenticated peer is read or kept."""
    cut = threading.Timer(JOIN_TIMEOUT, lambda: shut(conn))
    cut.start()
    try:
        conn.settimeout(JOIN_TIMEOUT)
        nonce = os.urandom(16).hex()
        conn.sendall(wire.Challenge(nonce=nonce).encode())
        stream = conn.makefile("rb")
        line = stream.readline(JOIN_MAX)
        if not line.endswith(b"\n"):
            return None, None  # too long, or the stream ended: not one of ours
        cls, values = wire.parse_header(line[:-1], wire.PEER)
        join = wire.build(cls, values) if cls is wire.Join else None
    finally:
        cut.cancel()
    if join is None or not (0 <= join.node < spec.nodes and join.node != spec.node
                            and proof_ok(spec.token, nonce, join.proof)):
        return None, None
    return join.node, stream


def shut(conn):
    """End a connection from another thread: a blocked read returns at once."""
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class Door:
    """The supervisor's listening socket. Every connection is accepted; at most JOINING_MAX are
    proving themselves at once (handshake), more are closed unread; one that proves it is one of
    the job's other agents goes on, on its own thread, to ``enter(conn, node, stream)``."""

    def __init__(self, listener, spec, enter):
        self.listener, self.spec, self.enter = listener, spec, enter
        self.lock = threading.Lock()
        self.joining = 0

    def open(self):
        threading.Thread(target=self.accept, name="supervisor", daemon=True).start()

    def accept(self):
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with self.lock:
                full = self.joining >= JOINING_MAX
                self.joining += not full
            if full:  # a flood: closed unread, before a thread or a byte is spent on it
                conn.close()
                continue
            threading.Thread(target=self.knock, args=(conn,), daemon=True).start()

    def knock(self, conn):
        node = stream = None
        try:
            node, stream = handshake(conn, self.spec)
        except (OSError, ValueError, wire.ProtocolError):
            pass
        finally:
            with self.lock:
                self.joining -= 1
        if node is None:
            conn.close()  # not one of this job's agents: nothing is said to it
        else:
            self.enter(conn, node, stream)
