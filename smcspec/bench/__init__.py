"""Benchmarks: speed (side by side, interleaved), roofline (predicted vs measured speed-up) and
accuracy (HumanEval pass@1). Results are JSON lines, written as they come, so runs resume."""
