"""DeepSeek-V4's rope settings as transformers 5.24 writes them: ``rope_parameters`` nested as
``{"main": the sliding layers' plain rope, "compress": the compressed layers'}``
(DeepseekV4Config.__post_init__) beside the release's flat keys. The runtime reads ``compress`` as
the compressed layers' scaling and refuses a nested form that says other than the flat keys."""

from __future__ import annotations

from typing import Any, Callable

from cvt.convert.arch.deepseek_v4 import DEFAULTS


def nested_compress(args) -> dict[str, Any] | None:
    """rope_parameters' ``compress`` entry, or None when rope_parameters is not nested."""
    rp = args.rope_parameters or {}
    return rp["compress"] if isinstance(rp.get("compress"), dict) else None


def check_nested_rope(args, bad: Callable[[str, str], None]) -> None:
    """The nested form must say what the flat keys say: ``main`` plain rope at rope_theta,
    ``compress`` at compress_rope_theta, both rotating rope_dim of head_dim, YaRN's
    attention_factor 1 (no cos / sin scaling: the official code's). `bad(key, why)` raises."""
    comp = nested_compress(args)
    if comp is None:
        return
    rp = args.rope_parameters
    main = rp.get("main") or {}
    if args.rope_theta is None:
        args.rope_theta = main.get("rope_theta", DEFAULTS["rope_theta"])
    if set(rp) - {"main", "compress"} or main.get("rope_type", "default") != "default" or set(main) - {
            "rope_type", "rope_theta", "partial_rotary_factor"} or main.get("rope_theta", args.rope_theta) != args.rope_theta:
        bad("rope_parameters.main", f"{main!r}: plain rope at rope_theta ({args.rope_theta}) only")
    if comp.get("rope_theta", args.compress_rope_theta) != args.compress_rope_theta:
        bad("rope_parameters.compress.rope_theta", f"{comp['rope_theta']!r} differs from compress_rope_theta "
            f"({args.compress_rope_theta})")
    if comp.get("attention_factor", 1.0) != 1.0:
        bad("rope_parameters.compress.attention_factor", f"{comp['attention_factor']!r} (1.0 only)")
    for where, d in (("main", main), ("compress", comp)):
        f = d.get("partial_rotary_factor")
        if f is not None and int(args.head_dim * f) != args.rope_dim:
            bad(f"rope_parameters.{where}.partial_rotary_factor", f"{f!r} rotates {int(args.head_dim * f)} dims, "
                f"qk_rope_head_dim says {args.rope_dim}")
