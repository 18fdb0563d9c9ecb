"""Which saved versions of ``dsv4ops/store/kernels.py`` write the reference's bytes on this GPU.

    python tests/gpu/store_bytes.py [saved kernels.py ...]

Runs the working tree's store kernels (with and without ``HW_CAST``) and each saved version on
``tests/test_store.py``'s cases (every format, decode and prefill, page sizes 1 and 64) against
``norm_rope_store_reference``. Per case it prints ``differing bytes / bytes the reference wrote``
and the first differing slots (slot index, ``s`` for a code slot or ``c`` for the scale area,
count and first offsets); for the working tree, the first differing slot's bytes. A bisection aid
for faults only the GPU compiler shows (the interpreter runs the same code to the reference's
bytes in CI). Needs a GPU.
"""

from __future__ import annotations

import os
import sys

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))]

from benchmarks.ab_store import load_version  # noqa: E402
from dsv4ops.store import kernels as current  # noqa: E402
from test_store import FORMATS, kernel_and_reference_bytes  # noqa: E402


def differing_slots(got, want, layout, page_size):
    """{(slot, 's' or 'c'): [offsets]} of the bytes where ``got`` and ``want`` differ."""
    slots = {}
    code_bytes = layout.page_size * layout.slot_bytes
    for page, off in (got != want).nonzero().tolist():
        if off < code_bytes:
            key = (page * page_size + off // layout.slot_bytes, "s")
            slots.setdefault(key, []).append(off % layout.slot_bytes)
        else:
            key = (page * page_size + (off - code_bytes) // max(layout.scale_stride, 1), "c")
            slots.setdefault(key, []).append(off)
    return slots


def check(name, module, show_first=False):
    for fmt in FORMATS:
        for is_decode in (True, False):
            report = []
            for page_size in (1, 64):
                got, want, poison, layout = kernel_and_reference_bytes(module.norm_rope_store, fmt, is_decode,
                                                                       page_size, "cuda")
                slots = differing_slots(got, want, layout, page_size)
                first = "; ".join(f"{slot}{kind}:{len(v)}@{v[:3]}" for (slot, kind), v in list(slots.items())[:4])
                report.append(f"ps{page_size} {int((got != want).sum())}/{int((want != poison).sum())} {first}")
                if slots and show_first:
                    page, off = (got != want).nonzero()[0].tolist()
                    start = off - off % layout.slot_bytes if off < layout.page_size * layout.slot_bytes else off
                    print(f"  {fmt} {'decode' if is_decode else 'extend'} page size {page_size}, page {page}, "
                          f"byte {start}:\n    want {want[page, start:start + 24].tolist()}\n"
                          f"    got  {got[page, start:start + 24].tolist()}", flush=True)
            print(f"{name:28s} {fmt:12s} {'decode' if is_decode else 'extend'}: " + " | ".join(report), flush=True)


def main(paths):
    no_hw_cast = load_version(current.__file__, "store_kernels_no_hw_cast")
    no_hw_cast.hardware_casts = lambda: False
    check("working tree", current, show_first=True)
    check("working tree, HW_CAST off", no_hw_cast)
    for path in paths:
        check(path, load_version(path, "store_kernels_" + os.path.basename(path).replace(".", "_")), show_first=True)


if __name__ == "__main__":
    main(sys.argv[1:])
