"""The benchmarks: scripts run as modules (``python -m benchmarks.NAME``) on one harness."""
