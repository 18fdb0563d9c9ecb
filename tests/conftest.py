import os

import torch

# Without a GPU, the Triton kernels are tested under the Triton interpreter on CPU tensors.
# The variable must be set before dsv4ops (and its @triton.jit kernels) is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from dsv4ops.testing import fix_triton_interpreter  # noqa: E402

# Inductor's FX-graph and AOT caches key on the traced graph, not on the Python body of a
# custom op that Inductor decomposes (torch.library.triton_op); a stale entry would run an
# old version of an op under test. Compile from scratch in tests.
torch._inductor.config.fx_graph_cache = False
torch._functorch.config.enable_autograd_cache = False


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run tests marked slow")


def pytest_collection_modifyitems(config, items):
    skip_slow = pytest.mark.skip(reason="slow: pass --runslow")
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "slow" in item.keywords and not config.getoption("--runslow"):
            item.add_marker(skip_slow)
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


def _devices():
    devs = ["cpu"]
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        devs.append("cuda")
    return devs


DEVICES = _devices()


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from a clean Dynamo cache: the layer's ``forward`` is one code object,
    and a dozen layer configurations compiled in one process would otherwise reach Dynamo's
    recompile limit (8 entries per code object) in whichever test comes ninth."""
    torch._dynamo.reset()


fix_triton_interpreter()
