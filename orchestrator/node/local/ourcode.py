"""ddp-up's own code as the user's Python gets it (the userpython room): a module's text, and the
room written as a package of files that the warm interpreter and torchrun's stand-ins import.

On a node the agent's modules have no files: the loader (boot.py) keeps their sources with the
package. On the controller, and in a container's image, they are files.
"""

import os
import shutil
import stat
import sys
import tempfile

from ..userpython import beforefork, inchild, names, proctitle, standin, warmparent
from ..userpython.names import PACKAGE

IMPORTED = (names, proctitle, beforefork, inchild, warmparent, standin)  # what the warm interpreter and stand-ins import


def source_of(module):
    """The text of ``module``, one of the userpython room's, as this agent has it."""
    root = module.__name__.rsplit(".", 2)[0]  # ddp_up_node on a node, orchestrator.node here, ddp_up_box in an image
    shipped = getattr(sys.modules.get(root), "SOURCES", None)
    key = module.__name__[len(root) + 1:]
    if shipped and key in shipped:
        return shipped[key].decode("utf-8")
    with open(module.__file__, encoding="utf-8") as f:
        return f.read()


def written(parent):
    """The directory, in ``parent`` (one of the agent's private directories), that holds the
    package PACKAGE: IMPORTED's files, as the user's Python imports them. Named by its contents,
    written once (whole, then renamed into place) and left for every later attempt to import."""
    import hashlib  # here: an agent that writes no code never imports it (its start-up is paid per node)

    texts = [(module.__name__.rpartition(".")[2], source_of(module)) for module in IMPORTED]
    digest = hashlib.sha256(repr(texts).encode()).hexdigest()[:16]
    final = os.path.join(parent, "code-" + digest)
    if ours(final):
        return final
    made = tempfile.mkdtemp(prefix=".code-", dir=parent)
    try:
        package = os.path.join(made, PACKAGE)
        os.mkdir(package, 0o700)
        # as state.write_private writes, here again: a container's warm start runs without state and its wire
        for name, text in texts + [("__init__", "")]:
            fd = os.open(os.path.join(package, name + ".py"), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
        os.rename(made, final)
    except OSError:
        if not ours(final):  # not another attempt's, written meanwhile
            raise
    finally:
        shutil.rmtree(made, ignore_errors=True)
    return final


def ours(path):
    """Whether ``path`` is a directory of this user's (not a link)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()
