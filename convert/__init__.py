"""Checkpoint reading and writing, architecture tables, and the fp8-to-bf16 stage.

Public API:
    open_checkpoint(src, revision=None) -> Checkpoint      header-only index, streamed reads
    fp8_to_bf16(src, dst, ...) -> StageResult                the `cvt fp8-to-bf16` stage
    inspect_checkpoint(path) -> InspectReport                 the `cvt inspect` verb
"""
