"""bench/baseline.py, bench/nanodo.py and bench/variants.py: the speed comparisons run and report
what they say."""
import os
import re
import statistics

import pytest

from conftest import ROOT, bench_module

TINY = os.path.join(ROOT, "configs", "lm_tiny.py")


def test_baseline_times_both_steps_alternately_and_prints_the_ratio(capsys):
  bench = bench_module("baseline")
  assert bench.main(["--size", "none", "--config", TINY, "--rounds", "2", "--steps", "1",
                     "--config.model.num_layers=1"]) == 0
  out = capsys.readouterr().out
  ms = {name: [float(t) for t in re.search(rf"{name} .*\(rounds: ([\d, ]+) ms\)", out)
               .group(1).split(",")] for name in ("plain", "ours")}
  assert all(len(v) == 2 for v in ms.values())
  ratio = float(re.search(r"ours/plain throughput ([\d.]+)", out).group(1))
  want = statistics.median(p / o for p, o in zip(ms["plain"], ms["ours"]))
  assert abs(ratio - want) <= 0.03 * want  # the median of the rounds' ratios (ms rounded)
  assert "d_model 128, 1 layers" in out


def test_variants_times_each_value_and_prints_its_ratio_to_the_first(capsys):
  bench = bench_module("variants")
  assert bench.main(["--size", "none", "--config", TINY, "--rounds", "2", "--steps", "1",
                     "--config.model.num_layers=2", "--vary", "model.scan_unroll=1,2"]) == 0
  out = capsys.readouterr().out
  row = r"model.scan_unroll={} +[\d.]+ ms/step +x([\d.]+) .*\(rounds: ([\d, ]+) ms\)"
  rows = {v: re.search(row.format(v), out) for v in (1, 2)}
  ms = {v: [float(t) for t in m.group(2).split(",")] for v, m in rows.items()}
  assert float(rows[1].group(1)) == 1.0
  want = statistics.median(b / a for a, b in zip(ms[1], ms[2]))
  assert abs(float(rows[2].group(1)) - want) <= 0.03 * want  # per-round ratios' median
  assert "d_model 128, 2 layers" in out


def test_variants_refuses_a_bad_vary_in_one_line(capsys):
  bench = bench_module("variants")
  for vary in ("model.scan_unroll", "model.scan_unroll=1", "model.no_such_key=1,2",
               "model.scan_unroll=1,0"):
    assert bench.main(["--size", "none", "--config", TINY, "--vary", vary]) == 2, vary
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err


def test_variants_xla_option_reaches_the_compiled_step(capsys):
  """--xla compiles each variant's step with the option: trainer/step/program.py's CPU option that
  keeps the donated state in place, turned off, makes the step copy state buffers again."""
  from trainer.config.cli import load  # noqa: PLC0415
  bench = bench_module("variants")
  option = "xla_cpu_copy_insertion_use_region_analysis"
  cfg = bench.vary(bench.baseline.one_device(load(TINY, [])), "model.num_layers", "1")
  with bench.compiler_option(option, "false"):
    off = bench.baseline.Ours(cfg)
  text = off.step.as_text()
  assert re.search(r"copy\(%state_(params|opt_state)", text), "state not copied without it"
  from trainer.step import program  # noqa: PLC0415
  assert program.COMPILER_OPTIONS["cpu"] == {option: True}  # restored after the block
  assert bench.main(["--size", "none", "--config", TINY, "--rounds", "1", "--steps", "1",
                     "--config.model.num_layers=1", "--xla", f"{option}=false,true"]) == 0
  out = capsys.readouterr().out
  assert re.search(rf"{option}=true +[\d.]+ ms/step +x[\d.]+ the time of {option}=false", out)
  assert bench.main(["--size", "none", "--config", TINY, "--xla", f"{option}=1,2",
                     "--vary", "model.scan_unroll=1,2"]) == 2  # one of the two, not both


def test_the_matched_sizes_are_the_issue_models():
  """3.3M and 25.4M parameters, with SwiGLU's FLOPs equal to a GELU MLP of 4 d (nanodo's)."""
  from models.llama import ModelConfig  # noqa: PLC0415
  from models.sizes import param_counts  # noqa: PLC0415
  from trainer.config.cli import load_from_cli  # noqa: PLC0415
  bench = bench_module("baseline")
  for size, millions in (("3m", 3.3), ("25m", 25.4)):
    cfg = load_from_cli(TINY, bench.size_overrides(size))
    m = ModelConfig.from_config(cfg.model)
    assert round(param_counts(m)["total"] / 1e6, 1) == millions
    assert abs(3 * m.mlp_dim - 2 * 4 * m.d_model) / (8 * m.d_model) < 0.001


def test_nanodo_bench_without_a_checkout_says_so(tmp_path, capsys):
  assert bench_module("nanodo").main(["--nanodo_dir", str(tmp_path), "--size", "3m"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "has no nanodo/model.py" in err and "skipping" in err, err


def test_step_profile_sorts_the_traced_kernels_into_kinds(capsys):
  bench = bench_module("step_profile")
  assert bench.main(["--size", "none", "--config", TINY, "--steps", "1",
                     "--config.model.num_layers=1"]) == 0
  rows = re.findall(r"^\| (.+?) \| ([\d.]+) \| ([\d.]+)% \|$", capsys.readouterr().out, re.M)
  kinds = {kind: float(share) for kind, _, share in rows}
  assert set(kinds) <= set(bench.KINDS) and abs(sum(kinds.values()) - 100) < 0.5
  # every kind of a train step's work shows up, the forward and backward matmuls among them
  # (on CPU no fused attention kernel: xla attention)
  for kind in bench.KINDS[:4] + bench.KINDS[5:8]:
    assert kinds.get(kind, 0) > 0, (kind, kinds)


def test_step_profile_names_gpu_kernels_from_the_hlo():
  """A GPU trace (synthetic: the tracks and names XLA's profiler gives a GPU, over the real
  optimized HLO of a small step): kernels named by their `hlo_op` argument or by their own name
  (the instruction's, dots as underscores) get the instruction's kind; cuBLAS and cuDNN kernels
  without an instruction go by their names; the "XLA Modules" span, host threads and another
  process are not kernel time; what is left is unattributed, with its name."""
  bench, baseline = bench_module("step_profile"), bench_module("baseline")
  _, [(_, cfg)] = baseline.load_sized(baseline.build_parser(), ["--size", "tiny"],
                                      sizes=baseline.SHAPES)
  module = bench.Module(baseline.Ours(cfg).step.as_text())
  insts = [i for c in module.computations.values() for i in c]
  fusion = lambda pattern: next(i.name for i in insts if i.opcode == "fusion" and "." in i.name
                                and re.search(pattern, i.op_name))
  # the optimizer's update, and a fusion inside the layer loop; XLA names their kernels without
  # the dots (loop_add_fusion.3 runs as loop_add_fusion_3)
  update = fusion(r"^jit\(step\)/(add|sub|mul|div|jit\(_where\)/select_n)")
  layer = fusion(r"while/body")
  gpu, host = 7, 1
  meta = [{"ph": "M", "name": "process_name", "pid": gpu, "args": {"name": "/device:GPU:0"}},
          {"ph": "M", "name": "process_name", "pid": host, "args": {"name": "/host:CPU"}},
          {"ph": "M", "name": "thread_name", "pid": gpu, "tid": 1,
           "args": {"name": "Stream #13(Compute)"}},
          {"ph": "M", "name": "thread_name", "pid": gpu, "tid": 2,
           "args": {"name": "XLA Modules"}}]
  kernel = lambda name, us, **args: {"ph": "X", "pid": gpu, "tid": 1, "name": name, "dur": us,
                                     "args": args}
  events = meta + [
      kernel(update.replace(".", "_").replace("-", "_"), 100),  # by its own name
      kernel("triton_fusion_xyz", 200, hlo_op=layer),  # by its hlo_op argument
      kernel("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", 300),  # cuBLAS
      kernel("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16", 400),  # cuDNN
      kernel("some_new_kernel", 60),  # nothing says what it is
      {"ph": "X", "pid": gpu, "tid": 2, "name": "jit_step(42)", "dur": 5000, "args": {}},
      {"ph": "X", "pid": host, "tid": 9, "name": update, "dur": 7000, "args": {}}]
  totals, unnamed = bench.attribute(events, module, seq_len=64, steps=2)
  want = {bench.KINDS[7]: 50e-6, bench.kind(module, layer, 64): 100e-6,
          bench.KINDS[0]: 150e-6, bench.KINDS[8]: 200e-6, bench.UNATTRIBUTED: 30e-6}
  if bench.kind(module, layer, 64) == bench.KINDS[0]:  # the layer fusion is a matmul itself
    want[bench.KINDS[0]] = 250e-6
  assert totals == pytest.approx(want), totals
  assert unnamed == pytest.approx({"some_new_kernel": 30e-6})
  lines = bench.table(totals, unnamed)
  assert lines[0] == "0.5 ms/step of kernel time over all threads"  # 530 us
  assert lines[-1] == "  unattributed: 0.03 ms/step in some_new_kernel"


def test_collectives_reads_ops_and_bytes_from_hlo():
  """bench/collectives.py's summary (read by sharding.collectives): ops by kind, bytes per device
  per step, a collective in a loop counted once as an op and its trips times in the bytes."""
  bench = bench_module("collectives")
  hlo = """HloModule m

%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %ar2 = f32[2]{0} all-reduce(%x), replica_groups={{0,1}}, to_apply=%add
}

ENTRY %main (a: f32[4]) -> f32[4] {
  %all-gather.1 = f32[4,8]{1,0} all-gather(f32[1,8]{1,0} %p), replica_groups={{0,1,2,3}}, dimensions={0}
  %ar = (f32[2]{0}, bf16[3,4]{1,0}) all-reduce(%a, %b), replica_groups={{0,1}}, to_apply=%sum
  %x = f32[4]{0} add(%all-gather.1, %y)
  %w = (s32[], f32[4]) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
}
"""
  got = bench.summarize(hlo)
  assert got["all-gather"] == (1, 128) and got["all-reduce"] == (2, 8 + 24 + 5 * 8)
  assert got["all-to-all"] == (0, 0)


@pytest.mark.slow  # two compiles on 4 devices, ~15-35 s on 2 shared cores
def test_collectives_counts_what_a_sharded_muon_step_adds(capsys):
  """On fsdp x tensor Muon adds all-to-alls (its Newton-Schulz layout, optim/muon.py) and no
  all-reduce; a mesh over the fake devices is one line, exit 2."""
  bench = bench_module("collectives")
  assert bench.main(["--size", "none", "--config", TINY, "--config.model.num_layers=2",
                     "--config.model.d_model=64", "--config.model.mlp_dim=128",
                     "--vary", "optim.name=adamw,muon", "--mesh", "fsdp=2,tensor=2"]) == 0
  out = capsys.readouterr().out
  muon = next(line for line in out.splitlines() if "optim.name=muon: all-" in line)
  assert re.search(r"all-to-all \d+ ops [\d.]+ MiB \(\+\d+ ops", muon), muon
  assert "all-reduce" not in muon or "(+0 ops, +0.00 MiB)" in muon.split("all-reduce")[1], muon
  assert re.search(r"optim.name=muon: [\d.]+ GFLOP per device .* x1\.\d+", out), out
  assert bench.main(["--size", "none", "--config", TINY, "--vary", "optim.name=adamw,muon",
                     "--mesh", "fsdp=16"]) == 2
