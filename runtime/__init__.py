"""The bundled runtime: models, linear kernels, loader, generation, verify reports.

Layout:
  models/      one dense readable file per family (deepseek_v3.py, qwen3.py), registry in __init__
  kernels/     `Linear` interface + one reference implementation per weight format (+ torch_npu path)
  loader.py    any cvt output (through its manifest) or plain HF BF16/FP8 dir -> model, streaming
  generate.py  prefill + decode with a KV cache, greedy / temperature + top-p, batches
  metrics.py   cosine, max abs/rel error, thousandth ratios, EucDist, SQNR, KL, PPL (one place)
  verify.py    run candidate and reference on the same tokens, compare, write report.{json,md,html}
"""
