"""nvidia-smi asked, bounded: its output, or what went wrong in words that name it. A wedged
driver makes nvidia-smi hang: it is killed at NVIDIA_SMI_TIMEOUT, and after one hang it is not asked
again for HUNG_QUIET, so that one hang costs a node one bound, whatever asks after it (facts,
gpuhealth, the GPU sampler).

May import: nothing of the house.
"""

import subprocess
import threading
import time

NVIDIA_SMI_TIMEOUT = 10.0


def nvidia_smi(args, run=None):
    """nvidia-smi's output for ``args``, or None where it is missing, fails or hangs."""
    return nvidia_smi_said(args, run)[0]


SMI_MOST = 1 << 20  # bytes of nvidia-smi's output read; what comes after is dropped
SMI_LINE_MOST = 4096  # characters of one line; a longer one is no row of the driver's


HUNG = "nvidia-smi did not answer within %d s (a wedged driver?)"  # % NVIDIA_SMI_TIMEOUT
# Seconds after nvidia-smi hung in which it is not asked again: the answer is HUNG at once. A
# wedged driver stays wedged, and a preflight asks three times (busy GPUs, their processes, their
# health): one hang costs the node one bound, not one a question (30 s).
HUNG_QUIET = 60.0


class HangMemory:
    """When nvidia-smi last hung on this node (this agent's life): see HUNG_QUIET."""

    def __init__(self, clock=time.monotonic):
        self.clock, self.at = clock, None

    def quiet(self):
        return self.at is not None and self.clock() - self.at < HUNG_QUIET

    def hung(self):
        self.at = self.clock()


HANG = HangMemory()


def nvidia_smi_said(args, run=None):
    """(nvidia-smi's output for ``args``, None); (None, None) where there is no nvidia-smi to ask;
    or (None, what went wrong, in words that name nvidia-smi): an exit status with its first line
    ("GPU is lost", "couldn't communicate with the NVIDIA driver"), or HUNG: no answer within
    NVIDIA_SMI_TIMEOUT (a wedged driver makes it hang: it is killed, and the agent goes on), or
    within HUNG_QUIET after it did."""
    if HANG.quiet():
        return None, HUNG % NVIDIA_SMI_TIMEOUT
    try:
        code, out, err = (run or run_bounded)(["nvidia-smi", *args], NVIDIA_SMI_TIMEOUT)
    except FileNotFoundError:
        return None, None
    except subprocess.TimeoutExpired:
        code, out, err = None, b"", b""
    except (OSError, subprocess.SubprocessError) as e:
        return None, "nvidia-smi could not run (%s)" % e
    if code is None:
        HANG.hung()
        return None, HUNG % NVIDIA_SMI_TIMEOUT
    text = out[:SMI_MOST].decode("utf-8", "replace")
    if code != 0:
        said = next((line.strip() for line in (err + b"\n" + out)[:SMI_LINE_MOST].decode("utf-8", "replace").splitlines()
                     if line.strip()), "")
        return None, "nvidia-smi exited with status %d%s" % (code, ": " + clip(said) if said else "")
    return text, None


def run_bounded(argv, timeout, most=SMI_MOST):
    """(exit status, or None where it did not end within ``timeout`` seconds and was killed; the
    first ``most`` bytes of its stdout; the first 4 KiB of its stderr). Never waits on a process
    stuck in the kernel past a second more (SIGKILL cannot end one in the driver)."""
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = bytearray(), bytearray()

    def drain(stream, into, cap):
        while True:
            chunk = stream.read1(1 << 16)
            if not chunk:
                return
            into += chunk[:max(0, cap - len(into))]  # read on past the cap: the writer is never blocked

    readers = [threading.Thread(target=drain, args=(proc.stdout, out, most), daemon=True),
               threading.Thread(target=drain, args=(proc.stderr, err, 4096), daemon=True)]
    for reader in readers:
        reader.start()
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = None
    for reader in readers:
        reader.join(1.0)
    try:
        proc.wait(1.0)
    except subprocess.TimeoutExpired:
        pass  # in the driver: the kernel reaps it when it comes out
    return code, bytes(out), bytes(err)


def clip(text, most=200):
    return text if len(text) <= most else text[:most] + "..."
