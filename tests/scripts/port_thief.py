"""Takes the master port between ddp-up's check of it and the launcher's bind: run in the master
node's network namespace, it watches for a new listening socket in ddp-up's range for an `auto`
port (from 20000 to the ephemeral range's start), then binds that port the moment it is free
(the node agent lets it go at Go), and holds it. Prints "stole PORT", or "missed" at its deadline.

    port_thief.py SECONDS"""

import os
import socket
import sys
import time


def listening(first):
    ports = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(name) as f:
            for row in f.read().splitlines()[1:]:
                local, state = row.split()[1], row.split()[3]
                port = int(local.rsplit(":", 1)[1], 16)
                if state == "0A" and 20000 <= port < first:  # 0A: LISTEN
                    ports.add(port)
    return ports


def main():
    deadline = time.monotonic() + float(sys.argv[1])
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        first = int(f.read().split()[0])
    before = listening(first)
    print("watching", flush=True)
    while time.monotonic() < deadline:
        new = listening(first) - before
        if new:
            break
        time.sleep(0.005)
    else:
        print("missed", flush=True)
        return
    port = new.pop()
    thief = socket.socket()
    thief.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    while time.monotonic() < deadline:  # a tight loop: the launcher starts its store within milliseconds
        try:
            thief.bind(("", port))
            thief.listen(1)
            print("stole", port, flush=True)
            sys.stdin.read()  # held until the test closes our stdin
            return
        except OSError:
            continue
    print("missed", flush=True)


if __name__ == "__main__":
    os.nice(-10) if os.geteuid() == 0 else None
    main()
