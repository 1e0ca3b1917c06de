"""The preflight's torch probe: the versions of torch the job would import, and the CUDA and NCCL it
was built with, printed as one JSON line. Run as ``python -c`` with this file's text, in the
job's environment (its PYTHONPATH counts) or in the job's image (attempt/checks.py), stdlib only.

It does not import torch (seconds of CPU): the version and the CUDA it was built for come from
torch/version.py (plain text), and NCCL from the pip package CUDA builds depend on (a CPU build:
none). importlib.metadata (a third of this process's CPU) only where version.py does not say or a
CUDA build's NCCL is asked for. With the argument ``cloudpickle`` (a function's launch, whose
runner unpickles with it), its version too, or why it cannot be imported.
"""

import importlib
import importlib.util
import json
import os
import re
import sys


def version(name):
    try:
        import importlib.metadata as metadata
        return metadata.version(name)
    except Exception:
        return None


def assigned(name, text):
    found = re.search(r"^%s\b[^=\n]*=\s*'([^']+)'" % name, text, re.M)
    return found.group(1) if found else None


def torch_info():
    spec, info = importlib.util.find_spec("torch"), {}
    if spec is None:
        return info
    try:
        with open(os.path.join(os.path.dirname(spec.origin), "version.py")) as f:
            text = f.read()
    except (OSError, TypeError):
        text = ""
    info["torch"] = assigned("__version__", text) or version("torch") or "?"
    info["cuda"] = assigned("cuda", text)
    # a CPU build has no NCCL, whatever wheel an earlier CUDA install left; a CUDA build's is the
    # package for its CUDA major version first
    major = (info["cuda"] or "").split(".")[0]
    names = ["nvidia-nccl-cu%s" % major] + ["nvidia-nccl-cu%d" % v for v in (13, 12, 11) if str(v) != major]
    info["nccl"] = next(filter(None, map(version, names)), None) if major else None
    return info


def main(more):
    info = torch_info()
    if "cloudpickle" in more:
        try:  # the job's, not a dependency of this probe's
            cloudpickle = importlib.import_module("cloudpickle")
            info["cloudpickle"] = getattr(cloudpickle, "__version__", "?")
        except Exception as e:
            info["cloudpickle"] = None
            info["cloudpickle_error"] = "%s: %s" % (type(e).__name__, e)
    print(json.dumps(info))


if __name__ == "__main__":
    main(sys.argv[1:])
