"""benchmarks/gguf_vs_llama_quantize.py: llama-perplexity's output (captured from the llama.cpp build
of scripts/setup_llama_cpp.sh, SmolLM2-135M Q4_0 against its F32 base, 8 chunks of pydoc) parsed into
the figures the table reports, and the goal checks of qcompile's GGUF files against llama.cpp+imatrix."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# llama-perplexity -m q4_0.gguf -f eval.txt -c 512 --chunks 8 -t 2 --kl-divergence-base base.kld --kl-divergence
KLD_OUTPUT = """\
0.02.292.956 I kl_divergence: computing over 8 chunks, n_ctx=512, batch_size=2048, n_seq=4
0.30.888.201 I kl_divergence: 28.60 seconds per pass - ETA 0.95 minutes

chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              Δp RMS            Same top p
   1      18.1665 ±    2.9814       0.25190 ±    0.05462       0.28545 ±    0.01491    11.615 ±  0.883 %    66.275 ±  2.966 %
   2      15.2751 ±    1.7828       0.25940 ±    0.03606       0.29296 ±    0.01329    14.410 ±  0.944 %    69.804 ±  2.035 %
   3      17.2272 ±    1.6600       0.26288 ±    0.03025       0.28995 ±    0.01069    14.434 ±  0.813 %    71.373 ±  1.635 %
   4      17.2736 ±    1.4609       0.25918 ±    0.02791       0.29758 ±    0.00979    14.420 ±  0.659 %    72.255 ±  1.403 %
   5      14.9473 ±    1.1039       0.23302 ±    0.02389       0.28495 ±    0.00833    14.482 ±  0.575 %    73.020 ±  1.244 %
   6      13.5000 ±    0.9013       0.22308 ±    0.02163       0.28537 ±    0.00770    14.517 ±  0.506 %    72.810 ±  1.138 %
   7      12.8982 ±    0.7992       0.20988 ±    0.01959       0.27985 ±    0.00736    14.393 ±  0.459 %    73.333 ±  1.047 %
   8      12.3171 ±    0.7167       0.21281 ±    0.01806       0.27746 ±    0.00707    14.809 ±  0.435 %    74.461 ±  0.966 %

====== Perplexity statistics ======
Mean PPL(Q)                   :  12.317134 ±   0.716730
Mean PPL(base)                :   9.956032 ±   0.579660
Cor(ln(PPL(Q)), ln(PPL(base))):  95.18%
Mean ln(PPL(Q)/PPL(base))     :   0.212813 ±   0.018064
Mean PPL(Q)/PPL(base)         :   1.237153 ±   0.022348
Mean PPL(Q)-PPL(base)         :   2.361102 ±   0.242498

====== KL divergence statistics ======
Mean    KLD:   0.277458 ±   0.007071
Maximum KLD:   4.123764
99.9%   KLD:   2.758316
99.0%   KLD:   1.459388
95.0%   KLD:   0.758070
90.0%   KLD:   0.555423
Median  KLD:   0.201334
10.0%   KLD:   0.028756
 5.0%   KLD:   0.011457
 1.0%   KLD:   0.002447
 0.1%   KLD:   0.000511
Minimum KLD:   0.000075

====== Token probability statistics ======
Mean    Δp: -5.304 ± 0.306 %
Maximum Δp: 52.925%
99.9%   Δp: 47.290%
99.0%   Δp: 28.639%
95.0%   Δp: 11.813%
90.0%   Δp:  5.106%
75.0%   Δp:  0.353%
Median  Δp: -1.068%
25.0%   Δp: -9.905%
10.0%   Δp: -22.175%
 5.0%   Δp: -33.664%
 1.0%   Δp: -51.666%
 0.1%   Δp: -80.435%
Minimum Δp: -85.143%
RMS Δp    : 14.809 ± 0.435 %
Same top p: 74.461 ± 0.966 %

"""

# llama-perplexity -m float-f32.gguf -f eval.txt -c 512 --chunks 8 -t 2 --kl-divergence-base base.kld
BASE_OUTPUT = """\
0.00.501.232 I perplexity: tokenizing the input ..
0.00.517.401 I perplexity: tokenization took 16.156 ms
0.00.519.472 I perplexity: calculating perplexity over 8 chunks, n_ctx=512, batch_size=2048, n_seq=4
0.21.762.383 I perplexity: 21.20 seconds per pass - ETA 0.70 minutes
[1]14.1212,[2]11.7850,[3]13.2448,[4]13.3297,[5]11.8403,[6]10.8007,[7]10.4563,[8]9.9560,
1.06.427.764 I Final estimate: PPL = 9.9560 +/- 0.57966
"""


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("gguf_vs_llama_quantize", ROOT / "benchmarks" / "gguf_vs_llama_quantize.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_kl_divergence_output_gives_ppl_kld_and_same_top(bench):
    # Mean PPL(Q), not PPL(base) or a chunk's; Mean KLD, not Median/Maximum; 99.9%, not 99.0% or 0.1%
    assert bench.parse_perplexity(KLD_OUTPUT) == {"chunks": 8, "ppl": 12.317134, "kld_mean": 0.277458,
                                                  "kld_p999": 2.758316, "same_top_pct": 74.461}


def test_base_output_gives_the_final_estimate(bench):
    assert bench.parse_perplexity(BASE_OUTPUT) == {"chunks": 8, "ppl": 9.956}


def test_a_truncated_kl_divergence_output_is_an_error(bench):
    cut = KLD_OUTPUT[: KLD_OUTPUT.index("Same top p:")]
    with pytest.raises(ValueError, match="Same top p"):
        bench.parse_perplexity(cut)
    with pytest.raises(ValueError, match="chunk count"):
        bench.parse_perplexity(BASE_OUTPUT.replace("calculating perplexity over 8 chunks", "starting"))


def _row(t: str, method: str, ppl: tuple[float, float], kld: tuple[float, float]) -> dict:
    return {"model": "smollm2", "type": t, "method": method,
            "quality": {c: {"ppl": p, "kld_mean": k} for c, p, k in zip(("pydoc", "stdlib-docs"), ppl, kld)}}


def _holds(checks: list[dict]) -> dict:
    return {(c["type"], c["goal"]): c["holds"] for c in checks}


def test_goals_hold_only_when_better_on_both_corpora(bench):
    rows = [_row("q4_k_m", "llama.cpp", (11.0, 9.0), (0.10, 0.12)),
            _row("q4_k_m", "llama.cpp+imatrix", (10.5, 8.5), (0.08, 0.10)),
            _row("q4_k_m", "qcompile", (10.4, 8.6), (0.07, 0.09))]  # ppl worse on stdlib-docs only
    assert _holds(bench.goal_checks(rows)) == {("q4_k_m", "lower ppl than llama.cpp+imatrix"): False,
                                               ("q4_k_m", "lower mean KLD than llama.cpp+imatrix"): True}
    rows[2] = _row("q4_k_m", "qcompile", (10.4, 8.4), (0.08, 0.09))  # KLD equal on pydoc: not lower
    assert _holds(bench.goal_checks(rows)) == {("q4_k_m", "lower ppl than llama.cpp+imatrix"): True,
                                               ("q4_k_m", "lower mean KLD than llama.cpp+imatrix"): False}


def test_q4_0_needs_half_the_kld_of_llama_cpp_imatrix(bench):
    ref = _row("q4_0", "llama.cpp+imatrix", (12.0, 10.0), (0.20, 0.30))
    half = _holds(bench.goal_checks([ref, _row("q4_0", "qcompile", (11.0, 9.0), (0.10, 0.15))]))
    assert half[("q4_0", "mean KLD <= half of llama.cpp+imatrix's")] is True
    more = _holds(bench.goal_checks([ref, _row("q4_0", "qcompile", (11.0, 9.0), (0.10, 0.16))]))
    assert more[("q4_0", "lower mean KLD than llama.cpp+imatrix")] is True
    assert more[("q4_0", "mean KLD <= half of llama.cpp+imatrix's")] is False
    # other types have no half-KLD goal
    q41 = bench.goal_checks([{**ref, "type": "q4_1"}, _row("q4_1", "qcompile", (11.0, 9.0), (0.19, 0.29))])
    assert [c["goal"] for c in q41] == ["lower ppl than llama.cpp+imatrix", "lower mean KLD than llama.cpp+imatrix"]


def test_a_failed_qcompile_row_fails_its_goals(bench):
    rows = [_row("q4_0", "llama.cpp+imatrix", (12.0, 10.0), (0.20, 0.30)),
            {"model": "smollm2", "type": "q4_0", "method": "qcompile", "error": "RuntimeError: cannot load"}]
    checks = bench.goal_checks(rows)
    assert len(checks) == 3 and not any(c["holds"] for c in checks)


def test_table_keeps_failed_rows_and_missing_figures(bench):
    rows = [{"model": "m", "type": "f32", "method": "float", "size_bytes": 2_000_000,
             "quality": {"pydoc": {"ppl": 9.956}, "stdlib-docs": {"ppl": 11.755}}, "ms_per_token": None},
            {**_row("q4_0", "qcompile", (10.5, 12.5), (0.077, 0.076)), "size_bytes": 1_000_000, "ms_per_token": 6.25},
            {"model": "m", "type": "q4_0", "method": "llama.cpp", "size_bytes": 0, "error": "RuntimeError: x"}]
    lines = bench.table(rows, decode_threads=1).splitlines()
    assert lines[0].endswith("| ms/token (1 threads) |") and len(lines) == 5
    assert lines[2] == "| m | f32 | float | 2.0 | 9.956 | 11.755 | - | - | - | - | - | - | - |"
    assert lines[3].startswith("| smollm2 | q4_0 | qcompile | 1.0 | 10.500 | 12.500 | 0.0770 | 0.0760 |")
    assert lines[3].endswith("| 6.25 |") and lines[4].endswith("ERROR: RuntimeError: x")


def test_steps_reuse_what_exists(bench, tmp_path):
    done = []
    steps = bench.Steps(force=False)
    assert steps("make", [tmp_path / "a"], lambda: (done.append(1), (tmp_path / "a").write_text("")))
    assert not steps("make again", [tmp_path / "a"], done.append, 2)
    assert bench.Steps(force=True)("forced", [tmp_path / "a"], done.append, 3)
    assert done == [1, 3] and steps.seconds["make again"] == "reused"
