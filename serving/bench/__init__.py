"""The latency benchmark suite: workloads, load generation, metrics and reports for any ``ServingAdapter``.

``qcompile bench`` (``qcompile/cli/bench.py``) is its command line; metric definitions are in
``serving.bench.metrics`` and docs/BENCH.md.
"""
