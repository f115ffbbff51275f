"""SM values order as numbers in every form the artifacts carry (a string comparison puts 10.0 below 8.9)."""
import pytest

from trt_sora.errors import ConfigError
from trt_sora.sm import parse_sm, sm_int


@pytest.mark.parametrize("value, want", [("8.9", (8, 9)), ("9.0", (9, 0)), ("10.0", (10, 0)), ("12.1", (12, 1)),
                                         (89, (8, 9)), (100, (10, 0)), ("90", (9, 0)), ("sm_90", (9, 0)),
                                         ("SM100", (10, 0)), ((12, 0), (12, 0)), (8.9, (8, 9))])
def test_parse_sm_reads_every_form(value, want):
    assert parse_sm(value) == want


def test_sm_values_order_as_numbers():
    forms = ["8.9", 90, "sm_100", "12.0"]
    assert sorted(forms, key=parse_sm) == forms
    assert [sm_int(f) for f in forms] == [89, 90, 100, 120]
    assert parse_sm("10.0") >= parse_sm("8.9") and sm_int("10.0") >= sm_int(89)
    assert not "10.0" >= "8.9"  # why: the comparison the GPU tests used to make


@pytest.mark.parametrize("bad", ["", "9", "ampere", "8.10", None, True, "9.0.1"])
def test_parse_sm_refuses_other_values(bad):
    with pytest.raises(ConfigError, match="compute capability"):
        parse_sm(bad)


def test_reports_read_back_in_either_form():
    """The parity report writes "9.0" (sm_dotted), the build report 90: both read as one integer, and a
    report without one reads as None (the runtime then refuses a GPU backend)."""
    from trt_sora.sm import sm_dotted, sm_or_none

    assert [sm_dotted(v) for v in (90, "sm_100", (12, 1), "8.9")] == ["9.0", "10.0", "12.1", "8.9"]
    assert sm_int(sm_dotted(120)) == 120 and sm_or_none("9.0") == sm_or_none(90) == 90
    assert sm_or_none(None) is None and sm_or_none("hopper") is None


def test_a_device_that_is_not_cuda_has_no_sm():
    from trt_sora.sm import device_sm

    assert device_sm("cpu") is None
