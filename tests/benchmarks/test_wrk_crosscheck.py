"""benchmarks/wrk_crosscheck.py: wrk's report parsed into the figures compared, and the script on the tiny
model against a real Triton server (with wrk where it is installed; else the suite's side alone)."""
from __future__ import annotations

import shutil

import pytest

pytest_plugins = ["bench_scripts"]  # the fixture run_script

# wrk -t1 -c4 -d15s --timeout 60s --latency -s post.lua http://HOST:PORT/v2/models/crosscheck/generate (wrk 4.1's format)
WRK_REPORT = """\
Running 15s test @ http://127.0.0.1:8000/v2/models/crosscheck/generate
  1 threads and 4 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency    20.51ms    2.03ms  35.72ms   80.12%
    Req/Sec   195.23     12.01   220.00     70.00%
  Latency Distribution
     50%   20.13ms
     75%   21.44ms
     90%   23.03ms
     99%   27.39ms
  2918 requests in 15.01s, 1.02MB read
Requests/sec:    194.37
Transfer/sec:     69.37KB
"""


def test_wrk_report_gives_p50_rate_and_count():
    from bench_scripts import load_script

    wrk = load_script("wrk_crosscheck")
    assert wrk.parse_wrk(WRK_REPORT) == {"p50_ms": 20.13, "requests_per_s": 194.37, "requests": 2918}
    assert wrk.parse_wrk(WRK_REPORT.replace("50%   20.13ms", "50%  812.00us"))["p50_ms"] == pytest.approx(0.812)
    with pytest.raises(SystemExit, match="failed requests"):
        wrk.parse_wrk(WRK_REPORT + "  Non-2xx or 3xx responses: 3\n")
    with pytest.raises(SystemExit, match="lacks"):
        wrk.parse_wrk(WRK_REPORT.replace("Requests/sec:", "Requests:"))


@pytest.mark.integration
def test_crosscheck_on_the_tiny_model(run_script, tmp_path):
    from backends.triton.runtime import TritonServerError, find_install
    from bench_scripts import load_script

    try:
        find_install()
    except TritonServerError as e:
        pytest.skip(f"no Triton server here: {e}")
    if shutil.which("wrk") is not None:
        run_script("wrk_crosscheck", "--concurrency", 1, "--duration", 2, "--rounds", 1, "--json", tmp_path / "out.json")
        return
    wrk = load_script("wrk_crosscheck")  # no wrk here: the suite's side of the check
    artifact = wrk.tiny_artifact(tmp_path)
    server = wrk.start_server(artifact, tmp_path)
    try:
        figures = wrk.run_suite(server.http_url, wrk.the_request(artifact, 16, 4), 1, 1.0)
    finally:
        server.stop()
    assert figures["requests"] > 0 and figures["p50_ms"] > 0 and figures["requests_per_s"] > 0
