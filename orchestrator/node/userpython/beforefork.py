"""Warm start, before the fork: what keeps a rank forked from the warm interpreter a cold rank
(see docs/guides/warm-start.md). Run in the warm interpreter (warmparent), stdlib only.

Around each import of a preload, the interpreter compares the process (process_state): what a
forked rank would not get as a cold rank's own import gives it sends the ranks cold, named. Seen
keeps what a rank must be given (the variables an import set, fresh randomness, Lightning's rank)
and what stops a fork (a module edited on disk, a thread started since, a rank's variable read at
import). fork_hangs asks a child whether a thread pool left by an import hangs it.
"""

import os
import signal
import sys
import time

def process_state():
    # What an import may change in the process that a forked rank would not get as a cold rank's own
    # import gives it: the environment and sys.path (the rank gets its own), the working directory,
    # signal handlers, umask and rlimits, and the threads.
    import resource
    mask = os.umask(0)
    os.umask(mask)
    handlers = {}
    for sig in signal.valid_signals():
        try:
            handlers[sig] = signal.getsignal(sig)
        except (OSError, ValueError):
            pass
    return {"environment": dict(os.environ), "sys.path": list(sys.path), "working directory": os.getcwd(),
            "signal handlers": handlers, "umask": mask, "threads": native_threads(), "Python threads": python_threads(),
            "rlimits": {n: resource.getrlimit(getattr(resource, n)) for n in dir(resource) if n.startswith("RLIMIT_")}}


def native_threads():
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def python_threads():
    threading = sys.modules.get("threading")
    if threading is None:
        return []
    return sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())


class Seen:
    # What the imports did that a forked rank must be given, or that sends the ranks cold (named):
    #  - the environment variables they set: set again in each rank, where the rank's own value is
    #    the one the import saw (a cold rank's import would set the same);
    #  - the variables they looked for and did not find (RANK, say): a rank that has one forks cold,
    #    unless ddp-up redoes what the module made of it (REDO);
    #  - torch's seed as its import drew it: where no preload seeded it, each rank draws its own;
    #  - the files of every module imported: one that changed means old code, never forked.
    # Anything else it changed in the process (process_state), a thread of Python's, or a thread
    # pool a forked child hangs in (fork_hangs) sends the ranks cold, naming the module.

    def __init__(self):
        self.set, self.missing, self.files, self.threads = {}, {}, {}, 1
        self.torch_seed, self.reseed_torch, self.checked = None, False, 0.0

    def reading(self, name):
        # os.environ's lookups while ``name`` imports: a miss is a name the module looked for
        environ, seen = type(os.environ), self

        class Lookups:
            def __enter__(self):
                self.real = environ.__getitem__

                def getitem(env, key, real=self.real):
                    try:
                        return real(env, key)
                    except KeyError:
                        seen.missing.setdefault(key, set()).add(reader(name))
                        raise
                environ.__getitem__ = getitem

            def __exit__(self, *_):
                environ.__getitem__ = self.real
        return Lookups()

    def after_import(self, name, before, after):
        torch = sys.modules.get("torch")
        if self.torch_seed is None and torch is not None and hasattr(torch, "initial_seed"):
            self.torch_seed = torch.initial_seed()  # as torch's import drew it: never seeded by anyone yet
        env0, env1 = before.pop("environment"), after.pop("environment")
        for key in set(env0) | set(env1):
            if env0.get(key) != env1.get(key):  # (before the first import that changed it, after the last)
                self.set[key] = (self.set.get(key, (env0.get(key),))[0], env1.get(key))
        started = [t for t in after.pop("Python threads") if t not in before.pop("Python threads")]
        if started:
            return ("importing %s started a thread (%s), which a forked rank would not have"
                    % (name, ", ".join(started[:3])))
        grew = after.pop("threads") > before.pop("threads")
        changed = [what for what in sorted(after) if after[what] != before[what]]
        if changed:
            return "importing %s changed the process's %s, which a forked rank would not get" % (name, " and ".join(changed))
        if grew and fork_hangs():
            return ("importing %s left a thread pool (OpenMP's, after a parallel region) that a forked rank "
                    "would hang in" % name)
        return None

    def ready(self):
        torch = sys.modules.get("torch")
        self.reseed_torch = torch is not None and self.torch_seed is not None and torch.initial_seed() == self.torch_seed
        self.threads = native_threads()
        for module in list(sys.modules.values()):
            path = getattr(module, "__file__", None)
            if getattr(module, "__name__", "").startswith(OURS):
                continue  # ddp-up's own, in a directory of the agent's: not the user's code
            if isinstance(path, str) and path not in self.files:
                try:
                    st = os.stat(path)
                    self.files[path] = (st.st_mtime_ns, st.st_size)
                except OSError:
                    pass
        self.checked = time.monotonic()

    def refusal(self, env):
        # Why a rank with environment ``env`` cannot be forked now, or None.
        if time.monotonic() - self.checked > FILES_FRESH:  # each request's, at most every FILES_FRESH seconds
            for path, (mtime, size) in self.files.items():
                try:
                    st = os.stat(path)
                    if (st.st_mtime_ns, st.st_size) != (mtime, size):
                        return "STALE", "%s changed on disk since the warm interpreter imported it" % path
                except OSError:
                    return "STALE", "%s is gone since the warm interpreter imported it" % path
            self.checked = time.monotonic()
        if python_threads() or native_threads() > self.threads:
            return "THREAD", "a thread started in the warm interpreter after its imports"
        for key in sorted(self.missing):
            readers = self.missing[key] - set(REDO)
            # the value an import set itself, which the rank inherited (torch's inductor cache
            # directory, read and then set to its default): what it found made no difference
            own = key in self.set and env.get(key) == self.set[key][1]
            if key in env and readers and not own:
                return "RANK", ("importing %s read %s before any rank had it, and kept what it found"
                                % (sorted(readers)[0], key))
        return None

    def in_rank(self):
        # In the child, its environment the rank's: what a cold rank's imports would have given it.
        for key, (was, now) in self.set.items():
            if os.environ.get(key) == was:
                if now is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = now
        for name, redo in REDO.items():
            if name in sys.modules:
                try:
                    redo(sys.modules[name])
                except Exception:
                    pass
        torch = sys.modules.get("torch")
        if self.reseed_torch:
            torch.default_generator.seed()  # fresh, as a new process's (CUDA's is made in the rank, as cold)
        legacy = sys.modules.get("numpy.random")
        if legacy is not None and hasattr(legacy, "seed"):
            legacy.seed()  # NumPy's global generator, seeded from the OS as its import seeds it


def reader(name):
    # The module whose code looked a variable up (os's and collections.abc's own frames passed over),
    # else the preload being imported.
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__") in ("os", "_collections_abc", "collections.abc"):
        frame = frame.f_back
    return frame.f_globals.get("__name__") or name if frame is not None else name


def rank_zero(module):
    # Lightning: the rank its rank_zero_only decorator compares with, read from the environment at import
    module.rank_zero_only.rank = module._get_rank() or 0


def local_rank_zero(module):
    # torchmetrics (which `pip install lightning` brings): the same decorator's rank, as LOCAL_RANK
    module.rank_zero_only.rank = int(os.environ.get("LOCAL_RANK", 0))


REDO = {"lightning.fabric.utilities.rank_zero": rank_zero, "lightning_fabric.utilities.rank_zero": rank_zero,
        "torchmetrics.utilities.prints": local_rank_zero}
FILES_FRESH = 0.5  # seconds a check of the imported modules' files holds for the next request
OURS = __name__.rpartition(".")[0] + "."  # this room's modules, as the warm interpreter imported them


def fork_hangs(bound=10.0):
    # Whether a child forked now hangs in a thread pool that an import left: torch's intra-op threads
    # (OpenMP's, after one parallel region, hang every forked child's next one), NumPy's BLAS (which
    # stops its own around a fork). Run in a child forked to ask, for ``bound`` seconds at most.
    pid = os.fork()
    if pid == 0:
        try:
            torch = sys.modules.get("torch")
            if torch is not None and hasattr(torch, "ones"):
                torch.set_num_threads(max(2, torch.get_num_threads()))
                torch.ones(256, 256).mm(torch.ones(256, 256))
                torch.ones(1 << 18).add_(1).sum()
            numpy = sys.modules.get("numpy")
            if numpy is not None and hasattr(numpy, "ones"):
                numpy.ones((256, 256)).dot(numpy.ones((256, 256)))
        finally:
            os._exit(0)
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        if os.waitpid(pid, os.WNOHANG)[0]:
            return False
        time.sleep(0.005)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return True
