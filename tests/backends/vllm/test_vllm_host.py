"""What vLLM's build on this host runs, and the refusal of what it cannot run before vLLM starts.

vLLM's CPU wheel loads one of three builds of its C++ ops by the CPU (``_C``: AVX-512 with BF16,
``_C_AVX512``, ``_C_AVX2``). ``backends.vllm.runtime.vllm_host`` asks vLLM's own environment which
and whether it has the W4A16 op; the build it names is checked against the library vLLM's process
maps, and its FP8 KV cache answer against the choice of vLLM's CPU attention, here and under the
AVX2 test double (``tests/doubles/vllm_avx2_host``: the real vLLM, seeing an AVX2-only CPU).
``host_refusal`` is checked on real INT4, FP8 and FP8-KV exports for each build; ``qcompile serve
--engine vllm`` and ``VllmServer.start`` under the double refuse the INT4 and FP8-KV exports in one
line, before anything starts. One vLLM start under the double (a minute on 2 cores; it runs on
every host, so that AVX-512 hosts test the AVX2 branch of the INT4 tests too) checks the fact the
INT4 refusal rests on: vLLM's AVX2 build itself fails on an INT4 export for want of its W4A16 op
(``cpu_gemm_wna16``). Not skipped without vLLM.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_helpers import (AVX2_DOUBLE, FP8, FP8_KV, INT4, ROOT, VLLM_PYTHON, assert_vllm_refuses_int4, compile_for,
                          save_checkpoint, tiny_server)

from backends.vllm.runtime import VllmHost, VllmHostError, checkpoint_config, host_refusal, vllm_host
from compiler.deploy.lowering import lower

pytestmark = pytest.mark.integration

EXPORTS = {"int4": INT4, "fp8": FP8, "fp8-kv": FP8_KV}
# The builds of vLLM 0.32's CPU wheel as vllm_host describes them (W4A16 op, FP8 KV cache): AVX-512
# with BF16, AVX-512 alone, AVX2 alone; and a GPU build, where these CPU limits do not apply.
HOSTS = {"_C": VllmHost("_C", True, True), "_C_AVX512": VllmHost("_C_AVX512", True, True),
         "_C_AVX2": VllmHost("_C_AVX2", False, False), "gpu": VllmHost(None, True, True)}
REFUSED_ON_AVX2 = {"int4": "INT4 layers, and vLLM's CPU build for this host (_C_AVX2) has no W4A16 kernel",
                   "fp8-kv": "an FP8 KV cache, which vLLM's CPU attention takes only on x86 with AVX-512 or AMX"}
NO_FP8_KV_CACHE = "FP8 KV cache on CPU requires x86 with AVX-512 or AMX."  # vLLM's refusal
# In vLLM's environment: the builds mapped into its process once its CPU platform has loaded its C++ ops as
# at start-up, and whether its CPU attention takes an FP8 KV cache (float16, head size 32, blocks of 32).
VLLMS_OWN_CHOICES = """
import re, torch
from vllm.platforms import current_platform
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
current_platform.import_kernels()
print(sorted(set(re.findall(r"/vllm/(_C(?:_AVX2|_AVX512)?)\\.abi3\\.so", open("/proc/self/maps").read()))))
try:
    print(_get_attn_isa(torch.float16, 32, 32, "fp8_e4m3") and "takes an FP8 KV cache")
except NotImplementedError as e:
    print(e)
"""


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, Path]:
    """A tiny Llama exported for vLLM as each of EXPORTS."""
    if not VLLM_PYTHON.exists():
        pytest.fail(f"vLLM is not installed at {VLLM_PYTHON}; run scripts/setup_vllm.sh (scripts/setup.sh does)")
    root = tmp_path_factory.mktemp("vllm-host")
    checkpoint = save_checkpoint(root, "llama")
    return {name: lower(compile_for(checkpoint, pipeline, root / f"artifact-{name}"), "vllm", root / f"vllm-{name}").path
            for name, pipeline in EXPORTS.items()}


@pytest.mark.parametrize("python", [VLLM_PYTHON, AVX2_DOUBLE], ids=["host", "avx2-double"])
def test_vllm_host_says_what_vllm_itself_chooses(python):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([str(python), "-c", VLLMS_OWN_CHOICES], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    loaded, fp8_kv_cache = done.stdout.strip().splitlines()[-2:]
    host = vllm_host(python)
    assert loaded == str([host.build])
    assert fp8_kv_cache == ("takes an FP8 KV cache" if host.fp8_kv_cache else NO_FP8_KV_CACHE)


def test_the_avx2_double_is_an_avx2_host():
    """The facts the refusals rest on, for vLLM's AVX2 build: no W4A16 op, no FP8 KV cache."""
    assert vllm_host(AVX2_DOUBLE) == HOSTS["_C_AVX2"]


@pytest.mark.parametrize("host", list(HOSTS))
@pytest.mark.parametrize("name", list(EXPORTS))
def test_host_refusal_names_what_the_build_cannot_run(exported, name, host):
    why = host_refusal(checkpoint_config(exported[name]), HOSTS[host])
    if host == "_C_AVX2" and name in REFUSED_ON_AVX2:
        assert why and why.startswith(REFUSED_ON_AVX2[name]) and "qcompile's engine" in why, why
    else:
        assert why is None, why


@pytest.mark.parametrize("name", list(REFUSED_ON_AVX2))
def test_qcompile_serve_refuses_what_vllms_avx2_build_cannot_run_before_it_starts(exported, name, tmp_path):
    log = tmp_path / "vllm.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "QCOMPILE_VLLM_PYTHON": str(AVX2_DOUBLE)}
    done = subprocess.run([sys.executable, "-m", "qcompile", "serve", str(exported[name]), "--engine", "vllm",
                           "--log-file", str(log)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert done.returncode == 2 and done.stdout == "", done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and re.match(rf"error: {re.escape(str(exported[name]))}: {re.escape(REFUSED_ON_AVX2[name])}", lines[0]), lines
    assert not log.exists(), "vLLM was started"


@pytest.mark.parametrize("name", list(REFUSED_ON_AVX2))
def test_vllm_server_start_refuses_it_too(exported, name, tmp_path):
    server = tiny_server(exported[name], tmp_path / "vllm.log", python=AVX2_DOUBLE)
    try:
        with pytest.raises(VllmHostError, match=re.escape(REFUSED_ON_AVX2[name])):
            server.start()
    finally:
        server.stop()  # where the check failed to refuse, vLLM is running
    assert server.process is None and not (tmp_path / "vllm.log").exists()


def test_vllms_avx2_build_itself_fails_on_int4_for_want_of_its_w4a16_op(exported, tmp_path):
    assert_vllm_refuses_int4(exported["int4"], tmp_path / "vllm.log", python=AVX2_DOUBLE)
