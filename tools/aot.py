"""Ahead-of-time compile of the real train step for hardware this machine does not have.

    python -m tools.aot --config configs/lm_1b.py --topology v5e:4x4
    python -m tools.aot --config configs/lm_8b.py --topology v5:4x4x4 --config.mesh.fsdp=-1
    python -m tools.aot --config configs/lm_125m.py --topology v5e:2x2 --config.mesh.dcn_data=2

The program compiled is the one `train.py` runs: the same `trainer.program.Program` (model,
logical->mesh rules, optimizer, micro-batching, donated state) on the mesh `sharding.make_mesh`
builds from the config, as in training, but over the devices of a TPU topology description made
by libtpu's compiler on this CPU machine (`jax.experimental.topologies`; install with
`pip install -e ".[tpu]"`). Multi-slice: the target has as many slices as the config's
`mesh.dcn_*` sizes multiply to (the last example: two v5e:2x2 slices, data across them).
On TPU the attention is jax's splash attention (a Mosaic kernel) when `model.attention` is
`auto` or `flash`, so a kernel that does not lower for TPU fails here, before anyone pays for a
slice.

It prints, per device (= chip): argument memory (train state + batch), temporaries, outputs not
aliased to the donated inputs, and their sum against the chip's HBM; the step's FLOPs (the
model's own count, `models.llama.flops_per_token`: XLA's `cost_analysis()` counts a scanned layer
once and Pallas kernels not at all, so its number is shown for information only); and the step
time at 100% MFU on the chip's bf16 peak, a lower bound, with the bound that rematerialisation
puts on MFU; and the roofline: the step cannot be faster than its executed FLOPs (the model's
plus what rematerialisation recomputes) at the chip's bf16 peak, nor than its HBM traffic at
the chip's bandwidth (`trainer.metrics.HBM_BANDWIDTH`). The traffic is XLA's `bytes accessed`,
which, like its FLOPs, counts the body of a loop (the scanned layers, the micro-batch loop) once:
the memory time printed is therefore a floor, and so is the bound, max(compute, memory), from
which the MFU ceiling follows (model FLOPs / (bound x chips x peak)). Because that floor can be
far below the real traffic of a scanned model, an estimate is printed beside it: the bytes scaled
by how much XLA undercounted the FLOPs it sees (executed FLOPs outside compiled kernels / XLA's
FLOPs), which assumes the loop bodies move as many bytes per FLOP as the rest of the program
(an estimate, not a bound). Compare configs with these before paying for hardware. A program that does not fit fails with one line naming the knob to
turn (exit 2).

Topologies: `v4:2x2x1`, `v5:2x2x1` (v5p), `v5e:2x2`, `v6e:4x4`, ... (libtpu's names: chip
version, then chips along each axis; v4 and v5p run one megacore device per chip, as on real
hardware). Quirks handled here: JAX_PLATFORMS=cpu (we compile, never run), and
ALLOW_MULTIPLE_LIBTPU_LOAD=1 so that several compiles can run at once.
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before jax is imported: this tool never runs a step
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # several libtpu users at once

import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from models.attention import resolve_impl  # noqa: E402
from models.llama import flops_per_token, param_counts  # noqa: E402
from sharding.mesh import DCN_AXES, data_parallel_size, make_mesh, num_slices  # noqa: E402
from trainer.cli import CliParser, load  # noqa: E402
from trainer.config import ConfigError, validate  # noqa: E402
from trainer.distributed import libtpu_available  # noqa: E402
from trainer.metrics import (  # noqa: E402
    GiB,
    known_hbm_bandwidth,
    known_hbm_bytes,
    known_peak_flops,
)
from trainer.program import Program  # noqa: E402

EXIT_USER_ERROR = 2
TOPOLOGY_RE = re.compile(r"^(v\d+[a-z]*):(\d+(?:x\d+)+)$")
MEGACORE = ("v4", "v5", "v5p")  # chips whose two TensorCores JAX drives as one device
# Custom calls that mark a compiled Pallas kernel: Mosaic on TPU, Triton on GPU.
KERNEL_CALLS = ("tpu_custom_call", "__gpu$xla.gpu.triton")


class AotError(Exception):
  """A user error (topology, config, a program that does not fit): one line, exit code 2."""


class LibtpuMissing(AotError):
  """libtpu is not installed: nothing can be compiled for TPU here."""


# ----------------------------------------------------------------------------------------------
# Targets


@dataclasses.dataclass
class Target:
  name: str  # as given, e.g. "v5e:2x2" ("2x v5e:2x2" for two slices)
  devices: list

  @property
  def slices(self) -> int:
    return num_slices(self.devices)

  @property
  def kind(self) -> str:
    return self.devices[0].device_kind

  @property
  def platform(self) -> str:
    return self.devices[0].platform

  @property
  def hosts(self) -> int:
    return len({d.process_index for d in self.devices})

  @property
  def hbm_bytes(self) -> float | None:
    return known_hbm_bytes(self.kind)

  @property
  def peak_flops(self) -> float | None:
    return known_peak_flops(self.kind)

  @property
  def hbm_bandwidth(self) -> float | None:
    return known_hbm_bandwidth(self.kind)


@contextlib.contextmanager
def _quiet_libtpu():
  """libtpu looks for a TPU VM's worker list and accelerator type when it loads and logs a
  screenful when it finds none; tell it about a one-host VM for the duration of the load."""
  keys = {"TPU_ACCELERATOR_TYPE": "v5litepod-1", "TPU_WORKER_HOSTNAMES": "localhost"}
  saved = {k: os.environ.get(k) for k in keys}
  for k, v in keys.items():
    os.environ.setdefault(k, v)
  try:
    yield
  finally:
    for k, v in saved.items():
      if v is None:
        os.environ.pop(k, None)


def tpu_target(topology: str, slices: int = 1) -> Target:
  """Compile-only devices of a TPU topology (`v5e:2x2`, `v4:2x2x1`, ...), `slices` of them."""
  match = TOPOLOGY_RE.match(topology)
  if not match:
    raise AotError(f"--topology {topology!r}: expected CHIP:AxB[xC], e.g. v5e:2x2, v4:2x2x1, "
                   "v5:2x2x1 (v5p), v6e:4x4; or h100:8, h100:2x8 (hosts x GPUs)")
  if not libtpu_available():
    raise LibtpuMissing("libtpu is not installed, so nothing can be compiled for TPU here: "
                        "pip install -e \".[tpu]\" (jax pins the libtpu it accepts)")
  # Compile-only devices through jax's public jax.experimental.topologies (no private API).
  from jax.experimental import topologies  # noqa: PLC0415
  chip = match.group(1)
  kwargs = {"chip_config_name": "megacore"} if chip in MEGACORE else {}
  if slices > 1:
    kwargs["num_slices"] = slices
  try:
    with _quiet_libtpu():
      desc = topologies.get_topology_desc(topology, "tpu", **kwargs)
  except Exception as e:  # noqa: BLE001  libtpu's own words are the best explanation
    raise AotError(f"--topology {topology!r}: libtpu cannot describe it ({_first_line(e)})") \
        from None
  name = topology if slices == 1 else f"{slices}x {topology}"
  return Target(name, list(desc.devices))


# GPU targets: XLA's GpuTargetConfigProto (what a GPU's StreamExecutor would report), written
# from NVIDIA's public H100 SXM5 numbers (132 SMs, 80 GiB HBM3 at 3.35 TB/s, 50 MiB L2, sm_90).
GPU_TARGETS = {
    "h100": """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132
  fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: 3352320000000 l2_cache_size: 52428800
  clock_rate_ghz: 1.755 device_memory_size: 84929347584 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 minor: 0 }
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 3 }
runtime_version { major: 12 minor: 8 }
device_description_str: "NVIDIA H100 80GB HBM3"
""",
}
GPU_TOPOLOGY_RE = re.compile(r"^(h100):(?:(\d+)x)?(\d+)$")


def gpu_target(topology: str) -> Target:
  """Compile-only devices of `hosts` x `gpus` H100s: `h100:8` (one node), `h100:4x8`.

  Needs jax's CUDA plugin (`pip install jax-cuda12-plugin==<jax version>`; no GPU or driver is
  needed to compile) and `ptxas` on the PATH."""
  match = GPU_TOPOLOGY_RE.match(topology)
  hosts, per_host = int(match.group(2) or 1), int(match.group(3))
  from jax.experimental import topologies  # noqa: PLC0415
  try:
    desc = topologies.get_topology_desc(
        match.group(1), "cuda", target_config=GPU_TARGETS[match.group(1)],
        topology=f"1x{hosts}x{per_host}")
  except (NotImplementedError, RuntimeError) as e:
    raise AotError(f"--topology {topology!r}: jax's CUDA plugin cannot describe it "
                   f"({_first_line(e)}); pip install jax-cuda12-plugin=={jax.__version__}") \
        from None
  return Target(topology, list(desc.devices))


def config_slices(mesh_cfg) -> int:
  """How many slices the config's mesh spans: the product of its `mesh.dcn_*` sizes."""
  dcn = {key: int(mesh_cfg[key]) for key in DCN_AXES}
  unknown = [key for key, size in dcn.items() if size == -1]
  if unknown:
    raise AotError(f"mesh.{unknown[0]}=-1: an ahead-of-time compile has no slices to count; "
                   f"give the number of slices, e.g. --config.mesh.{unknown[0]}=2")
  return math.prod(dcn.values())


def make_target(topology: str, slices: int = 1) -> Target:
  """A TPU topology (`v5e:2x2`, ...), `slices` of them; or a GPU one (`h100:8`, `h100:2x8`)."""
  if GPU_TOPOLOGY_RE.match(topology):
    if slices != 1:
      raise AotError(f"mesh.dcn_* multiply to {slices} slices, which is for TPU topologies; "
                     "for several GPU hosts use h100:HOSTSxGPUS with the dcn_* sizes at 1")
    return gpu_target(topology)
  return tpu_target(topology, slices)


# ----------------------------------------------------------------------------------------------
# The report


@dataclasses.dataclass
class Report:
  config: str
  topology: str
  chips: int
  hosts: int
  device_kind: str
  mesh: dict
  attention: str
  kernel_calls: int  # compiled Pallas kernels (Mosaic / Triton custom calls) in the program
  params: int
  compile_seconds: float
  argument_bytes: int  # per device: state + batch
  state_bytes: int  # per device: the train state alone
  temp_bytes: int
  output_bytes: int  # outputs not aliased to (donated) inputs
  code_bytes: int
  hbm_bytes: float | None
  model_flops: float  # per optimizer step, all chips (models.llama.flops_per_token)
  xla_flops: float | None  # per chip, as cost_analysis() counts them (information only)
  xla_bytes: float | None  # per chip, cost_analysis()'s "bytes accessed" (loop bodies once)
  peak_flops: float | None  # per chip, bf16
  hbm_bandwidth: float | None  # per chip, bytes/s
  tokens_per_step: int
  remat_mfu_bound: float  # MFU ceiling from recomputation alone
  kernel_flops: float = 0.0  # per step, all chips: model FLOPs inside compiled kernels (attention)

  @property
  def total_bytes(self) -> int:
    return self.argument_bytes + self.temp_bytes + self.output_bytes + self.code_bytes

  @property
  def step_seconds(self) -> float | None:
    """Step time at 100% MFU: a lower bound."""
    if not self.peak_flops:
      return None
    return self.model_flops / (self.chips * self.peak_flops)

  @property
  def compute_seconds(self) -> float | None:
    """Executed FLOPs (model + recomputation) at the bf16 peak of every chip."""
    if not self.peak_flops:
      return None
    return self.model_flops / self.remat_mfu_bound / (self.chips * self.peak_flops)

  @property
  def memory_seconds(self) -> float | None:
    """A chip's HBM traffic at its bandwidth; a floor (XLA counts loop bodies once)."""
    if not self.hbm_bandwidth or not self.xla_bytes:
      return None
    return self.xla_bytes / self.hbm_bandwidth

  @property
  def roofline_seconds(self) -> float | None:
    """The roofline lower bound on the step time: max(compute, memory)."""
    times = [t for t in (self.compute_seconds, self.memory_seconds) if t]
    return max(times) if self.compute_seconds else None

  @property
  def roofline_mfu(self) -> float | None:
    """The highest MFU the step can reach: model FLOPs over the bound at the chips' peak."""
    bound = self.roofline_seconds
    return self.model_flops / (bound * self.chips * self.peak_flops) if bound else None

  @property
  def estimated_bytes(self) -> float | None:
    """XLA's bytes accessed scaled by its FLOP undercount (see the module docstring)."""
    if not self.xla_bytes or not self.xla_flops:
      return None
    visible = (self.model_flops / self.remat_mfu_bound - self.kernel_flops) / self.chips
    return self.xla_bytes * max(visible / self.xla_flops, 1.0)

  def estimate_line(self) -> str | None:
    if not self.estimated_bytes or not self.hbm_bandwidth or not self.compute_seconds:
      return None
    memory = self.estimated_bytes / self.hbm_bandwidth
    step = max(memory, self.compute_seconds)
    mfu = self.model_flops / (step * self.chips * self.peak_flops)
    return (f"  estimate with loop bodies scaled ({self.estimated_bytes / self.xla_bytes:.1f}x, "
            f"XLA's FLOP undercount): memory {memory * 1e3:,.1f} ms "
            f"({self.estimated_bytes / 1e9:,.0f} GB per chip) -> step ~{step * 1e3:,.1f} ms, "
            f"MFU ~{mfu:.0%} (not a bound)")

  def roofline_line(self) -> str:
    if not self.roofline_seconds:
      return f"  roofline: no peak FLOP/s known for {self.device_kind}"
    ms = lambda t: f"{t * 1e3:,.1f} ms"
    if self.memory_seconds:
      memory = (f"memory {ms(self.memory_seconds)} ({self.xla_bytes / 1e9:,.1f} GB per chip at "
                f"{self.hbm_bandwidth / 1e9:,.0f} GB/s; XLA's bytes accessed, loop bodies once: "
                "a floor)")
    else:
      memory = (f"memory unknown (no HBM bandwidth known for {self.device_kind})"
                if self.xla_bytes else "memory unknown (XLA reported no bytes accessed)")
    bound = "memory" if self.roofline_seconds > self.compute_seconds else "compute"
    return (f"  roofline: compute {ms(self.compute_seconds)} (executed FLOPs at "
            f"{self.peak_flops / 1e12:.0f} TFLOP/s bf16 per chip), {memory} -> step >= "
            f"{ms(self.roofline_seconds)} ({bound}-bound), MFU <= {self.roofline_mfu:.0%}, "
            f"<= {self.tokens_per_step / self.roofline_seconds:,.0f} tokens/s")

  def lines(self) -> list[str]:
    gib = lambda b: f"{b / GiB:.2f} GiB"
    mesh = " ".join(f"{k}={v}" for k, v in self.mesh.items() if v > 1) or "1 device"
    hbm = (f" of {gib(self.hbm_bytes)} HBM ({self.total_bytes / self.hbm_bytes:.0%})"
           if self.hbm_bytes else " (HBM of this chip unknown)")
    out = [
        f"{self.config} on {self.topology}: {self.chips} x {self.device_kind}, {self.hosts} "
        f"host(s); mesh {mesh}; {_count(self.params)} params; attention {self.attention}"
        f" ({self.kernel_calls} compiled kernel calls); compiled in {self.compile_seconds:.1f}s",
        f"  memory per chip: arguments {gib(self.argument_bytes)} (train state "
        f"{gib(self.state_bytes)}) + temporaries {gib(self.temp_bytes)} + outputs "
        f"{gib(self.output_bytes)} + code {gib(self.code_bytes)} = {gib(self.total_bytes)}{hbm}",
        f"  FLOPs per step: model {self.model_flops:.3e} ({self.tokens_per_step:,} tokens)"
        + (f"; XLA's cost analysis {self.xla_flops:.3e} per chip (scan bodies once, Pallas "
           "kernels not at all: for information)" if self.xla_flops else ""),
    ]
    if self.attention in ("flash", "splash") and not self.kernel_calls:
      out.append(f"  note: no compiled {self.attention} kernel in the program: it was lowered in "
                 "interpret mode (the kernel chose that from this machine's backend, not the "
                 "target's), so the kernel itself was not compiled for the target")
    if self.step_seconds:
      out.append(
          f"  step time at 100% MFU ({self.peak_flops / 1e12:.0f} TFLOP/s bf16 per chip): "
          f"{self.step_seconds * 1e3:,.1f} ms, {self.tokens_per_step / self.step_seconds:,.0f} "
          f"tokens/s; rematerialisation caps MFU at {self.remat_mfu_bound:.0%}, so expect "
          f">= {self.step_seconds / self.remat_mfu_bound * 1e3:,.1f} ms")
    out.append(self.roofline_line())
    if self.estimate_line():
      out.append(self.estimate_line())
    return out

  def markdown_row(self) -> str:
    mesh = " ".join(f"{k}={v}" for k, v in self.mesh.items() if v > 1) or "-"
    step = (f"{self.step_seconds * 1e3:,.0f} ms" if self.step_seconds else "?")
    hbm = f" / {self.hbm_bytes / GiB:.0f}" if self.hbm_bytes else ""
    return (f"| {self.config} | {_count(self.params)} | {self.topology} ({self.chips} x "
            f"{self.device_kind}) | {mesh} | {self.total_bytes / GiB:.1f}{hbm} GiB | {step} | "
            f"{self.remat_mfu_bound:.0%} |")

  def to_json(self) -> dict:
    d = dataclasses.asdict(self)
    d.update(total_bytes=self.total_bytes, step_seconds=self.step_seconds,
             compute_seconds=self.compute_seconds, memory_seconds=self.memory_seconds,
             roofline_seconds=self.roofline_seconds, roofline_mfu=self.roofline_mfu,
             estimated_bytes=self.estimated_bytes)
    return d


def _count(n: float) -> str:
  if n >= 1e9:
    return f"{n / 1e9:.1f}B"
  return f"{n / 1e6:.0f}M" if n >= 1e7 else f"{n / 1e6:.2f}M"


def remat_mfu_bound(model_cfg, seq_len: int) -> float:
  """Model FLOPs / FLOPs executed when the remat policy recomputes part of the forward pass.

  `full` recomputes each block's forward (matmuls and attention) in the backward pass;
  `dots_no_batch` recomputes the attention matmuls (they have a batch dimension); `dots` and
  `none` recompute no matmul. Kernels recompute inside themselves too (flash attention's
  backward), which this does not count: it is a ceiling, not a prediction."""
  parts = flops_per_token(model_cfg, seq_len)
  head = 6.0 * model_cfg.d_model * model_cfg.vocab_size
  block_forward = (parts["matmuls"] - head) / 3 + parts["attention"] / 3
  extra = {"full": block_forward, "dots_no_batch": parts["attention"] / 3}.get(
      model_cfg.remat, 0.0)
  return parts["total"] / (parts["total"] + extra)


def _per_device_bytes(tree) -> int:
  total = 0
  for leaf in jax.tree.leaves(tree):
    shape = leaf.sharding.shard_shape(leaf.shape)
    total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
  return total


def _first_line(e: BaseException) -> str:
  lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
  return lines[0][:300] if lines else type(e).__name__


def is_out_of_memory(e: BaseException) -> bool:
  text = str(e)
  return "RESOURCE_EXHAUSTED" in text or "Ran out of memory" in text or "out of memory" in text


def oom_advice(cfg, sizes: dict, target: Target, state_bytes: int) -> str:
  """Which knob to turn, judged from what takes the memory."""
  hbm = target.hbm_bytes
  n = len(target.devices)
  if hbm and state_bytes > 0.6 * hbm:
    fsdp_hint = ("" if sizes["fsdp"] == n else
                 f"mesh.fsdp=-1 (now {sizes['fsdp']}) to shard it over all {n} chips, or ")
    return (f"the train state alone is {state_bytes / GiB:.1f} GiB per chip: {fsdp_hint}"
            "a topology with more chips")
  knobs = []
  if cfg.model.remat != "full":
    knobs.append(f"model.remat=full (now {cfg.model.remat!r}) to recompute activations")
  micro = cfg.data.micro_batch_size or cfg.data.global_batch_size
  dp = data_parallel_size(sizes)
  if micro // dp > 1:
    half = micro // 2
    while half % dp:
      half -= 1
    if half >= dp and cfg.data.global_batch_size % half == 0:
      knobs.append(f"data.micro_batch_size={half} (now {micro}; {micro // dp} sequences per chip "
                   "per micro-batch) for fewer activations at the same global batch")
  local_seq = cfg.data.seq_len // sizes["sequence"]
  if local_seq >= 4096 and n % (2 * sizes["sequence"]) == 0:
    knobs.append(f"mesh.sequence={2 * sizes['sequence']} (now {sizes['sequence']}; "
                 f"{local_seq} tokens of each sequence per chip) to split long sequences "
                 "further (ring attention)")
  if not knobs:
    knobs.append("a topology with more chips (the activations of one sequence per chip do not "
                 "fit)")
  return "activations take the memory (train state is only " \
         f"{state_bytes / GiB:.1f} GiB per chip): turn " + ", or ".join(knobs)


@contextlib.contextmanager
def _no_persistent_cache():
  """Keep target executables out of JAX's persistent cache: this machine could not load them
  (and reading one back fails noisily), and a later CPU run must not find them."""
  # Whether the cache is used is decided once per process, so in a process that already uses
  # it (tests) the entry is kept out by making no compile slow enough to be written.
  before = (jax.config.jax_enable_compilation_cache,
            jax.config.jax_persistent_cache_min_compile_time_secs)
  jax.config.update("jax_enable_compilation_cache", False)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 1e9)
  try:
    yield
  finally:
    jax.config.update("jax_enable_compilation_cache", before[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", before[1])


def target_mesh(cfg, target: Target, config_name: str = "config") -> tuple[dict, Mesh]:
  """The config validated against the target's devices (as train.py validates against its
  own), and the mesh training builds on them: `sharding.make_mesh`, the one mesh builder."""
  try:
    return validate(cfg, target.devices), make_mesh(cfg.mesh, target.devices)
  except ConfigError as e:
    raise AotError(f"{config_name} on {target.name}: {e}") from None


def compile_report(cfg, target: Target, config_name: str = "config") -> Report:
  """Compile the train step of `cfg` for `target`; raise AotError with advice if it fails."""
  sizes, mesh = target_mesh(cfg, target, config_name)
  program = Program(cfg, mesh)
  # Abstract arguments are made outside the mesh context: under a mesh of compile-only devices
  # even creating an abstract optimizer state would try to run on them.
  state = program.abstract_state()
  batch = program.abstract_batch()
  state_bytes = _per_device_bytes(state)
  t0 = time.perf_counter()
  try:
    with jax.set_mesh(mesh), _no_persistent_cache():
      attention = resolve_impl(cfg.model.attention, mesh.abstract_mesh, dtype=cfg.model.dtype,
                               head_dim=program.model_cfg.dim_per_head,
                               seq_len=cfg.data.seq_len)
      compiled = program.jitted_step().lower(state, batch).compile()
  except Exception as e:  # noqa: BLE001
    if not is_out_of_memory(e):
      raise
    hbm = (f", {target.hbm_bytes / GiB:.0f} GiB HBM per chip" if target.hbm_bytes else "")
    raise AotError(
        f"{config_name} does not fit {target.name} ({len(target.devices)} x {target.kind}{hbm}): "
        f"the compiler says \"{_first_line(e)}\"; "
        f"{oom_advice(cfg, sizes, target, state_bytes)}") from None
  seconds = time.perf_counter() - t0
  report = _report(cfg, target, config_name, program, mesh, attention, compiled, seconds,
                   state_bytes)
  if report.hbm_bytes and report.total_bytes > report.hbm_bytes:
    # The compiler accepted it, but its own numbers say it cannot be resident at once.
    raise AotError(
        f"{config_name} does not fit {target.name} ({report.chips} x {target.kind}, "
        f"{report.hbm_bytes / GiB:.0f} GiB HBM per chip): the compiled step needs "
        f"{report.total_bytes / GiB:.1f} GiB per chip (temporaries "
        f"{report.temp_bytes / GiB:.1f} GiB); {oom_advice(cfg, sizes, target, state_bytes)}")
  return report


def _report(cfg, target, config_name, program, mesh, attention, compiled, seconds,
            state_bytes) -> Report:
  mem = compiled.memory_analysis()
  get = lambda name: int(getattr(mem, name, 0) or 0) if mem is not None else 0
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) and cost else cost
  xla_flops = float(cost.get("flops", 0.0)) if isinstance(cost, dict) else None
  xla_bytes = float(cost.get("bytes accessed", 0.0)) if isinstance(cost, dict) else None
  text = compiled.as_text() or ""
  kernel_calls = sum(text.count(f'custom_call_target="{name}"') for name in KERNEL_CALLS)
  model_cfg = program.model_cfg
  seq = cfg.data.seq_len
  tokens = cfg.data.global_batch_size * seq
  # Attention FLOPs (forward, backward and what `full` remat recomputes) run inside the kernel
  # when one is compiled: XLA's cost analysis does not see them.
  kernel_flops = flops_per_token(model_cfg, seq)["attention"] * tokens
  kernel_flops *= (4 / 3 if model_cfg.remat in ("full", "dots_no_batch") else 1
                   ) if kernel_calls else 0
  return Report(
      config=config_name, topology=target.name, chips=len(target.devices), hosts=target.hosts,
      device_kind=target.kind, mesh=dict(mesh.shape), attention=attention,
      kernel_calls=kernel_calls, params=param_counts(model_cfg)["total"],
      compile_seconds=seconds,
      argument_bytes=get("argument_size_in_bytes"), state_bytes=state_bytes,
      temp_bytes=get("temp_size_in_bytes"),
      output_bytes=max(get("output_size_in_bytes") - get("alias_size_in_bytes"), 0),
      code_bytes=get("generated_code_size_in_bytes"), hbm_bytes=target.hbm_bytes,
      model_flops=flops_per_token(model_cfg, seq)["total"] * tokens, xla_flops=xla_flops,
      xla_bytes=xla_bytes or None, peak_flops=target.peak_flops,
      hbm_bandwidth=target.hbm_bandwidth, tokens_per_step=tokens,
      remat_mfu_bound=remat_mfu_bound(model_cfg, seq), kernel_flops=kernel_flops)


# ----------------------------------------------------------------------------------------------
# Command line


def parse_args(argv: list[str]):
  """(options, config overrides); a mistake is a one-line ConfigError."""
  parser = CliParser("-m tools.aot", __doc__)
  parser.add_argument("--topology", required=True, help="e.g. v5e:2x2, v4:2x2x1, v6e:4x4")
  parser.add_argument("--json", default="", help="also write the report to this JSON file")
  parser.add_argument("--markdown", action="store_true", help="print a README table row too")
  return parser.parse(argv)


def main(argv: list[str]) -> int:
  try:
    args, overrides = parse_args(argv)
    name = os.path.splitext(os.path.basename(args.config))[0]
    cfg = load(args.config, overrides)
    target = make_target(args.topology, config_slices(cfg.mesh))
    report = compile_report(cfg, target, name)
  except (ConfigError, AotError) as e:
    print(f"error: {e}", file=sys.stderr)
    return EXIT_USER_ERROR
  print("\n".join(report.lines()))
  if args.markdown:
    print(report.markdown_row())
  if args.json:
    with open(args.json, "w") as f:
      json.dump(report.to_json(), f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
