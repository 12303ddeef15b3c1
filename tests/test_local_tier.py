"""Failures without lost work: the local checkpoint tier, elastic restarts and goodput.

Real processes are killed (SIGKILL) and their files broken; every run must end with the losses
of a run that was never interrupted: bit for bit on the same mesh, to fp32 reduction order on
another one. `tools.goodput` reads what the runs recorded.
"""
import glob
import json
import os
import pathlib
import random
import shutil
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from test_multihost import MODEL_ARGS, ROOT, assert_ok, run_processes, start_processes
from test_reliability import _env, assert_same_tail, start, train

from conftest import losses, tiny_config
from tools import goodput
from trainer.checkpoint import local_layout, local_tier
from trainer.run.loop import Run
from trainer.tracking.goodput import process_start_time


def local(directory, every=1):
  return [f"--config.checkpoint.local_dir={directory}",
          f"--config.checkpoint.local_every_steps={every}", "--config.checkpoint.every_steps=6"]


def pdir(root, process=0):
  """A process's directory of the one run whose local steps are under `root` (its id is drawn
  at the run's first start: `<root>/<run id>/process_<i>`)."""
  found = glob.glob(os.path.join(root, "*", f"process_{process}"))
  return pathlib.Path(found[0] if found else os.path.join(root, "none", f"process_{process}"))


def local_steps(root, process=0):
  d = pdir(root, process)
  return sorted(int(n) for n in os.listdir(d) if n.isdigit()) if os.path.isdir(d) else []


def kill_when(proc, condition, timeout=180):
  """SIGKILL `proc` as soon as `condition()` holds (polled every 2 ms)."""
  deadline = time.time() + timeout
  while not condition():
    assert proc.poll() is None and time.time() < deadline, "the run ended before the moment came"
    time.sleep(0.002)
  proc.kill()
  proc.wait()


def saved_after(path, t0):
  try:
    return os.path.getmtime(path) > t0
  except OSError:  # deleted meanwhile (the tier keeps local_keep steps)
    return False


def resumed_from(stdout):
  """(where, tier) of the "resumed from" line."""
  line = next(l for l in stdout.splitlines() if l.startswith("resumed from"))
  return line.split()[2], "local" if line.endswith("(local tier)") else "persistent"


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  """The uninterrupted 18-step run (8 devices), with both tiers."""
  workdir = tmp_path_factory.mktemp("straight")
  train(workdir, 18, *local(tmp_path_factory.mktemp("straight_local")))
  return losses(workdir)


# --- the local tier under SIGKILL ------------------------------------------------------------


@pytest.mark.slow  # the default run keeps test_reliability's kill during an async save
def test_sigkill_during_a_local_save_resumes_from_the_previous_local_step(straight, tmp_path):
  """Kill while a local save is being written: the interrupted step does not count, its
  temporary directory is gone after the restart, and the run resumes from the local tier."""
  root = tmp_path / "local"
  proc = start(tmp_path / "w", 12, *local(root))
  tmp = lambda: [p for p in glob.glob(str(pdir(root) / "*.orbax-checkpoint-tmp*"))
                 if int(os.path.basename(p).split(".")[0]) > 7]  # after the persistent step 6
  kill_when(proc, lambda: bool(tmp()))
  interrupted = int(os.path.basename(tmp()[0]).split(".")[0])
  assert interrupted not in local_steps(root)
  done = train(tmp_path / "w", 12, *local(root))
  where, tier = resumed_from(done.stdout)
  assert (tier, where.rsplit("/", 1)[1]) == ("local", str(interrupted - 1)), done.stdout
  assert not glob.glob(str(pdir(root) / "*tmp*")), "interrupted saves are cleaned up"
  assert_same_tail(losses(tmp_path / "w"), straight, 1)
  report = goodput.account(goodput.read_events(str(tmp_path / "w" / "goodput.jsonl")))
  assert report["restarts"] == 1 and report["finished"]
  assert [s["tier"] for s in report["starts"]] == [None, "local"]
  assert report["starts"][0]["ended"] == "killed (no stop event)"
  assert 0 < report["goodput"] < 1 and report["steps_redone"] >= 0


@pytest.mark.slow
def test_sigkill_at_three_random_moments(straight, tmp_path):
  """Three hard kills at random steps, each after a few local saves: every restart resumes from
  the local tier (the persistent tier saves every 6 steps) and the run ends on the straight
  run's losses; the goodput report counts 3 restarts and the steps they redid."""
  rng = random.Random()
  seed = rng.randrange(10**6)
  rng.seed(seed)
  root, workdir = tmp_path / "local", tmp_path / "w"
  moments = sorted(rng.sample(range(3, 11), 3))
  for k in moments:
    t0 = time.time()
    proc = start(workdir, 12, *local(root))
    # A step >= k that this start saved: an earlier start's step >= k (two moments in a row)
    # would have it killed before it recorded anything, and goodput would count one start less.
    kill_when(proc, lambda: any(s >= k and saved_after(pdir(root) / str(s), t0)
                                for s in local_steps(root)))
  done = train(workdir, 12, *local(root))
  assert resumed_from(done.stdout)[1] == "local", (seed, moments, done.stdout)
  assert_same_tail(losses(workdir), straight, 1)
  proc = subprocess.run([sys.executable, "-m", "tools.goodput", str(workdir), "--json"],
                        cwd=ROOT, capture_output=True, text=True, env=_env(), timeout=60)
  report = json.loads(proc.stdout)
  assert report["restarts"] == 3 and report["finished"], (seed, moments, report)
  assert report["step"] == 12


# --- broken local copies ---------------------------------------------------------------------


def corrupt(step_dir):
  """Truncate the largest array file of a local step's `state` item."""
  files = [p for p in glob.glob(os.path.join(step_dir, "state", "**"), recursive=True)
           if os.path.isfile(p)]
  open(max(files, key=os.path.getsize), "w").close()


@pytest.mark.slow
def test_corrupted_local_copies_fall_back_to_the_previous_step_then_the_persistent_tier(
    straight, tmp_path):
  """Truncate the newest local step's largest array file: the restart names the unreadable copy
  and takes the previous local step. Later, both local steps broken: it takes the persistent
  step. Both end on the straight run's losses."""
  root, workdir = tmp_path / "local", tmp_path / "w"
  proc = start(workdir, 12, *local(root))
  kill_when(proc, lambda: len([s for s in local_steps(root) if s > 6]) >= 2)
  newest = local_steps(root)[-1]
  corrupt(pdir(root) / str(newest))
  done = train(workdir, 12, *local(root))
  assert f"local checkpoint {newest} cannot be restored (process_0/state is damaged" in \
      done.stdout, done.stdout
  assert resumed_from(done.stdout) == (f"{pdir(root).parent}/process_*/{newest - 1}", "local"), \
      done.stdout
  proc = start(workdir, 18, *local(root))
  kill_when(proc, lambda: len([s for s in local_steps(root) if s > 12]) >= 2)
  for step in local_steps(root):
    corrupt(pdir(root) / str(step))
  done = train(workdir, 18, *local(root))
  assert resumed_from(done.stdout) == (f"{workdir}/checkpoints/12", "persistent"), done.stdout
  assert_same_tail(losses(workdir), straight, 1, last=18)


# --- two processes ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("case", ["one node, dir lost", "one node, own copy corrupted",
                                  "two nodes, dir lost"])
def test_one_of_two_processes_killed_and_its_local_copy_lost(tmp_path, case):
  """Two processes (gloo) whose parameters are sharded across them (fsdp=4 spans both), saving
  locally every step. Process 1 is killed once both saved step 5 locally (the launcher then
  stops process 0, as a job whose process died is), and its local copy is lost: its directory
  deleted, or its newest step's state truncated. On one node (one local_dir) process 1 reads its
  shards from the peer copy in process 0's directory; on two nodes (a directory each, neither
  sees the other's) process 0 reads the peer copy and sends it over the interconnect. Either
  way the run resumes from the local tier and ends on the losses of an uninterrupted
  two-process run, bit for bit."""
  args = MODEL_ARGS + ["--config.mesh.data=1", "--config.mesh.fsdp=4", "--config.mesh.tensor=2",
                       "--config.steps=8", "--config.checkpoint.every_steps=100",
                       "--config.checkpoint.local_every_steps=1"]
  root = tmp_path / "local"
  node = (lambda i: root) if case.startswith("one node") else (lambda i: root / f"node{i}")
  per_process = [[f"--config.checkpoint.local_dir={node(i)}"] for i in range(2)]
  assert_ok(run_processes(tmp_path / "straight", 2, args, per_process_args=[
      [f"--config.checkpoint.local_dir={tmp_path / 's' / str(i)}"] for i in range(2)]))
  procs = start_processes(tmp_path / "w", 2, args, per_process)
  deadline = time.time() + 300
  while not all(5 in local_steps(node(i), i) for i in range(2)):
    assert time.time() < deadline and all(p.poll() is None for p in procs)
    time.sleep(0.01)
  for p in procs[::-1]:
    p.kill()
    p.wait()
  if case.endswith("dir lost"):
    shutil.rmtree(pdir(node(1), 1))
  else:
    newest = max(set(local_steps(node(0), 0)) & set(local_steps(node(1), 1)))
    corrupt(pdir(node(1), 1) / str(newest))
  results = run_processes(tmp_path / "w", 2, args, per_process_args=per_process)
  assert_ok(results)
  out = results[0][1]
  where, tier = resumed_from(out)
  assert tier == "local" and int(where.rsplit("/", 1)[1]) >= 5, out
  if case.startswith("two nodes"):
    assert "peer copies over the interconnect" in out, out
  else:
    assert "process 1: process_0/peer" in out, out
  if case.endswith("corrupted"):
    assert f"local checkpoint {newest}: process_1/state is damaged" in out, out
  got, want = losses(tmp_path / "w"), losses(tmp_path / "straight")
  assert [got[s] for s in range(1, 9)] == [want[s] for s in range(1, 9)]


@pytest.mark.slow  # two processes: the default run keeps test_multihost's two-process resume and
# this file's one-process local-tier tests
def test_a_local_write_error_on_one_process_leaves_no_process_out_of_the_peer_copy(tmp_path):
  """Process 1's write of local step 3 fails (Orbax reports it at the next check, as it reports
  a background write error). That error used to be raised on process 1 alone just before the
  next local save's peer copy, a collective: process 1 skipped it, process 0 waited in it for
  good. Now it is said in one line by process 1, every process enters every peer copy, and the
  run ends."""
  args = MODEL_ARGS + ["--config.mesh.data=1", "--config.mesh.fsdp=4", "--config.mesh.tensor=2",
                       "--config.steps=6", "--config.checkpoint.every_steps=100",
                       "--config.checkpoint.local_every_steps=1",
                       f"--config.checkpoint.local_dir={tmp_path / 'local'}"]
  results = run_processes(tmp_path / "w", 2, args, timeout=240,
                          script="tests/inject_local_failure.py",
                          SCALETRAIN_TEST_LOCAL_FAILURE="1:3")
  assert_ok(results)
  err = results[1][2]
  failed = [l for l in err.splitlines() if "not written" in l]
  assert len(failed) == 1 and failed[0].startswith(
      "process 1: local checkpoint at step 3 not written (OSError: [Errno 5] injected"), err
  assert "process 1: local checkpoint at step 5 written again" in err, err
  assert "not written" not in results[0][2], results[0][2]
  assert max(losses(tmp_path / "w")) == 6


# --- elastic -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_restart_on_fewer_devices_from_the_local_tier(straight, tmp_path):
  """Killed on 8 devices after local step 7; restarted on 4 (data=2 x tensor=2): the local step
  is read onto the new mesh, the global batch is kept (said in one line), and the losses follow
  the straight run to fp32 reduction order."""
  root, workdir = tmp_path / "local", tmp_path / "w"
  proc = start(workdir, 12, *local(root))
  kill_when(proc, lambda: 7 in local_steps(root))
  done = train(workdir, 12, *local(root), "--config.mesh.data=2", "--config.mesh.tensor=2",
               devices=4)
  where, tier = resumed_from(done.stdout)
  assert tier == "local" and int(where.rsplit("/", 1)[1]) >= 7
  assert "global batch 8 kept, 1 micro-batch(es) of 8 per step (data.on_resize=keep)" in \
      done.stdout, done.stdout
  got = losses(workdir)
  np.testing.assert_allclose([got[s] for s in range(1, 13)], [straight[s] for s in range(1, 13)],
                             rtol=1e-5)


def test_rescale_scales_the_batch_with_the_devices(tmp_path):
  """data.on_resize=rescale, 8 -> 4 devices after step 2: batch 8 -> 4 from step 3, the learning
  rate re-derived by the sqrt rule, the data position continued (windows 16 + 4 per step) and
  the batch history saved, so a later restart on the same devices keeps batch 4, whatever
  data.global_batch_size says, with the hyperparameters still stated at the first start's batch
  (reference_batch_size=0 used to move the reference to the restart's config batch)."""
  args = ["--config.data.on_resize=rescale", "--config.optim.lr_rule=sqrt",
          "--config.optim.warmup_steps=4", "--config.checkpoint.every_steps=2"]
  train(tmp_path, 2, *args)
  out = train(tmp_path, 4, *args, "--config.mesh.data=4", devices=4).stdout
  assert "batch 8 -> 4 sequences from step 3 (data.on_resize=rescale, data-parallel 8 -> 4), " \
         "1 micro-batch(es) of 4 per step; hyperparameters re-derived at batch 4 by " \
         "optim.lr_rule=sqrt" in out, out
  assert "hyperparameters at batch 4 (reference 8, x0.5): lr 0.003 -> 0.002121 (sqrt)" in out
  rows = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  steps = {r["step"]: r for r in rows if "loss" in r}
  assert [steps[s].get("batch_size") for s in (3, 4)] == [4, 4]
  np.testing.assert_allclose(steps[4]["learning_rate"], 3e-3 * np.sqrt(0.5) * 3 / 4, rtol=1e-6)
  data = json.load(open(tmp_path / "checkpoints" / "4" / "data" / "process_0-of-1.json"))
  topology = json.load(open(tmp_path / "checkpoints" / "4" / "topology" / "metadata"))
  assert data["windows"] == 2 * 8 + 2 * 4
  assert topology["stages"] == [[0, 8], [2, 4]] and topology["data_parallel"] == 4
  out = train(tmp_path, 5, *args, "--config.mesh.data=4", "--config.data.global_batch_size=12",
              devices=4).stdout
  assert "batch 4 -> " not in out and "batch 8 -> " not in out
  assert "global batch 4 from the checkpoint (data.on_resize=rescale; data.global_batch_size=12 " \
         "sets a fresh run's); hyperparameters stay stated at batch 8" in out, out
  assert "hyperparameters at batch 4 (reference 8, x0.5): lr 0.003 -> 0.002121 (sqrt)" in out
  assert json.load(open(tmp_path / "checkpoints" / "5" / "data" / "process_0-of-1.json")
                   )["windows"] == 2 * 8 + 3 * 4


@pytest.mark.slow
def test_rescale_onto_a_device_count_the_config_batch_does_not_divide(tmp_path):
  """8 -> 3 devices with data.on_resize=rescale: the run will use batch 8 x 3 / 8 = 3, which
  divides; it was refused because the config's batch 8 does not ("not divisible by the
  data-parallel size 3"). No batch rule is set, and the line says the hyperparameters stay
  (it said "re-derived"). Following the old advice, data.global_batch_size=9, keeps the batch of
  the checkpoint and the reference batch of the first start (it moved the reference to 9)."""
  args = ["--config.data.on_resize=rescale", "--config.checkpoint.every_steps=1"]
  train(tmp_path, 2, *args)
  out = train(tmp_path, 3, *args, devices=3).stdout
  assert "batch 8 -> 3 sequences from step 3 (data.on_resize=rescale, data-parallel 8 -> 3), " \
         "1 micro-batch(es) of 3 per step; hyperparameters unchanged at batch 3: no batch rule " \
         "is set (optim.lr_rule=none" in out, out
  assert "hyperparameters at batch 3 (reference 8, x0.375): lr 0.003" in out, out
  out = train(tmp_path, 4, *args, "--config.data.global_batch_size=9", devices=3).stdout
  assert "global batch 3 from the checkpoint (data.on_resize=rescale; " \
         "data.global_batch_size=9 sets a fresh run's)" in out, out
  assert "hyperparameters stay stated at batch 8, the run's first start's" in out, out
  assert "hyperparameters at batch 3 (reference 8, x0.375)" in out, out
  rows = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  assert [r["batch_size"] for r in rows if "loss" in r and r["step"] > 2] == [3, 3]


# --- in process: what is kept, the disk, the decisions ----------------------------------------


def test_local_tier_keeps_the_last_steps_and_skips_a_save_that_would_fill_the_disk(
    tmp_path, monkeypatch, capsys):
  cfg = tiny_config(**{"steps": 6, "checkpoint.local_dir": str(tmp_path / "local"),
                       "checkpoint.local_every_steps": 1, "checkpoint.local_keep": 2,
                       "checkpoint.every_steps": 3})
  assert Run(cfg, str(tmp_path / "w")).train().status == "done"
  assert local_steps(tmp_path / "local") == [4, 5], "3 and 6 were persistent saves"
  events = goodput.read_events(str(tmp_path / "w" / "goodput.jsonl"))
  saves = [(e["step"], e["tier"]) for e in events if e["event"] == "checkpoint"]
  assert saves == [(1, "local"), (2, "local"), (3, "persistent"), (4, "local"), (5, "local"),
                   (6, "persistent"), (6, "wait")]
  # A disk with 1 MiB free of 100 MiB: every local save is skipped (said once), training goes on.
  usage = shutil.disk_usage(tmp_path)
  monkeypatch.setattr(local_tier.shutil, "disk_usage",
                      lambda p: type(usage)(100 * 2**20, 99 * 2**20, 2**20))
  capsys.readouterr()
  cfg.steps = 10
  assert Run(cfg, str(tmp_path / "w")).train().status == "done"
  err = capsys.readouterr().err
  skipped = [l for l in err.splitlines() if "not written" in l]
  assert len(skipped) == 2 and "would leave less than 5% of the disk" in skipped[0], err
  assert skipped[1] == ("local checkpoints failed from step 7 on: 2 local save(s) not written, "
                        "the last because " + skipped[0].split("not written (")[1].split(");")[0])
  assert local_steps(tmp_path / "local") == [4, 5]


def test_a_disk_that_holds_only_local_keep_steps_keeps_saving(tmp_path, monkeypatch, capsys):
  """The issue's small tmpfs: room for local_keep=2 steps, not for a third beside them. Each
  save deletes the oldest step it would retire anyway, first (said once), and the tier saves
  to the end (it stopped after step 2 without a word: the old step went only after a success)."""
  cfg = tiny_config(**{"steps": 10, "checkpoint.local_dir": str(tmp_path / "local"),
                       "checkpoint.local_every_steps": 1, "checkpoint.local_keep": 2})
  sizes = []  # what a save needs (the tier's own estimate)
  save = local_tier.LocalTier.save
  monkeypatch.setattr(local_tier.LocalTier, "save",
                      lambda self, *a, **k: sizes.append(save(self, *a, **k)) or sizes[-1])
  probe = tiny_config(**{"steps": 2, "checkpoint.local_dir": str(tmp_path / "probe"),
                         "checkpoint.local_every_steps": 1})
  probe.checkpoint.every_steps = 0
  Run(probe, str(tmp_path / "probe_w")).train()
  on_disk = local_tier.checkpoint_bytes(str(tmp_path / "probe"))
  # A disk whose free space is what the local dir leaves of its capacity (reserve included).
  capacity = (1.5 * on_disk + sizes[0]) / (1 - local_tier.RESERVE) if sizes else 0
  usage = shutil.disk_usage(tmp_path)
  monkeypatch.setattr(local_tier.shutil, "disk_usage", lambda p: type(usage)(
      int(capacity), 0, int(capacity - local_tier.checkpoint_bytes(str(tmp_path / "local")))))
  capsys.readouterr()
  assert Run(cfg, str(tmp_path / "w")).train().status == "done"
  out, err = capsys.readouterr()
  assert "not written" not in err, err
  made_room = [l for l in out.splitlines() if "first to make room" in l]
  assert len(made_room) == 1 and made_room[0].startswith(
      "local checkpoint at step 3: deleted local step(s) 1 first to make room"), out
  assert local_steps(tmp_path / "local") == [8, 9]


def test_the_decider_saves_locally_between_persistent_saves():
  from trainer.run.decisions import Decider, StopSignals  # noqa: PLC0415
  cfg = tiny_config(**{"steps": 12, "checkpoint.every_steps": 6,
                       "checkpoint.local_every_steps": 2, "checkpoint.local_dir": "/x"})
  decider = Decider(cfg, StopSignals(), start=0, evaluating=False)
  local = [s for s in range(1, 13) if decider.after(s).local_save]
  persistent = [s for s in range(1, 13) if decider.after(s).save]
  assert local == [2, 4, 8, 10] and persistent == [6, 12]
  assert all(decider.after(s).read for s in local)


def test_what_a_local_step_must_cover():
  box = ((0, 4), (0, 8))
  assert local_layout.covered([box], [((0, 2), (0, 8)), ((2, 4), (0, 8))])
  assert not local_layout.covered([box], [((0, 2), (0, 8))])
  assert local_layout.covered([((1, 3), (2, 5))], [((0, 4), (0, 8))])
  assert local_layout.covered([()], [()])  # a scalar
  mesh = jax.make_mesh((8,), ("data",))
  assert local_layout.next_process_mesh(mesh) is None  # one process: no peer


@pytest.mark.parametrize("override,needle", [
    ("--config.checkpoint.local_every_steps=5", "needs checkpoint.local_dir"),
    ("--config.checkpoint.local_dir=/tmp/x", "needs checkpoint.local_every_steps"),
    ("--config.data.on_resize=grow", "data.on_resize='grow': choose one of keep, rescale"),
])
def test_local_tier_and_resize_keys_are_checked(tmp_path, capsys, override, needle):
  import train as train_py  # noqa: PLC0415
  code = train_py.main(["--config", "configs/lm_tiny.py", "--workdir", str(tmp_path), override])
  err = capsys.readouterr().err
  assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err


def test_rescale_with_a_batch_ramp_is_refused(tmp_path, capsys):
  import train as train_py  # noqa: PLC0415
  code = train_py.main(["--config", "configs/lm_tiny.py", "--workdir", str(tmp_path),
                        "--config.data.on_resize=rescale", "--config.data.micro_batch_size=8",
                        "--config.data.batch_ramp=8:0,16:100000"])
  assert code == 2 and "the ramp (or the autopilot) decides the batch" in capsys.readouterr().err


# --- goodput -----------------------------------------------------------------------------------


def test_goodput_accounts_for_every_second():
  """Two starts: the first is killed after recording steps 1-10, the second resumes from step 6
  (steps 7-10 are redone) and finishes."""
  ev = lambda t, kind, **f: {"event": kind, "time": t, **f}
  events = [
      ev(100, "start", process_start=95), ev(101, "restore", seconds=0.5, step=None, tier=None),
      ev(104, "compile", seconds=3.0), ev(104.5, "first_step", step=1),
      ev(106, "steps", first=1, last=5, seconds=2.0,
                                          data_wait=0.5),
      ev(107, "checkpoint", seconds=0.5, step=5, tier="local"),
      ev(109, "steps", first=6, last=10, seconds=2.0, data_wait=0.0),
      ev(120, "start", process_start=115), ev(122, "restore", seconds=1.0, step=6, tier="local"),
      ev(125, "compile", seconds=2.0), ev(126, "eval", seconds=0.5, step=6),
      ev(130, "steps", first=7, last=12, seconds=3.0, data_wait=0.0),
      ev(131, "stop", status="done", step=12, message=""),
  ]
  r = goodput.account(events)
  s = r["seconds"]
  assert r["wall_seconds"] == 36 and r["restarts"] == 1 and r["finished"]
  assert r["steps_redone"] == 4
  assert s["redone"] == pytest.approx(2.0 * 4 / 5)
  assert s["productive"] == pytest.approx(1.5 + 2.0 / 5 + 3.0)
  assert s["data"] == 0.5 and s["compile"] == 5.0 and s["restore"] == 1.5
  assert s["checkpoint"] == 0.5 and s["evaluation"] == 0.5
  assert s["startup"] == 10 and s["down"] == 115 - 109
  assert sum(s.values()) == pytest.approx(36)
  assert r["goodput"] == pytest.approx(s["productive"] / 36)
  assert [x["ended"] for x in r["starts"]] == ["killed (no stop event)", "done"]
  assert [x["to_first_step"] for x in r["starts"]] == [9.5, None]
  text = goodput.describe(r)
  assert text.startswith("goodput 13.6% of 36.0 s wall time, 1 restart(s), up to step 12")
  assert "redone" in text and "(4 steps)" in text
  assert "start 1: fresh; first step 9.5 s after its process started; ended: killed" in text


def test_goodput_command_prints_text_and_json_and_refuses_a_workdir_without_events(
    tmp_path, capsys):
  ev = lambda t, kind, **f: {"event": kind, "time": t, **f}
  events = [ev(10, "start", process_start=9), ev(11, "restore", seconds=0.0, step=None, tier=None),
            ev(12, "compile", seconds=1.0), ev(14, "steps", first=1, last=4, seconds=2.0,
                                                  data_wait=0.0),
            ev(15, "stop", status="done", step=4, message="")]
  (tmp_path / "goodput.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
  assert goodput.main([str(tmp_path), "--json"]) == 0
  report = json.loads(capsys.readouterr().out)
  assert report["step"] == 4 and report["restarts"] == 0 and report["finished"]
  assert report["goodput"] == pytest.approx(2.0 / 6) and report["wall_seconds"] == 6
  assert goodput.main([str(tmp_path)]) == 0
  assert capsys.readouterr().out.startswith("goodput 33.3% of 6.0 s wall time, 0 restart(s)")
  assert goodput.main([str(tmp_path / "nothing")]) == 2
  assert "goodput.jsonl does not exist" in capsys.readouterr().err


def test_goodput_tells_a_running_start_from_a_killed_one(tmp_path, capsys):
  """The last start has no stop event: while its process runs it is "still running"; once the
  process is gone the time since its last record is down time, not other."""
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait()
  ev = lambda t, kind, **f: {"event": kind, "time": t, **f}
  events = lambda pid, began: [
      ev(100, "start", process_start=began, pid=pid, host=socket.gethostname()),
      ev(101, "restore", seconds=0.5, step=None, tier=None), ev(102, "compile", seconds=1.0),
      ev(110, "steps", first=1, last=5, seconds=8.0, data_wait=0.0)]
  killed = goodput.account(events(dead.pid, 95), now=140)
  assert killed["starts"][0]["ended"] == "killed (no stop event)" and not killed["running"]
  assert killed["seconds"]["down"] == 30 and killed["seconds"]["other"] == pytest.approx(0.5)
  me = os.getpid()
  running = goodput.account(events(me, process_start_time()), now=140)
  assert running["starts"][0]["ended"] == "still running" and running["running"]
  assert running["seconds"]["down"] == 0
  assert "still running" in goodput.describe(running)
  elsewhere = goodput.account([dict(e, host="another-host") for e in events(me, 95)], now=140)
  assert elsewhere["starts"][0]["ended"].startswith("no stop event (running or killed: on host "
                                                    "another-host")
  assert elsewhere["seconds"]["down"] == 30


@pytest.mark.parametrize("text,needle", [
    ('[1, 2]\n', "line 1 is not a goodput event ('[1, 2]')"),
    ('{"event": "start", "time": "noon"}\n', "line 1 is not a goodput event"),
    ('{"event": "start", "time": 1}\n{"event": "steps", "time": 2}\n', "lacks 'seconds'"),
    ('{"event": "start", "time": 1, "process_start": "x"}\n', "a field of the wrong type"),
])
def test_goodput_on_a_malformed_file_is_one_line(tmp_path, capsys, text, needle):
  (tmp_path / "goodput.jsonl").write_text(text)
  assert goodput.main([str(tmp_path)]) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("error: ") and needle in err and "\n" not in err, err
