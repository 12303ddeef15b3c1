"""Input pipeline throughput against the train step's consumption, for a config on this machine.

    python bench/pipeline.py --config configs/lm_125m.py [--devices 8] [--steps 20]
    python bench/pipeline.py --config configs/lm_125m.py --step-tokens-per-s 400000

Times the data path a run takes for every step, alone (this process's rows, read at random
positions of the token files, and their assembly into the global arrays on the mesh; `--devices
N` fakes N CPU devices), and counts what the reads cost: document pieces per window, bytes read
and 4 KiB pages touched per trained token. Then measures the train step's tokens/s for the same
model on this machine (at a smaller batch, `--step-batch`), or takes `--step-tokens-per-s`, and
prints both rates, their ratio and the target: at least 20x what the step consumes.
What is timed and why: docs/performance.md#input-pipeline
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data.prepare import prepare_files  # noqa: E402
from trainer.config import ConfigError  # noqa: E402
from trainer.config.cli import CliParser, load_from_cli  # noqa: E402
from trainer.multihost import platforms  # noqa: E402

TARGET_RATIO = 20.0


def _devices_from_argv(argv: list[str]) -> int:
  for i, a in enumerate(argv):
    if a == "--devices" and i + 1 < len(argv):
      return int(argv[i + 1])
    if a.startswith("--devices="):
      return int(a.split("=", 1)[1])
  return 0


def synthetic_corpus(out_dir: str, doc_tokens: int, documents: int = 4000) -> str:
  """A prepared (byte-tokenized) directory of random-letter documents of about `doc_tokens`
  tokens: web-text-like document lengths, where a row stream packs several per sequence."""


  rng = np.random.default_rng(0)
  letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz     ", dtype=np.uint8)
  os.makedirs(out_dir + "-src")
  src = os.path.join(out_dir + "-src", "docs.jsonl")
  with open(src, "w") as f:
    for n in rng.integers(max(1, doc_tokens // 2), doc_tokens * 3 // 2 + 1, size=documents):
      f.write(json.dumps({"text": rng.choice(letters, size=int(n) - 2).tobytes().decode()}) + "\n")
  return prepare_files(out_dir, [src])


PAGE = 4096


def read_cost(run, steps: int) -> dict:
  """What reading `steps` steps of the run's windows costs, counted from the token slices it
  reads: pieces per window, bytes read and 4 KiB pages touched per trained token."""
  from data import pipeline  # noqa: PLC0415  start-up
  windows = pipeline.Windows(run.feed.spec)
  count = steps * run.cfg.data.global_batch_size
  pieces = windows.pieces(range(count))
  nbytes = sum(p.nbytes for row in pieces for p in row)
  pages = 0
  for row in pieces:
    touched = set()
    for p in row:
      address = p.__array_interface__["data"][0]
      touched.update(range(address // PAGE, (address + max(p.nbytes, 1) - 1) // PAGE + 1))
    pages += len(touched)
  trained = count * run.cfg.data.seq_len
  return {"pieces": sum(map(len, pieces)) / count, "bytes": nbytes / trained,
          "page_bytes": pages * PAGE / trained}


def time_pipeline(run, steps: int, warmup: int = 2) -> dict:
  """Seconds per step of the pipeline alone: drawing a step's micro-batches (`host`) and
  assembling the global arrays on the devices (`assemble`); medians over `steps` steps."""
  import jax  # noqa: PLC0415  start-up

  from data import pipeline  # noqa: PLC0415  start-up
  it = iter(pipeline.dataset(run.feed.spec))
  host, assemble, total = [], [], []
  for i in range(steps + warmup):
    t0 = time.perf_counter()
    micro = [next(it) for _ in range(run.program.num_micro)]
    t1 = time.perf_counter()
    jax.block_until_ready(run.feed.global_batch(micro))
    t2 = time.perf_counter()
    if i >= warmup:
      host.append(t1 - t0)
      assemble.append(t2 - t1)
      total.append(t2 - t0)
  return {"host": statistics.median(host), "assemble": statistics.median(assemble),
          "total": statistics.median(total), "mean": statistics.mean(total)}


def time_train_step(cfg, batch: int, steps: int = 2) -> tuple[float, int]:
  """(median seconds, tokens) of the config's train step at global batch `batch`."""
  import jax  # noqa: PLC0415  start-up

  from data import pipeline  # noqa: PLC0415  start-up
  from trainer.run.loop import Run  # noqa: PLC0415  start-up
  from trainer.step.state import init_state  # noqa: PLC0415  start-up
  cfg = cfg.copy_and_resolve_references()
  cfg.data.global_batch_size = batch
  cfg.data.micro_batch_size = batch
  cfg.data.batch_ramp = ""
  with tempfile.TemporaryDirectory() as workdir:
    run = Run(cfg, workdir)
    step = run.program.compile()
    state = init_state(run.program.spec, run.program.tx)
    it = iter(pipeline.dataset(run.feed.spec))
    batch_arrays = run.feed.global_batch([next(it) for _ in range(run.program.num_micro)])
    times = []
    with jax.set_mesh(run.mesh):
      for i in range(steps + 1):
        t = time.perf_counter()
        state, metrics = step(state, batch_arrays)
        jax.block_until_ready(metrics)
        if i >= 1:
          times.append(time.perf_counter() - t)
  return statistics.median(times), batch * cfg.data.seq_len


def build_parser():
  parser = CliParser("bench/pipeline.py", __doc__)
  parser.add_argument("--devices", type=int, default=0,
                      help="run on this many fake CPU devices (0 = the machine's devices)")
  parser.add_argument("--steps", type=int, default=20, help="pipeline steps timed")
  parser.add_argument("--step-batch", type=int, default=0,
                      help="global batch at which the train step is timed (0 = the smallest "
                      "the mesh allows)")
  parser.add_argument("--doc-tokens", type=int, default=0,
                      help="read a synthetic corpus of documents of about this many tokens "
                      "(uniform in [n/2, 3n/2]) instead of the config's data (0 = the config's)")
  parser.add_argument("--step-tokens-per-s", type=float, default=0.0,
                      help="compare against this train-step rate instead of measuring one")
  return parser


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  devices = _devices_from_argv(argv)
  if devices:  # before jax is imported
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={devices}").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  platforms.choose()
  parser = build_parser()
  import jax  # noqa: PLC0415  start-up
  try:
    args, rest = parser.parse_known_args(argv)
    cfg = load_from_cli(args.config, rest, devices=jax.devices())
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2

  from trainer.run.loop import Run  # noqa: PLC0415  start-up
  d = cfg.data
  tokens = d.global_batch_size * d.seq_len
  with tempfile.TemporaryDirectory() as workdir:
    if args.doc_tokens:
      d.dir, d.mixture = synthetic_corpus(os.path.join(workdir, "corpus"), args.doc_tokens), ""
    run = Run(cfg, workdir)
    mesh = " ".join(f"{k}={v}" for k, v in run.mesh.shape.items() if v > 1) or "1 device"
    t = time_pipeline(run, args.steps)
    cost = read_cost(run, args.steps)
    rows = len(run.feed.local_rows)
  pipe_tps = tokens / t["total"]
  print(f"config            {args.config} {' '.join(rest)}".rstrip())
  print(f"devices           {jax.device_count()} x {jax.devices()[0].device_kind}; mesh {mesh}")
  print(f"step              {d.global_batch_size} x {d.seq_len} tokens = {run.program.num_micro} "
        f"micro-batches of {run.program.micro_rows} rows ({rows} rows read by this process); "
        f"prefetch={d.prefetch}")
  print(f"pipeline          {t['total'] * 1e3:.1f} ms/step median over {args.steps} steps (mean "
        f"{t['mean'] * 1e3:.1f}): rows {t['host'] * 1e3:.1f} ms + global arrays "
        f"{t['assemble'] * 1e3:.1f} ms")
  print(f"pipeline tokens/s {pipe_tps:,.0f}")
  print(f"reads             {cost['pieces']:.2f} document pieces per window, each one slice of "
        f"a memory-mapped token file: {cost['bytes']:.2f} bytes read per trained token, "
        f"{cost['page_bytes']:,.0f} bytes of 4 KiB pages touched per trained token")
  if args.step_tokens_per_s:
    step_tps, how = args.step_tokens_per_s, "given"
  else:
    from sharding.mesh import data_parallel_size  # noqa: PLC0415  start-up
    batch = args.step_batch or data_parallel_size(dict(run.mesh.shape))
    seconds, step_tokens = time_train_step(cfg, batch)
    step_tps = step_tokens / seconds
    how = f"measured: {seconds:.2f} s for a step of {batch} x {d.seq_len} tokens"
  print(f"train step tok/s  {step_tps:,.0f} ({how})")
  ratio = pipe_tps / step_tps
  print(f"ratio             {ratio:,.1f}x the step's consumption (target >= {TARGET_RATIO:.0f}x: "
        f"{'met' if ratio >= TARGET_RATIO else 'NOT met'})")
  return 0


if __name__ == "__main__":
  sys.exit(main())
