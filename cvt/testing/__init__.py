"""Test support that ships with cvt but that the library never imports: tiny synthetic
checkpoints in the release formats (`checkpoints`, `checkpoints_v4`), used by `cvt demo`, the
benches and the tests, and the kill-and-resume tests' fault injection (`faults`), which the
CLI entry point installs into `cvt.hooks` when a ``CVT_TEST_*`` variable is set.
"""
