"""A rank of `test_world.py`'s shared-folder check: ``python -m tests.convert.world_probe DIR0 DIR1``
under torchrun; rank R checks DIR_R with `cvt.world.World.check_shared` and says the error as cvt does."""

import sys
from pathlib import Path

from cvt import world
from cvt.errors import CvtError

if __name__ == "__main__":
    w = world.from_env().start("cpu")
    try:
        w.check_shared(Path(sys.argv[1 + w.rank]))
    except world.PeerFailed as exc:  # as cvt's CLI: the rank that failed said it
        sys.exit(exc.exit_code)
    except CvtError as exc:
        sys.stderr.write(f"cvt: error: rank {w.rank}: {exc}\n")
        sys.exit(exc.exit_code)
    world.stop()
