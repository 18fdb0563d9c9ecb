"""The checks ``tests/_sm90.py`` runs on every compiled kernel variant, on snippets of the
compiler output that they must flag and must pass (taken from kernels that were wrong or slow
on a GPU, and from their fixes). No compile: these run anywhere, in milliseconds."""

from __future__ import annotations

from _sm90 import accesses_across_rows, fused_multiply_adds_in, innermost_loops_in, interleaved_lane_reductions

#: the fourteenth session's main FP8 decode store: its norm sum over a [2, 512] reshape got a
#: linear layout with the row at lane bit 3, reduced along lane bits 0-2 and 4 (wrong on an H100)
ROW_AMONG_LANES = """\
#linear = #ttg.linear<{register = [[0, 1], [0, 2], [0, 4]], lane = [[0, 8], [0, 16], [0, 32], [1, 0], [0, 64]], warp = [[0, 128], [0, 256]], block = []}>
      %rstd_189 = "tt.reduce"(%rstd_188) <{axis = 1 : i32}> ({
      ^bb0(%rstd_281: f64 loc(#loc1), %rstd_282: f64 loc(#loc1)):
        %rstd_283 = arith.addf %rstd_281, %rstd_282 : f64 loc(#loc439)
        tt.reduce.return %rstd_283 : f64 loc(#loc410)
      }) : (tensor<2x512xf64, #linear>) -> tensor<2xf64, #ttg.slice<{dim = 1, parent = #linear}>> loc(#loc410)
"""


def test_interleaved_lane_reductions():
    assert interleaved_lane_reductions(ROW_AMONG_LANES) == [(1, "#linear", [0, 1, 2, 4])]
    # the same reduction with the row at the highest lane bit: the reduced axis owns lane bits 0-3
    row_last = ROW_AMONG_LANES.replace("[[0, 8], [0, 16], [0, 32], [1, 0], [0, 64]]",
                                       "[[0, 8], [0, 16], [0, 32], [0, 64], [1, 0]]")
    assert interleaved_lane_reductions(row_last) == []
    # a reduction over a blocked layout is lowered by another path and not flagged
    blocked = ROW_AMONG_LANES.replace("#linear>)", "#blocked2>)")
    assert interleaved_lane_reductions(blocked) == []


#: 7098701's main bf16 store: 32-bit words addressed as byte offsets, then cast; Triton laid the
#: store out with the rows fastest across lanes
ROWS_FASTEST = """\
#blocked = #ttg.blocked<{sizePerThread = [1, 1, 1], threadsPerWarp = [8, 4, 1], warpsPerCTA = [1, 2, 2], order = [0, 1, 2]}>
#blocked1 = #ttg.blocked<{sizePerThread = [1, 1, 4], threadsPerWarp = [4, 1, 8], warpsPerCTA = [2, 2, 1], order = [2, 0, 1]}>
      tt.store %at_377, %90, %91 : tensor<8x8x32x!tt.ptr<i32>, #blocked> loc(#loc272)
"""


def test_accesses_across_rows():
    assert accesses_across_rows(ROWS_FASTEST) == [("store", "8x8x32", "#blocked", [0, 1, 2])]
    # the fix: the same store in a layout whose lanes run along the words
    assert accesses_across_rows(ROWS_FASTEST.replace(", #blocked>", ", #blocked1>")) == []
    # an axis of length 1 does not count: a [1, 64] load is contiguous whatever its order says
    one_row = ROWS_FASTEST.replace("tensor<8x8x32x", "tensor<1x1x32x")
    assert accesses_across_rows(one_row) == []


def test_fused_multiply_adds_in():
    sass = """\
        /*0d90*/                   FFMA R19, -R12, R19, RZ ;
        /*0da0*/                   FFMA R11, R15.reuse, R18.reuse, R14 ;
        /*0930*/                   FFMA R10, RZ, 3.5, R31 ;
        /*2040*/                   FFMA R20, R21.reuse, R8, 8388608 ;
        /*2050*/                   FMUL R9, R9, R10 ;
"""
    # the fourteenth session's Hadamard (a product fused into its partner's add) and the integer
    # e4m3 rounding's exact a * 512 + 2^23 are fused; a product alone (addend RZ) and the fp64
    # division's range checks (a multiplicand RZ) round as the unfused operations do
    assert fused_multiply_adds_in(sass) == ["FFMA R11, R15.reuse, R18.reuse, R14 ;",
                                            "FFMA R20, R21.reuse, R8, 8388608 ;"]


def test_innermost_loops_in():
    """Two loops nested in an outer one, and a forward branch: the counts are of the two inner loops
    alone, padding left out (``benchmarks.static``'s instructions per tile element)."""
    sass = """\
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   IADD3 R2, R2, 0x1, RZ ;
        /*0020*/                   FADD R3, R3, R4 ;
        /*0030*/                   ISETP.GE.AND P0, PT, R2, 0x8, PT ;
        /*0040*/               @!P0 BRA 0x20 ;
        /*0050*/                   BRA 0x80 ;
        /*0060*/                   NOP;
        /*0070*/                   NOP;
        /*0080*/                   LDS R5, [R6] ;
        /*0090*/                   FMUL R5, R5, R5 ;
        /*00a0*/               @P1 BRA 0x80 ;
        /*00b0*/               @P2 BRA 0x10 ;
        /*00c0*/                   EXIT ;
"""
    assert innermost_loops_in(sass) == [3, 3]
