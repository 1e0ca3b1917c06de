"""A process's name as ps, top and /proc show it, rewritten in place: the agent's (main.main), the
warm interpreter's and each rank it forks (a rank's command line and name, and the variables it
added, in /proc/PID/environ). Written through /proc/self/mem, which costs no import (ctypes is a
tenth of an agent's start-up), else through ctypes. Nothing here is worth a process's life.
"""

# The warm interpreter's last variable, a room of dots: each rank it forks writes the variables
# it added over its value (rename), as a cold rank's /proc/PID/environ would show them.
ROOM_VAR = "DDP_UP_WARM_ROOM"
ROOM = 8192
PR_SET_NAME = 15


def rename(words, name, added=None):
    """This process shows as ``words`` (its command line) and ``name`` (its 15-character name). The
    variables ``added`` (pairs, RANK first: ddp-kill, the stack dumps and ps -e read them there)
    are written over ROOM_VAR's value; the process's own variables stay where they are: C code may
    hold pointers into them. Its command line keeps its length: ``words`` are cut to fit it."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        memory = Memory()
        try:
            start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end
            text = "\0".join(words).encode()[:end - start - 1]
            memory.write(start, text + b"\0" * (end - start - len(text)))
            memory.name(name)
            if added is None:
                return
            start, end = int(fields[47]), int(fields[48])  # env_start, env_end
            at = memory.read(start, end - start).rfind(b"\0%s=" % ROOM_VAR.encode()) + 1
            if at > 0:
                text = b"".join(b"%s=%s\0" % (k.encode(), v.encode()) for k, v in added
                                if len(k) + len(v) + 2 < end - start - at)
                memory.write(start + at, (text + b"\0" * (end - start - at))[:end - start - at])
        finally:
            memory.close()
    except Exception:
        pass  # a name is never worth a process


class Memory:
    """This process's own memory and name: /proc/self/mem and /proc/self/comm, else ctypes (a
    kernel or a policy that refuses a process its own /proc/self/mem)."""

    def __init__(self):
        import os
        self.os, self.libc = os, None
        try:
            self.fd = os.open("/proc/self/mem", os.O_RDWR)
        except OSError:
            import ctypes
            self.fd, self.ctypes, self.libc = None, ctypes, ctypes.CDLL(None, use_errno=True)

    def write(self, at, data):
        if self.libc is None:
            self.os.pwrite(self.fd, data, at)
        else:
            self.ctypes.memmove(at, data, len(data))

    def read(self, at, size):
        return self.os.pread(self.fd, size, at) if self.libc is None else self.ctypes.string_at(at, size)

    def name(self, name):
        if self.libc is None:
            with open("/proc/self/comm", "wb") as f:
                f.write(name.encode()[:15])
        else:
            self.libc.prctl(PR_SET_NAME, self.ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)

    def close(self):
        if self.fd is not None:
            self.os.close(self.fd)
