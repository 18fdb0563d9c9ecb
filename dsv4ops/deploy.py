"""AOTInductor deployment: the C++ toolchain check that keeps packages loadable.

An AOTInductor package holds a shared library that ``aoti_load_package`` opens inside a
Python process, which has already loaded the system's shared ``libstdc++``. A library built
by a compiler that links ``libstdc++`` *statically* (a compiler wrapper adding
``-static-libstdc++``, as on the H200 image used for this project) carries a second copy of
the C++ runtime, whose locale and regex machinery gets mixed with the process's copy. The
package then fails at load, in the model constructor's ``std::regex`` (``parse_device_str``):
a segmentation fault on the H200, ``create_func_(...) API call failed`` on a CPU box (see
docs/deployment.md, "GPU status"; ``tests/test_deploy.py`` reproduces it with such a
wrapper).

``ensure_aoti_compiler()`` checks Inductor's compiler before packaging and, if it links
``libstdc++`` statically, switches Inductor to one that does not, or raises an error that
says what is wrong.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import warnings
from typing import Optional, Sequence

import torch

#: compilers tried, in order, when Inductor's own one links libstdc++ statically
CANDIDATES = ("g++-real", "/usr/bin/g++", "/usr/bin/g++-14", "/usr/bin/g++-13", "/usr/bin/g++-12", "/usr/bin/c++",
              "clang++")

_SOURCE = "#include <string>\nextern \"C\" int dsv4ops_probe(const char* s) { return (int)std::string(s).size(); }\n"


def inductor_compiler() -> str:
    """The C++ compiler Inductor builds AOTInductor packages with (``torch._inductor.config.cpp.cxx``, ``$CXX``)."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    return get_cpp_compiler()


def links_libstdcxx_statically(cxx: str) -> Optional[bool]:
    """Whether a shared library that ``cxx`` links uses no shared ``libstdc++`` (None: could not tell).

    Builds a one-function C++ shared object and reads its ``NEEDED`` entries with ``readelf``."""
    readelf = shutil.which("readelf")
    if readelf is None or shutil.which(cxx) is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        src, lib = os.path.join(tmp, "probe.cpp"), os.path.join(tmp, "probe.so")
        with open(src, "w") as f:
            f.write(_SOURCE)
        built = subprocess.run([cxx, "-shared", "-fPIC", src, "-o", lib], capture_output=True, text=True)
        if built.returncode != 0:
            return None
        dynamic = subprocess.run([readelf, "-d", lib], capture_output=True, text=True).stdout
    needed = [line for line in dynamic.splitlines() if "(NEEDED)" in line]
    return not any("libstdc++" in line or "libc++" in line for line in needed)


def ensure_aoti_compiler(candidates: Sequence[str] = CANDIDATES) -> str:
    """Make sure the packages AOTInductor builds from now on link ``libstdc++`` dynamically.

    Returns the compiler Inductor will use. If its current compiler links ``libstdc++``
    statically, switches ``torch._inductor.config.cpp.cxx`` to the first of ``candidates``
    that does not (with a warning); raises ``RuntimeError`` if none does. A compiler whose
    linking cannot be checked (no ``readelf``) is left as it is.
    """
    cxx = inductor_compiler()
    if not links_libstdcxx_statically(cxx):
        return cxx
    for candidate in candidates:
        path = shutil.which(candidate)
        if path and os.path.realpath(path) != os.path.realpath(shutil.which(cxx) or cxx) \
                and links_libstdcxx_statically(path) is False:
            warnings.warn(f"dsv4ops: Inductor's C++ compiler {cxx} links libstdc++ statically; AOTInductor packages "
                          f"built with it fail at load (docs/deployment.md). Using {path} instead.", stacklevel=2)
            torch._inductor.config.cpp.cxx = (None, path)
            return path
    raise RuntimeError(
        f"dsv4ops: Inductor's C++ compiler {cxx} links libstdc++ statically, so AOTInductor packages built with it "
        "fail at load (a segmentation fault in the model's std::regex, see docs/deployment.md), and none of "
        f"{list(candidates)} links it dynamically. Point $CXX or torch._inductor.config.cpp.cxx at a compiler that "
        "does (no -static-libstdc++).")
