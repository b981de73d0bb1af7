"""EBRL: an asynchronous embodied-RL runtime.

    import ebrl
    result = await ebrl.run(trainer)   # inside your own event loop
    result = ebrl.run_sync(trainer)    # in a script: starts uvloop
"""

from ebrl.config import ConfigError, RunConfig, Schedule, SegmentCut, SimBackend
from ebrl.runtime.run import run, run_sync
from ebrl.runtime.stats import RunResult
from ebrl.trainer import Trainer

__all__ = ["ConfigError", "RunConfig", "RunResult", "Schedule", "SegmentCut", "SimBackend", "Trainer", "run", "run_sync"]
__version__ = "0.1.0"
