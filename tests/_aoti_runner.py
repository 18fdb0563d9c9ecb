"""Fresh-process runner for AOTInductor packages (used by tests/test_deploy.py; runnable by hand).

    python -X faulthandler tests/_aoti_runner.py JOB.pt RESULT.pt

``JOB.pt`` (``torch.save``) holds ``device``, ``mode``, ``packages`` (name -> .pt2 path), the
initial ``state`` / ``kvcache`` and the ``steps`` (``{"package": name, "args": [cpu tensors]}``).

* ``mode="inputs"``: the packages take the state and the cache as their first two inputs and
  write them in place (the deployment design of docs/deployment.md);
* ``mode="constants"``: the state and the cache are module buffers baked into the package as
  AOTI constants. The steps run twice: once on the runner's own constants (which cannot be read
  back), once after ``load_constants(..., user_managed=True)`` pointed them at our tensors.

This process never imports dsv4ops: it checks that a package is self-contained. Each stage is
printed (and flushed) before it runs, so after a crash the last ``stage:`` line on stderr says
where it happened; faulthandler adds the Python stack.
"""

from __future__ import annotations

import ctypes
import faulthandler
import json
import os
import sys
import tempfile
import zipfile

faulthandler.enable(all_threads=True)


def stage(msg: str) -> None:
    print(f"stage: {msg}", file=sys.stderr, flush=True)


def diagnostics(torch, device: str, packages: dict) -> dict:
    info = {
        "python": sys.version.split()[0],
        "torch": str(torch.__version__),
        "torch_git": getattr(torch.version, "git_version", None),
        "cuda_runtime": str(torch.version.cuda),
        "device": device,
    }
    try:
        import triton

        info["triton"] = str(triton.__version__)
    except ImportError:
        info["triton"] = None
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(0)
        info["capability"] = list(torch.cuda.get_device_capability(0))
        info["driver"] = torch.cuda.driver_version() if hasattr(torch.cuda, "driver_version") else None
    print("diag: " + json.dumps(info), file=sys.stderr, flush=True)
    for name, path in packages.items():
        with zipfile.ZipFile(path) as z:
            listing = [(i.filename, i.file_size) for i in z.infolist()]
        print(f"diag: package {name} ({os.path.getsize(path)} bytes):", file=sys.stderr)
        for fname, size in listing:
            print(f"diag:   {size:>12}  {fname}", file=sys.stderr)
        stage(f"{name}: load_metadata_from_package")
        meta = torch._C._aoti.AOTIModelPackageLoader.load_metadata_from_package(path, "model")
        print(f"diag: {name} metadata {json.dumps(dict(meta))}", file=sys.stderr, flush=True)
        if os.environ.get("DSV4OPS_AOTI_DLOPEN", "1") == "1":
            # dlopen the model library on its own: a crash here is in the library's load/static
            # initialisation, not in the AOTI loader or the model container
            with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(path) as z:
                libs = [f for f, _ in listing if f.endswith(".so")]
                for lib in libs:
                    stage(f"{name}: dlopen {lib}")
                    ctypes.CDLL(z.extract(lib, tmp), mode=ctypes.RTLD_LOCAL)
    info["imported_before_load"] = sorted(m for m in ("dsv4ops", "triton") if m in sys.modules)
    return info


def run_steps(torch, runners, steps, device, state, kvcache, as_inputs: bool):
    outputs = []
    for k, step in enumerate(steps):
        args = [a.to(device) for a in step["args"]]
        stage(f"step {k}: {step['package']} {[tuple(a.shape) for a in args[:1]]}")
        runner = runners[step["package"]]
        got = runner(state, kvcache, *args) if as_inputs else runner(*args)
        got = got[0] if isinstance(got, (list, tuple)) else got
        outputs.append(got.cpu())
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return outputs


def main(job_path: str, result_path: str) -> None:
    stage("import torch")
    import torch

    stage("read job")
    job = torch.load(job_path)
    device, packages, mode = job["device"], job["packages"], job["mode"]
    result = {"diag": diagnostics(torch, device, packages)}
    runners = {}
    for name, path in packages.items():
        stage(f"{name}: aoti_load_package")
        runners[name] = torch._inductor.aoti_load_package(path)
        stage(f"{name}: loaded")
    result["constant_fqns"] = {name: sorted(r.get_constant_fqns()) for name, r in runners.items()}
    state, kvcache = job["state"].to(device), job["kvcache"].to(device)
    if mode == "inputs":
        result["outputs"] = run_steps(torch, runners, job["steps"], device, state, kvcache, True)
    else:
        # 1. the runner's own constants (initialised from the values baked in at export)
        result["outputs_runner_owned"] = run_steps(torch, runners, job["steps"], device, None, None, False)
        # 2. a second load whose state/cache constants are our tensors
        for name, path in packages.items():
            stage(f"{name}: reload + load_constants(user_managed=True)")
            runners[name] = torch._inductor.aoti_load_package(path)
            runners[name].load_constants({job["state_fqn"]: state, job["kvcache_fqn"]: kvcache},
                                         check_full_update=False, user_managed=True)
        result["outputs"] = run_steps(torch, runners, job["steps"], device, None, None, False)
    result["state"], result["kvcache"] = state.cpu(), kvcache.cpu()
    result["imported_at_exit"] = sorted(m for m in ("dsv4ops", "triton") if m in sys.modules)
    stage("save result")
    torch.save(result, result_path)
    stage("done")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
