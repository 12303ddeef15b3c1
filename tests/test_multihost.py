"""Several processes: start-up from config/environment, agreement checks, and a real two-process
run on CPU (gloo collectives, 4 devices per process) that equals one process with 8 devices and
resumes from its own checkpoint; DiLoCo with a replica per process."""
import inspect
import json
import os
import socket
import subprocess
import sys

import ml_collections
import numpy as np
import pytest

import train
from conftest import CACHE_DIR, losses
from trainer.config import default_config
from trainer.multihost import agreement, launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "lm_tiny.py")
# The tiny test model (conftest.tiny_config) as train.py overrides, on a mesh whose every axis
# crosses devices: data=2 splits the two processes, fsdp and tensor live inside each.
MODEL_ARGS = [
    "--config.model.d_model=32", "--config.model.mlp_dim=64",
    "--config.data.global_batch_size=8", "--config.data.seq_len=32", "--config.data.prefetch=0",
    "--config.optim.learning_rate=1e-2", "--config.optim.warmup_steps=2",
    "--config.optim.decay_steps=50", "--config.log_every=1", "--config.eval_every=0",
    "--config.checkpoint.every_steps=2", "--config.trainer.progress_bar=false",
    "--config.trainer.peak_flops_per_device=1e9", f"--config.trainer.compile_cache_dir={CACHE_DIR}",
    "--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.mesh.tensor=2",
]


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def child_env(devices: int, **extra) -> dict:
  """The test process's environment for a child with `devices` CPU devices of its own.

  conftest forces 8 host devices through XLA_FLAGS; a process of a multi-process run sets its
  count with jax_num_cpu_devices instead (both at once conflict), so that flag is stripped."""
  env = dict(os.environ)
  flags = [f for f in env.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  env.update(XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(devices),
             JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo", **extra)
  for key in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    if key not in extra:
      env.pop(key, None)
  return env


def start_processes(workdir, processes: int, args=(), per_process_args=None,
                    script="train.py", **env_extra):
  """Start train.py (or `script`, a train.py wrapper) as `processes` processes of one run (8 CPU
  devices split between them, `env_extra` in their environment); their Popen objects (output
  piped)."""
  port = free_port()
  procs = []
  for pid in range(processes):
    env = child_env(8 // processes, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                    JAX_NUM_PROCESSES=str(processes), JAX_PROCESS_ID=str(pid), **env_extra)
    extra = list(per_process_args[pid]) if per_process_args else []
    procs.append(subprocess.Popen(
        [sys.executable, script, "--config", TINY, "--workdir", str(workdir), *args, *extra],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
  return procs


def run_processes(workdir, processes: int, args=(), per_process_args=None, timeout=300,
                  **start):
  """Run train.py as `processes` processes of one run; [(returncode, stdout, stderr)]."""
  procs = start_processes(workdir, processes, args, per_process_args, **start)
  out = []
  try:
    for p in procs:
      stdout, stderr = p.communicate(timeout=timeout)
      out.append((p.returncode, stdout, stderr))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  return out


def assert_ok(results) -> None:
  for code, stdout, stderr in results:
    assert code == 0, stdout[-2000:] + stderr[-3000:]


def run_single(workdir, args) -> subprocess.CompletedProcess:
  """train.py as one process with the test's 8 devices; it must succeed."""
  proc = subprocess.run(
      [sys.executable, "train.py", "--config", TINY, "--workdir", str(workdir), *args],
      cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  return proc


def launch_beside_reference(workdir, reference_workdir, args, reference_args):
  """Launch 2 processes x 4 devices (`args`) while one process with the test's 8 devices runs
  `reference_args` in `reference_workdir`; both must succeed. -> the 2 processes' results."""
  reference = subprocess.Popen(
      [sys.executable, "train.py", "--config", TINY, "--workdir", str(reference_workdir),
       *reference_args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    results = run_processes(workdir, 2, args)
    ref_out, ref_err = reference.communicate(timeout=300)
  finally:
    if reference.poll() is None:
      reference.kill()
  assert reference.returncode == 0, ref_out[-2000:] + ref_err[-2000:]
  assert_ok(results)
  return results


# ----------------------------------------------------------------------------------------------
# Where the processes come from


def dist_cfg(**values) -> ml_collections.ConfigDict:
  c = default_config().distributed
  c.update(values)
  return c


SLURM = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "node[01-02]", "SLURM_PROCID": "1",
         "SLURM_LOCALID": "0"}


@pytest.mark.parametrize("values,environ,expected", [
    ({}, {}, None),  # nothing says "several": one process, nothing to initialise
    ({"coordinator_address": "10.0.0.1:1234", "num_processes": 2, "process_id": 1}, {},
     ("10.0.0.1:1234", 2, 1, "config")),
    ({}, {"JAX_COORDINATOR_ADDRESS": "h:9", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"},
     ("h:9", 4, 3, "environment")),
    ({"process_id": 0}, {"JAX_COORDINATOR_ADDRESS": "h:9", "JAX_NUM_PROCESSES": "4",
                         "JAX_PROCESS_ID": "3"},
     ("h:9", 4, 0, "config and environment")),  # a config value beats its variable
    ({}, {"JAX_NUM_PROCESSES": "1"}, None),
    ({}, {**SLURM, "SLURM_NTASKS": "2"}, (None, 2, None, "SLURM")),  # jax reads the rest
    ({}, {**SLURM, "SLURM_NTASKS": "1"}, None),  # srun -n1: one process
    ({}, {"OMPI_MCA_orte_hnp_uri": "1.0;tcp://10.0.0.1:5", "OMPI_COMM_WORLD_SIZE": "8"},
     (None, 8, None, "Open MPI")),
    ({}, {"TPU_WORKER_HOSTNAMES": "w0,w1,w2,w3"}, (None, 4, None, "Cloud TPU (GKE)")),
    ({"mode": "off"}, {**SLURM, "SLURM_NTASKS": "2"}, None),
])
def test_resolve_detection_order(values, environ, expected):
  launch_ = launch.resolve(dist_cfg(**values), environ)
  if expected is None:
    assert launch_ is None
  else:
    assert (launch_.coordinator_address, launch_.num_processes, launch_.process_id,
            launch_.source) == expected


@pytest.mark.parametrize("environ,vendors,expected", [
    ({}, {"0x1ae0"}, (None, None, None, "Cloud TPU VM")),  # jax asks the metadata server
    ({"JAX_PLATFORMS": "cpu"}, {"0x1ae0"}, None),  # TPUs left out: one process
    ({}, {"0x8086"}, None),  # no Google TPU on the PCI bus
])
def test_resolve_on_a_tpu_vm_leaves_the_count_to_jax(environ, vendors, expected, monkeypatch):
  monkeypatch.setattr(launch.platforms, "pci_vendors", lambda: vendors)
  monkeypatch.setattr(launch, "libtpu_available", lambda: True)
  launch_ = launch.resolve(dist_cfg(), environ)
  if expected is None:
    assert launch_ is None
  else:
    assert (launch_.coordinator_address, launch_.num_processes, launch_.process_id,
            launch_.source) == expected


def test_only_public_jax_apis():
  """Start-up, the agreement check and the AOT tool use jax's public APIs (jax.distributed,
  jax.experimental.{multihost_utils,mesh_utils,topologies}), never jax._src."""
  from tools import aot  # noqa: PLC0415
  from tools import targets  # noqa: PLC0415
  for module in (launch, agreement, aot, targets):
    assert "jax._src" not in inspect.getsource(module), module.__name__


def test_resolve_partial_values_without_a_cluster_is_an_error():
  with pytest.raises(launch.DistributedError, match="but not coordinator_address"):
    launch.resolve(dist_cfg(num_processes=2, process_id=0), {})
  with pytest.raises(launch.DistributedError, match="JAX_PROCESS_ID='x': expected an int"):
    launch.resolve(dist_cfg(), {"JAX_PROCESS_ID": "x"})


@pytest.mark.parametrize("args,needle", [
    (["--config.distributed.coordinator_address=nohost"], "expected host:port"),
    (["--config.distributed.num_processes=2", "--config.distributed.process_id=2"],
     "distributed.process_id=2 must be below distributed.num_processes=2"),
    (["--config.distributed.mode=maybe"], "choose one of auto, on, off"),
])
def test_bad_distributed_block_is_one_line_exit_2(args, needle, tmp_path, capsys):
  code = train.main(["--config", TINY, "--workdir", str(tmp_path / "w")] + args)
  err = capsys.readouterr().err
  assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err


# ----------------------------------------------------------------------------------------------
# Agreement


def test_disagreement_names_the_first_difference():
  base = {"config": {"optim": {"learning_rate": 1e-3}, "steps": 6}, "workdir": "/w", "code": "a",
          "devices": {"local_count": 4}}
  same = json.loads(json.dumps(base))
  other = json.loads(json.dumps(base))
  other["devices"]["local_count"] = 2
  assert agreement.describe_disagreement([base, same]) is None
  message = agreement.describe_disagreement([base, same, other])
  assert "process 0 has devices.local_count=4, process 2 has 2" in message
  assert "same number and kind of devices" in message
  other = json.loads(json.dumps(base))
  other["config"]["optim"]["learning_rate"] = 2e-3
  assert "process 0 has optim.learning_rate=0.001, process 1 has 0.002" in (
      agreement.describe_disagreement([base, other]))


def test_processes_that_disagree_fail_fast_instead_of_hanging(tmp_path):
  """Different overrides on two processes: both stop before compiling, same one line, exit 2."""
  results = run_processes(tmp_path / "w", 2, MODEL_ARGS,
                   per_process_args=[["--config.optim.learning_rate=1e-2"],
                                     ["--config.optim.learning_rate=2e-2"]], timeout=120)
  needle = "process 0 has optim.learning_rate=0.01, process 1 has 0.02"
  for code, _, stderr in results:
    assert code == 2 and needle in stderr, stderr[-2000:]
  assert not os.path.exists(tmp_path / "w"), "nothing may be written"


def test_missing_process_times_out_naming_the_coordinator(tmp_path):
  port = free_port()
  proc = subprocess.run(
      [sys.executable, "train.py", "--config", TINY, "--workdir", str(tmp_path / "w"),
       f"--config.distributed.coordinator_address=127.0.0.1:{port}",
       "--config.distributed.num_processes=2", "--config.distributed.process_id=1",
       "--config.distributed.initialization_timeout=2"],
      cwd=ROOT, env=child_env(4), capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2, proc.stderr[-2000:]
  lines = proc.stderr.strip().splitlines()
  assert f"coordinator at 127.0.0.1:{port}" in lines[-1], proc.stderr[-2000:]
  assert "process 1 of 2" in lines[-1]


# ----------------------------------------------------------------------------------------------
# The real thing


def test_two_processes_equal_one_and_resume(tmp_path):
  """2 processes x 4 CPU devices in micro-batches of 4 == 1 process x 8 devices without
  accumulation, step for step, through a resume, and on through a restore by a single process
  (the data state moves between process counts and micro-batch sizes)."""
  multi, single = tmp_path / "multi", tmp_path / "single"
  micro = ["--config.data.micro_batch_size=4"]
  first = launch_beside_reference(multi, single, MODEL_ARGS + micro + ["--config.steps=4"],
                                  MODEL_ARGS + ["--config.steps=8"])
  # Only process 0 writes metrics and talks; every process wrote its data-iterator state.
  assert "step 4:" in first[0][1] and "step" not in first[1][1]
  for step in (2, 4):
    data = sorted(os.listdir(multi / "checkpoints" / str(step) / "data"))
    assert {"process_0-of-2.json", "process_1-of-2.json"} <= set(data), data

  resumed = run_processes(multi, 2, MODEL_ARGS + micro + ["--config.steps=6"])
  assert_ok(resumed)
  assert "resumed from" in resumed[0][1] and "checkpoints/4" in resumed[0][1]

  # One process (8 devices) continues the 2-process run from its step-6 checkpoint.
  alone = run_single(multi, MODEL_ARGS + ["--config.steps=8"])
  assert "checkpoints/6" in alone.stdout

  got, want = losses(multi), losses(single)
  assert sorted(got) == sorted(want) == list(range(1, 9))
  np.testing.assert_allclose([got[s] for s in range(1, 9)], [want[s] for s in range(1, 9)],
                             rtol=1e-5)


@pytest.mark.slow  # two real processes; the default run keeps test_two_processes_equal_one_and_resume
def test_batch_rows_replicated_across_processes(tmp_path):
  """A mesh whose `tensor` axis spans the two processes (data=fsdp=1, tensor=2, sequence=4):
  every batch row lives on both processes, so each reads all of them, and the run equals one
  process with 8 devices on the same mesh."""
  mesh = ["--config.mesh.data=1", "--config.mesh.fsdp=1", "--config.mesh.tensor=2",
          "--config.mesh.sequence=4", "--config.steps=3", "--config.checkpoint.every_steps=0"]
  args = MODEL_ARGS + mesh  # later overrides win
  results = launch_beside_reference(tmp_path / "multi", tmp_path / "single", args, args)
  assert "mesh stage=1 data=1 fsdp=1 tensor=2 sequence=4" in results[0][1]
  got, want = losses(tmp_path / "multi"), losses(tmp_path / "single")
  assert sorted(got) == sorted(want) == [1, 2, 3]
  np.testing.assert_allclose([got[s] for s in got], [want[s] for s in got], rtol=1e-6)


@pytest.mark.slow
def test_diloco_replicas_on_separate_processes(tmp_path):
  """DiLoCo with M = 2 replicas on 2 processes x 4 devices: each replica is one process's
  devices (the replica axis is outermost), the inner step has no collective between them (read
  from the compiled program), and the run equals one process with 8 devices step for step,
  through two outer steps and an evaluation of the anchor."""
  args = MODEL_ARGS + ["--config.optim.diloco.replicas=2", "--config.optim.diloco.inner_steps=2",
                       "--config.mesh.data=1", "--config.steps=4", "--config.eval_every=4",
                       "--config.data.global_batch_size=16"]
  results = launch_beside_reference(tmp_path / "multi", tmp_path / "single", args, args)
  out = results[0][1]
  assert "replica 0 on process(es) 0; replica 1 on process(es) 1" in out, out[-3000:]
  assert "inner step 0 B (no collective joins two replicas)" in out, out[-3000:]
  got, want = losses(tmp_path / "multi"), losses(tmp_path / "single")
  assert sorted(got) == sorted(want) == [1, 2, 3, 4]
  np.testing.assert_allclose([got[s] for s in got], [want[s] for s in got], rtol=1e-5)
  evals = lambda w: [json.loads(line)["eval_loss"] for line in open(w / "metrics.jsonl")
                     if "eval_loss" in line]
  np.testing.assert_allclose(evals(tmp_path / "multi"), evals(tmp_path / "single"), rtol=1e-5)
