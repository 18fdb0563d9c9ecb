"""Copies of ``dsv4ops/compress/kernels.py`` with a ratio-128 sweep's winners as the defaults, for
an A/B against the working tree (``benchmarks.ab_compress``: outputs compared, same state bits), so
that one device call can sweep, pick and confirm:

    python -m benchmarks.run --only sweep --groups "^streaming, prefill c128-main" --configs c128-main \\
        --tokens 16384 4096 65536 8192 | tee sweep.log
    python -m benchmarks.sweep_winners sweep.log OUTDIR
    for v in OUTDIR/variant-*.py; do
        python -m benchmarks.ab_compress "$v" --configs c128-main --tokens 4096 8192 16384 65536 --batches 1
    done

It reads the sweep's ``best  streaming, prefill c128-main <tokens> tok / <requests> req: <label>``
lines and writes, where the winner is not what the working tree already runs at that size:

- ``variant-small.py``: the first winner other than the default, from the smallest size up, below
  ``C128_LARGE``'s first plan row count, as the small-plan tile (``C128_STREAM_STAGES``, ``C128_STREAM_TILE``, ``C128_ROWS_PER_PROGRAM``);
- ``variant-large-<tokens>.py``: the winner at a size from that count on as ``C128_LARGE``'s tile and
  stages (same first plan row count), one file per distinct winner;
- ``variant-cut-<tokens>.py``: ``C128_LARGE`` from ``<tokens>`` plan rows on, with the winner at that
  size below the current count when it is ``C128_LARGE``'s tile or a large size's winner (the cut
  between the two tiles moves down).

A winner that pools whole windows (``C128_STREAM_STAGES 0``) or that changes the plan rows per
program of the large tile (``C128_LARGE`` has no such field) is reported and left out.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
from typing import Dict, NamedTuple, Optional

from dsv4ops.compress import kernels as ck

BEST = re.compile(r"^best  streaming, prefill c128-main (\d+) tok / \d+ req: (.*?):\s+[\d.]+ us")
#: ``sweep.c128_stream_label``'s format
STREAMING = re.compile(r"^C128_STREAM_STAGES (\d+) C128_STREAM_TILE (\(.*?\)) C128_ROWS_PER_PROGRAM (\d+)$")


class Streaming(NamedTuple):
    stages: int
    tile: tuple
    rows_per_program: int


def read_winners(log_text: str) -> Dict[int, str]:
    """The winning label of each swept token count."""
    return {int(m.group(1)): m.group(2) for m in map(BEST.match, log_text.splitlines()) if m}


def parse(label: str) -> Optional[Streaming]:
    """The streaming settings a label names, or None (the whole-window candidate)."""
    m = STREAMING.match(label)
    return Streaming(int(m.group(1)), ast.literal_eval(m.group(2)), int(m.group(3))) if m else None


def _set(source: str, name: str, value) -> str:
    """``source`` with the module-level assignment ``name = ...`` (the first unindented one) set to
    ``value``."""
    new, count = re.subn(rf"(?m)^{name} = .*$", f"{name} = {value!r}", source, count=1)
    if count != 1:
        raise ValueError(f"no module-level {name} in kernels.py")
    return new


def variants(winners: Dict[int, str], source: str) -> Dict[str, str]:
    """File name -> kernels.py source, for the winners that differ from the working tree's
    defaults (``ck``'s)."""
    first_large = ck.C128_LARGE[0] if ck.C128_LARGE else None
    large = (ck.C128_LARGE[1], ck.C128_LARGE[2]) if ck.C128_LARGE else None
    small_default = Streaming(ck.C128_STREAM_STAGES, ck.C128_STREAM_TILE, ck.C128_ROWS_PER_PROGRAM)
    # the tiles the large plans run or won with: one of them winning below the cut moves the cut
    parsed = {tokens: parse(label) for tokens, label in winners.items()}
    large_tiles = {large} | {(w.tile, w.stages) for tokens, w in parsed.items()
                             if w is not None and first_large is not None and tokens >= first_large}
    out: Dict[str, str] = {}
    for tokens in sorted(winners):
        best = parsed[tokens]
        if best is None:
            print(f"{tokens} tokens: the whole-window pool won ({winners[tokens]}): no variant")
            continue
        if first_large is None or tokens < first_large:  # a plan the small-plan tile pools
            if (best.tile, best.stages) in large_tiles and best.rows_per_program == ck.C128_ROWS_PER_PROGRAM:
                name, text = f"variant-cut-{tokens}.py", _set(source, "C128_LARGE", (tokens, best.tile, best.stages))
            elif best != small_default and "variant-small.py" not in out:
                text = _set(source, "C128_STREAM_STAGES", best.stages)
                text = _set(text, "C128_STREAM_TILE", best.tile)
                name, text = "variant-small.py", _set(text, "C128_ROWS_PER_PROGRAM", best.rows_per_program)
            else:
                continue
        elif best.rows_per_program != ck.C128_ROWS_PER_PROGRAM:
            print(f"{tokens} tokens: the winner changes the plan rows per program ({winners[tokens]}): no variant")
            continue
        elif (best.tile, best.stages) != large:
            name, text = f"variant-large-{tokens}.py", _set(source, "C128_LARGE", (first_large, best.tile, best.stages))
            if text in out.values():
                continue  # the same tile won at a smaller size
        else:
            continue
        out[name] = text
        print(f"{tokens} tokens: {winners[tokens]} -> {name}")
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log", help="the output of benchmarks.run --only sweep (streaming, c128-main)")
    parser.add_argument("outdir")
    args = parser.parse_args(argv)
    with open(args.log) as f:
        winners = read_winners(f.read())
    with open(ck.__file__) as f:
        source = f.read()
    os.makedirs(args.outdir, exist_ok=True)
    for name, text in variants(winners, source).items():
        with open(os.path.join(args.outdir, name), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
