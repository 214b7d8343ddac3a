"""The kernel formats: the names by which a quantized linear's data reaches a kernel. The
runtime's linear kernels register under them (`cvt.runtime.kernels`), the layout table keys its
entries by them, and the manifest records each module's (`kernel_fmt`). Defined here, once."""

W8A8_DYNAMIC = "w8a8_dynamic"  # int8 weights per channel, int8 activations per token at run time
W8A8_STATIC = "w8a8_static"    # int8 weights, a calibrated static activation scale (Ascend W8A8)
W4A16 = "w4a16"                # int4 weights in groups along k (or per channel), float activations
W4A8_DYNAMIC = "w4a8_dynamic"  # int4 weights per channel, int8 activations per token
NVFP4 = "nvfp4"                # E2M1 weights, group 16, E4M3 scales and a global scale
MXFP4 = "mxfp4"                # E2M1 weights, group 32, E8M0 scales
MXFP8 = "mxfp8"                # E4M3 weights, block 32, E8M0 scales; MXFP8 activations (Ascend W8A8_MXFP8)
W4A4_MXFP4 = "w4a4_mxfp4"      # E2M1 weights, block 32, E8M0 scales; MXFP4 activations (Ascend W4A4_MXFP4)
W4A8_MXFP = "w4a8_mxfp"        # E2M1 weights, block 32, E8M0 scales; MXFP8 activations (Ascend W4A8_MXFP)
W4A4_FLATQUANT = "w4a4_flatquant"  # int4 weights per channel, online Kronecker transform, int4 activations
W4A4_MXFP4_FLATQUANT = "w4a4_mxfp4_flatquant"  # MXFP4 weights, online Kronecker transform, MXFP4 activations
FP8_BLOCK = "fp8_block"        # an FP8 release's e4m3 weights with 128x128 block scales
DENSE = "dense"                # a float weight
