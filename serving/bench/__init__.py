"""The latency benchmark suite: workloads, load generation, metrics and reports for any ``ServingAdapter``.

``serving.bench.benchmark.run_benchmark`` runs one (target, workload, load points) benchmark;
``qcompile bench`` (``qcompile/cli/bench.py``) is its command line, which parses and prints.
Metric definitions are in ``serving.bench.metrics`` and docs/BENCH.md.
"""
