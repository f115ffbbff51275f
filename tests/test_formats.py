"""The quantized formats' table against the dtypes' own limits (torch's finfo / iinfo)."""
import pytest

from trt_sora.config.recipe import QuantFormat
from trt_sora.errors import ConfigError
from trt_sora.formats import QMAX, qmax, quant_format

torch = pytest.importorskip("torch")


def test_qmax_is_the_largest_magnitude_of_each_dtype():
    assert qmax("fp8_e4m3") == torch.finfo(torch.float8_e4m3fn).max
    assert qmax(QuantFormat.INT8) == torch.iinfo(torch.int8).max
    assert set(QMAX) == set(QuantFormat) - {QuantFormat.NONE}


@pytest.mark.parametrize("bad, hint", [("none", "no quantized values"), ("fp8_e4m", "did you mean"),
                                       ("int4", "use one of")])
def test_a_format_without_quantized_values_is_refused_by_name(bad, hint):
    with pytest.raises(ConfigError, match=hint):
        quant_format(bad)
