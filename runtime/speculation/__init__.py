"""The maths of speculative decoding on numpy, no engine and no files: draft trees, sampling, acceptance,
prompt lookup, the calibration model, tree choice, the fallback rule and the acceptance heads."""
