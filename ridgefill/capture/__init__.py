"""Capture: run the model over calibration text and accumulate the ridge statistics (docs/capture.md)."""
