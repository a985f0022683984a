"""Capture: run the model over calibration text and accumulate the ridge statistics (docs/capture.md).

    from ridgefill.capture import CaptureConfig, capture     # the stage (run.py) and its settings (config.py)
    from ridgefill.capture import artifact                   # its files, for the stages that read a capture
"""

from ridgefill.lazy import exports

__getattr__, __all__ = exports(__name__, {"CaptureConfig": "config", "capture": "run"})
