"""benchmarks/cute_sass.py's reading of a kernel's SASS: which loop is the key-tile loop, and how many EX2s
come before each WGMMA wait in it (the measure of whether the softmax overlaps P V)."""
import pytest
from script_loader import load_script

pytest.importorskip("torch")

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   MUFU.EX2 R2, R2 ;
        /*0020*/                   IGMMA.64x128x32.S8.S8.SAT R88, gdesc[UR8], RZ, !UPT, gsb0 ;
        /*0030*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R24, R152, gdesc[UR24], R24, gsb0 ;
        /*0040*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*0050*/                   MUFU.EX2 R3, R3 ;
        /*0060*/                   FMNMX R4, R3, R5, !PT ;
        /*0070*/                   MUFU.EX2 R6, R6 ;
        /*0080*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0090*/                   FMUL R24, R24, R6 ;
        /*00a0*/              @P0 BRA 0x20 ;
        /*00b0*/                   IGMMA.64x128x32.S8.S8.SAT R88, gdesc[UR8], RZ, !UPT, gsb0 ;
        /*00c0*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R24, R152, gdesc[UR24], R24, gsb0 ;
        /*00d0*/                   MUFU.EX2 R7, R7 ;
        /*00e0*/              @P1 BRA 0x0 ;
"""


@pytest.fixture(scope="module")
def cs():
    return load_script("benchmarks/cute_sass.py")


def test_the_key_tile_loop_is_the_shortest_one_with_both_products_and_ex2(cs):
    loop = cs.main_loop(SASS)
    assert [addr for addr, _, _ in loop] == list(range(0x20, 0xa1, 0x10))  # not the outer 0x0-0xe0 loop


def test_each_wait_is_counted_after_the_ex2s_before_it(cs):
    rep = cs.report("ptxas info    : Used 168 registers, 8 bytes spill stores", SASS)
    assert rep["loop_waits"] == [{"ex2_before": 0, "wait": "LE gsb0, 0x1"}, {"ex2_before": 2, "wait": "LE gsb0, 0x0"}]
    assert rep["registers"] == 168 and rep["spill_store_bytes"] == 8 and rep["loop_ex2"] == 2
    assert rep["loop_instructions_per_tile"] == 9.0 and rep["loop_opcodes_per_tile"]["MUFU"] == 2
