"""The version cvt records in every manifest and report (a ground module: anything may import it)."""

__version__ = "0.1.0"
