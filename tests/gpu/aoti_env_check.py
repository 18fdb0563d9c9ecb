"""Does a trivial AOTInductor package load on this machine? (no dsv4ops involved)

    python tests/gpu/aoti_env_check.py [out dir] [devices, e.g. cuda or cpu,cuda]

Builds a two-op package for CPU and, when a GPU is present, for CUDA; prints the C++ compiler
Inductor uses, the libstdc++ it links against and the one the Python process has loaded, the
model library's NEEDED entries and how many libstdc++ locale/codecvt symbols it defines itself;
then loads each package in a fresh process, once plainly and once with the compiler's
libstdc++ preloaded. A crash in the plain load only is a libstdc++ mismatch between the
compiler and the process (see docs/deployment.md, "GPU status").
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile

import torch

LOAD = """
import sys, torch
maps = open('/proc/self/maps').read().split()
print('loaded libstdc++:', sorted({p for p in maps if 'libstdc++' in p}), flush=True)
runner = torch._inductor.aoti_load_package(sys.argv[1])
x = torch.arange(6.0, device=sys.argv[2]).view(2, 3)
print('result', runner(x).cpu().tolist(), flush=True)
"""


class Tiny(torch.nn.Module):
    def forward(self, x):
        return (x * 2 + 1).sum(0)


def sh(cmd):
    return subprocess.run(cmd, shell=True, capture_output=True, text=True).stdout.strip()


def main(out_dir, wanted=None):
    from torch._inductor.cpp_builder import get_cpp_compiler

    cxx = get_cpp_compiler()
    libstdcxx = os.path.realpath(sh(f"{cxx} -print-file-name=libstdc++.so.6"))
    print("torch", torch.__version__, "| compiler", cxx, "|", sh(f"{cxx} --version").splitlines()[0])
    print("compiler's libstdc++:", libstdcxx)
    maps = open("/proc/self/maps").read().split()
    print("this process's libstdc++:", sorted({os.path.realpath(p) for p in maps if "libstdc++" in p}))
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    devices = [d for d in devices if wanted is None or d in wanted]
    for dev in devices:
        x = torch.arange(6.0, device=dev).view(2, 3)
        ep = torch.export.export(Tiny(), (x,))
        path = torch._inductor.aoti_compile_and_package(ep, package_path=os.path.join(out_dir, f"tiny-{dev}.pt2"))
        with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(path) as z:
            lib = z.extract(next(n for n in z.namelist() if n.endswith(".so")), tmp)
            needed = [line.split()[-1] for line in sh(f"readelf -d {lib}").splitlines() if "NEEDED" in line]
            own = sh(f"nm -C --defined-only {lib} | grep -c -E 'std::locale|codecvt|std::__cxx11::collate'")
        print(f"[{dev}] model library NEEDED {needed}; libstdc++ locale symbols defined in it: {own}")
        for label, extra in (("plain", {}), ("LD_PRELOAD compiler libstdc++", {"LD_PRELOAD": libstdcxx})):
            proc = subprocess.run([sys.executable, "-X", "faulthandler", "-c", LOAD, path, dev], capture_output=True,
                                  text=True, env=dict(os.environ, **extra), timeout=300)
            tail = (proc.stdout + proc.stderr).strip().splitlines()
            shown = [t for t in tail if t.startswith(("loaded", "result", "Fatal"))]
            print(f"[{dev}] load ({label}): returncode {proc.returncode}; {shown}")


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()
    os.makedirs(out, exist_ok=True)
    main(out, sys.argv[2].split(",") if len(sys.argv) > 2 else None)
