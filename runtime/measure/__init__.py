"""Measuring on this device: calibration timing and the interleaved bench loop (timing), decode-trace metrics
(trace_profile)."""
