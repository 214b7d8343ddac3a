"""Quantization schemes, calibration methods and output formats (issue: quantize)."""
