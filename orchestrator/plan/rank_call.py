"""Runs in every rank of a function's launch (the Python API's ``launch(cluster, fn)``), shipped as
a hook (`ddp_up_call.py` on the job's PYTHONPATH, in the node's private state directory) and run
as ``-m ddp_up_call`` by the job's launcher.

It reads the function, its arguments and the backend from the payload beside it (cloudpickle's
bytes, base64: hooks are text), starts the process group if asked, calls the function, and writes
its return value, pickled by cloudpickle, as ``result.<RANK>`` beside it (0600, a new file,
never through a link). The node's agent reads those files, bounded, and sends them to the
controller over its own channel. An exception ends the rank as in any script, so its type,
message and traceback become the job's root cause. Stdlib, cloudpickle and (for a backend) torch.
"""

import base64
import inspect
import os
import sys

PAYLOAD = "ddp_up_call.b64"
RESULT = "result.%d"  # what the node's agent reads back (node/launch.call_results), with its limit


class ResultTooLarge(ValueError):
    pass


def load(here):
    try:
        import cloudpickle  # noqa: F401  (its functions rebuild what it pickled)
    except ImportError:
        raise ImportError("ddp-up ships the function with cloudpickle, which this node's Python (%s) does not "
                          "have: install it there (%s -m pip install cloudpickle)" % (sys.executable, sys.executable))
    import pickle

    with open(os.path.join(here, PAYLOAD), "rb") as f:
        return pickle.loads(base64.b64decode(f.read()))


def start_group(backend):
    import torch
    import torch.distributed as dist

    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend != "nccl":
        dist.init_process_group(backend)
        return dist
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    # The group bound to the rank's GPU, where this torch can (2.3 on): without it, every barrier
    # (ours at the end, the function's own) warned in every rank that it guessed the device.
    if "device_id" in inspect.signature(dist.init_process_group).parameters:
        dist.init_process_group(backend, device_id=device)
    else:
        dist.init_process_group(backend)
    return dist


def write_result(here, rank, value, limit):
    import cloudpickle

    data = cloudpickle.dumps(value)
    if len(data) > limit:
        raise ResultTooLarge("rank %d's return value is %d bytes pickled; ddp-up brings back at most %d MiB a rank: "
                             "save it to a file and return the path (ddp-fetch brings files back)"
                             % (rank, len(data), limit >> 20))
    path = os.path.join(here, RESULT % rank)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    fn, args, kwargs, backend, limit = load(here)
    dist = start_group(backend) if backend else None
    # An exception leaves the group as it is: torch's error file is written first (``record``),
    # and only the process's end closes its connections. Destroying the group on the way out
    # would fail the peers first ("Connection closed by peer"), and their launcher could stop
    # this rank before its exception, the root cause, was written.
    value = fn(*args, **kwargs)
    if dist is not None and dist.is_initialized():
        dist.barrier()  # no rank tears its connections down while another still uses them
        dist.destroy_process_group()
    write_result(here, int(os.environ["RANK"]), value, limit)


def run():
    """main, with torch's error file where torch is there (the rank's exception, for the root cause)."""
    try:
        from torch.distributed.elastic.multiprocessing.errors import record
    except ImportError:
        return main()
    record(printable(main))()
    finish()


def printable(fn):
    """``fn``, whose exception ``record`` can always write: one whose str() raises (torch's
    ``record`` formats it, and its own failure took the rank's place) is raised again as a
    stand-in of the same class name and traceback, whose text is "<str() failed>"."""
    def call():
        try:
            return fn()
        except Exception as e:
            try:
                str(e)
            except Exception:
                stand_in = type(type(e).__name__, (Exception,), {"__str__": lambda self: "<str() failed>",
                                                                 "__module__": type(e).__module__})
                raise stand_in().with_traceback(e.__traceback__) from None
            raise
    return call


def finish():
    """The end of a rank whose function returned: the exit handlers run (the function's own, a
    logger's), then the process ends without the interpreter's teardown, where torch with gloo
    can abort (SIGABRT) after the result is written, failing a job that succeeded."""
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(0)


if __name__ == "__main__":
    run()
