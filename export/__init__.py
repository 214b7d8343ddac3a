"""ONNX and OM export (issue: export)."""
