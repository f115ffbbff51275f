"""Stage 1: PyTorch -> ONNX with named dynamic dims, verified in ONNX Runtime."""
from trt_sora.export.exporter import ExportResult, export_onnx, verify_onnx

__all__ = ["ExportResult", "export_onnx", "verify_onnx"]
