"""What the batch size does to a pipeline's bubble and memory: the train step compiled for a TPU
topology at several numbers of micro-batches M, per schedule, with the bubble counted from each
compiled program (and its schedule table) and the step time of tools.aot's roofline.

    python bench/pipeline_bubble.py --config configs/lm_1b.py --topology v5e:4x4 --stages 4 \\
        --micro 4,8,16,32 --schedules gpipe,circular,1f1b,zero_bubble --repeats 1,2 \\
        --config.data.micro_batch_size=16 --jobs 4 --csv docs/pipeline.csv --png docs/pipeline.png

No TPU is needed (compile only, as `tools.aot`). One row per program (schedule, repeats R, M):
the ticks counted in it, the bubble against (S - 1) / (M R + S - 1), the stash, the memory per
chip, the roofline's step time and the bytes between stages; the same batches without stages
give the reference. gpipe runs R = 1, circular the R > 1 of `--repeats`, 1f1b, 1f1b_residuals
(1f1b with pipeline.remat_stage=False) and zero_bubble every R. A config that does not fit is a
row with `fits` False; `--jobs N` compiles N programs at once.
Why and details: docs/pipeline.md#the-bubble-and-the-memory-against-the-batch-size
"""
from __future__ import annotations

import concurrent.futures
import multiprocessing
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile only: no step runs here
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # as tools/aot.py

import sys  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from tools import aot  # noqa: E402
from tools.figures import NO_PLOT, pyplot, save, write_csv  # noqa: E402
from trainer.config.cli import CliParser, load  # noqa: E402
from trainer.config import ConfigError  # noqa: E402
from trainer.tracking.peaks import GiB  # noqa: E402

FIELDS = ["schedule", "repeats", "micro", "global_batch", "fits", "ticks", "idle", "bubble",
          "bubble_formula", "stash", "step_ms", "ms_per_micro", "temp_gib", "memory_gib",
          "stage_mb"]
SCHEDULES = ("gpipe", "circular", "1f1b", "1f1b_residuals", "zero_bubble")
KEEPS_RESIDUALS = "1f1b_residuals"  # 1f1b with pipeline.remat_stage=False: F's VJP residuals kept


def row(cfg, topology: str, name: str, stages: int, schedule: str, repeats: int,
        micro: int) -> dict:
  """One compiled step of `micro` micro-batches on `stages` stages x `repeats` under `schedule`
  (no pipeline when `stages` is 1), for `topology`."""
  target = aot.config_target(cfg, topology)
  cfg = cfg.copy_and_resolve_references()
  cfg.mesh.stage = stages
  cfg.pipeline.schedule = "1f1b" if schedule == KEEPS_RESIDUALS else schedule
  cfg.pipeline.remat_stage = schedule != KEEPS_RESIDUALS
  cfg.pipeline.repeats = repeats
  cfg.data.global_batch_size = micro * cfg.data.micro_batch_size
  out = {"schedule": "none" if stages == 1 else schedule, "repeats": repeats,
         "micro": micro, "global_batch": cfg.data.global_batch_size,
         "bubble_formula": (stages - 1) / (micro * repeats + stages - 1)}
  try:
    report = aot.compile_report(cfg, target, name)
  except aot.AotError as e:
    print(f"  {out['schedule']} R={repeats} M={micro}: {e}", flush=True)
    return {**out, "fits": False}
  print(f"  {out['schedule']} R={repeats} M={micro}: compiled in {report.compile_seconds:.0f}s",
        flush=True)
  p = report.pipeline
  seconds = report.roofline.seconds
  out.update(fits=True, ticks=p.get("pipeline/ticks"), idle=p.get("pipeline/idle_ticks"),
             bubble=p.get("pipeline/bubble", 0.0),
             stash=p.get("pipeline/stash", (micro * repeats) if p else None),
             step_ms=None if seconds is None else seconds * 1e3,
             ms_per_micro=None if seconds is None else seconds * 1e3 / micro,
             temp_gib=report.temp_bytes / GiB, memory_gib=report.total_bytes / GiB,
             stage_mb=((p.get("pipeline/activation_bytes") or 0)
                       + (p.get("pipeline/other_bytes") or 0)) / 1e6 if p else 0.0)
  return out


def label(schedule: str, repeats: int) -> str:
  name = {"none": "no stages", "gpipe": "GPipe", "circular": "circular", "1f1b": "1F1B",
          KEEPS_RESIDUALS: "1F1B, residuals kept", "zero_bubble": "zero bubble"}[schedule]
  return name if repeats == 1 or schedule == "none" else f"{name} R={repeats}"


def plot(rows: list[dict], stages: int, path: str, title: str) -> None:
  plt = pyplot()
  if plt is None:
    print("figure" + NO_PLOT)
    return
  fig, (bubble, temp, time) = plt.subplots(1, 3, figsize=(15, 4))
  series = dict.fromkeys((r["schedule"], r["repeats"]) for r in rows)
  for (schedule, repeats), style in zip(series, ("o-", "s-", "^-", "v-", "D-", "P-", "X-")):
    runs = [r for r in rows if (r["schedule"], r["repeats"]) == (schedule, repeats) and r["fits"]]
    ms = [r["micro"] for r in runs]
    style = style if schedule != "none" else "k--"
    if schedule != "none":
      bubble.plot(ms, [r["bubble"] for r in runs], style, label=label(schedule, repeats))
      bubble.plot(ms, [r["bubble_formula"] for r in runs], "k:", lw=0.8)
    temp.plot(ms, [r["temp_gib"] for r in runs], style, label=label(schedule, repeats))
    time.plot(ms, [r["ms_per_micro"] for r in runs], style, label=label(schedule, repeats))
  bubble.set(xscale="log", xlabel="micro-batches M", ylabel="bubble (idle / all slot work)",
             title=f"{stages} stages; dotted: (S-1)/(MR+S-1)")
  temp.set(xscale="log", xlabel="micro-batches M", ylabel="temporaries per chip (GiB)",
           title="memory besides the train state")
  time.set(xscale="log", xlabel="micro-batches M", ylabel="roofline step time / M (ms)",
           title="step time per micro-batch")
  for ax in (bubble, temp, time):
    ax.set_xticks(sorted({r["micro"] for r in rows}), labels=sorted({str(r["micro"])
                                                                     for r in rows}, key=int))
    ax.set_xticks([], minor=True)  # no log-scale minor labels between the M ticks
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  save(fig, path, title)


def build_parser() -> CliParser:
  parser = CliParser("bench/pipeline_bubble.py", __doc__)
  parser.add_argument("--topology", required=True, help="as tools.aot's, e.g. v5e:4x4")
  parser.add_argument("--stages", type=int, default=4)
  parser.add_argument("--micro", default="4,8,16,32", help="numbers of micro-batches M")
  parser.add_argument("--schedules", default="gpipe,circular",
                      help=f"of {', '.join(SCHEDULES)} (gpipe: R = 1; circular: R > 1)")
  parser.add_argument("--repeats", default="1,2,4", help="repeats R per stage")
  parser.add_argument("--csv", default="")
  parser.add_argument("--png", default="")
  parser.add_argument("--jobs", type=int, default=1,
                      help="compile this many programs at once (processes)")
  return parser


def main(argv: list[str]) -> int:
  try:
    args, overrides = build_parser().parse(argv)
    cfg = load(args.config, overrides)
    if not cfg.data.micro_batch_size:
      raise ConfigError("set data.micro_batch_size: M micro-batches of it make each batch")
    micros = [int(m) for m in args.micro.split(",")]
    repeats = [int(r) for r in args.repeats.split(",")]
    schedules = args.schedules.split(",")
    if not set(schedules) <= set(SCHEDULES):
      raise ConfigError(f"--schedules={args.schedules}: choose from {', '.join(SCHEDULES)}")
    aot.config_target(cfg, args.topology)
  except (ConfigError, aot.AotError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  name = os.path.splitext(os.path.basename(args.config))[0]
  runs = [(schedule, r) for schedule in schedules for r in repeats
          if (schedule != "gpipe" or r == 1) and (schedule != "circular" or r > 1)]
  work = [(cfg, args.topology, name, args.stages, schedule, r, m) for schedule, r in runs
          for m in micros]
  work += [(cfg, args.topology, name, 1, "gpipe", 1, m) for m in micros]  # the reference
  if args.jobs > 1:
    with concurrent.futures.ProcessPoolExecutor(
        args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
      rows = list(pool.map(row, *zip(*work)))
  else:
    rows = [row(*w) for w in work]
  print(f"{name} on {args.topology}, {args.stages} stages, micro-batches of "
        f"{cfg.data.micro_batch_size} sequences:")
  print("| schedule | R | M | batch | ticks | idle | bubble (counted) | (S-1)/(MR+S-1) | stash | "
        "step (roofline) | per micro-batch | temporaries/chip | memory/chip | between stages |")
  print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
  fmt = lambda v, spec: "-" if v is None else format(v, spec)
  for r in rows:
    if not r["fits"]:
      print(f"| {r['schedule']} | {r['repeats']} | {r['micro']} | {r['global_batch']} | "
            "does not fit | | | | | | | | | |")
      continue
    print(f"| {r['schedule']} | {r['repeats']} | {r['micro']} | {r['global_batch']} | "
          f"{fmt(r['ticks'], 'd')} | {fmt(r['idle'], 'd')} | {r['bubble']:.1%} | "
          f"{r['bubble_formula']:.1%} | {fmt(r['stash'], 'd')} | {fmt(r['step_ms'], ',.1f')} ms | "
          f"{fmt(r['ms_per_micro'], ',.2f')} ms | {r['temp_gib']:.3f} GiB | "
          f"{r['memory_gib']:.3f} GiB | {r['stage_mb']:,.0f} MB |")
  if args.csv:
    write_csv(args.csv, rows, FIELDS)
  if args.png:
    plot(rows, args.stages, args.png, f"{name} on {args.topology}: pipeline bubble and step "
         "time against the number of micro-batches (compiled programs)")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
