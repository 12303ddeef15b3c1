"""Command-line mistakes: one line on stderr, exit code 2, no traceback, nothing written.

train.py runs as a real process where stray output (a traceback, library start-up noise) could
show; the other mistakes go through `train.main` in this process. Every CLI that takes
`--config.KEY=VALUE` parses it with the one parser (`trainer.config.cli.parse_overrides`), so a bad
override reads the same everywhere.
"""
import importlib
import os
import subprocess
import sys

import pytest

import train
from conftest import bench_module
from tools import aot, batch_sweep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "lm_tiny.py")
SYNTAX_ERROR = "from trainer.config.defaults import default_config\ndef get_config(:\n  return 1\n"
RAISES = ("from trainer.config.defaults import default_config\n\ndef get_config():\n"
          "  c = default_config()\n  c.steps = 1 // 0\n  return c\n")


def run_train(*args) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, capture_output=True,
                        text=True, timeout=120)


def one_line(stderr: str) -> str:
  assert "Traceback" not in stderr, stderr
  lines = stderr.strip().splitlines()
  assert len(lines) == 1, stderr
  return lines[0]


def test_process_config_syntax_error_and_unwritable_workdir(tmp_path):
  """Real processes: a config with a syntax error names its file and line; a workdir below a
  regular file cannot be created, even by root."""
  bad = tmp_path / "bad.py"
  bad.write_text(SYNTAX_ERROR)
  proc = run_train("--config", str(bad), "--workdir", str(tmp_path / "w"))
  assert proc.returncode == 2
  assert one_line(proc.stderr).startswith(f"error: --config {bad}, line 2: SyntaxError: ")
  (tmp_path / "file").write_text("x")
  proc = run_train("--config", TINY, "--workdir", str(tmp_path / "file" / "w"))
  assert proc.returncode == 2
  assert one_line(proc.stderr) == (
      f"error: --workdir {tmp_path}/file/w: cannot write there (Not a directory); give a "
      "directory this user can create and write")
  assert not os.path.exists(tmp_path / "w")


def _config(tmp_path, text):
  path = tmp_path / "cfg.py"
  path.write_text(text)
  return str(path)


@pytest.mark.parametrize("make_args,needle", [
    (lambda t: ["--config", _config(t, RAISES), "--workdir", str(t / "w")],
     "cfg.py, line 5: get_config() raised ZeroDivisionError: integer division or modulo by zero"),
    (lambda t: ["--config", _config(t, "import no_such_module_xyz\n"), "--workdir", str(t / "w")],
     "cfg.py, line 1: ModuleNotFoundError: No module named 'no_such_module_xyz'"),
    (lambda t: ["--config", _config(t, "def get_config():\n  return None\n"), "--workdir",
                str(t / "w")], "get_config() returned a NoneType"),
    (lambda t: ["--config", str(t), "--workdir", str(t / "w")], "is a directory"),
    (lambda t: ["--config", str(t / "nope.py"), "--workdir", str(t / "w")], "no such file"),
    (lambda t: ["--config", TINY, "--workdir", str(t / "w"), "--config.optim.lr=1"],
     "unknown key 'optim.lr'"),
    (lambda t: ["--config", TINY, "--workdir", str(t / "w"), "--config.steps=1.5"],
     "--config.steps='1.5': expected int"),
    (lambda t: ["--config", TINY, "--workdir", str(t / "w"), "--bogus"],
     "unknown argument '--bogus'; config overrides are --config.KEY=VALUE"),
    (lambda t: ["--config", TINY, "--workdir", str(t / "w"), "--config.steps"],
     "--config.steps: no value; write --config.steps=VALUE"),
    (lambda t: ["--config", TINY], "the following arguments are required: --workdir"),
    # Terabytes of attention scores (32 TB per device here): refused by a bound, not a compile.
    (lambda t: ["--config", TINY, "--workdir", str(t / "w"), "--config.data.seq_len=1000000"],
     "data.seq_len=1000000: a train step needs at least"),
    (lambda t: ["--config", TINY, "--workdir", "/proc"], "--workdir /proc: cannot write there"),
])
def test_cli_mistake_is_one_line_exit_2(make_args, needle, tmp_path, capsys):
  args = make_args(tmp_path)
  assert train.main(args) == 2
  line = one_line(capsys.readouterr().err)
  assert line.startswith("error: ") and needle in line, line
  assert not os.path.exists(tmp_path / "w"), "nothing may be written"


def test_workdir_that_is_a_file(tmp_path, capsys):
  (tmp_path / "w").write_text("not a directory")
  assert train.main(["--config", TINY, "--workdir", str(tmp_path / "w")]) == 2
  assert "is a file, not a directory" in one_line(capsys.readouterr().err)
  assert (tmp_path / "w").read_text() == "not a directory"


def _bench(name):
  return bench_module(name).main


CLIS = {
    "train.py": lambda extra: train.main(["--config", TINY, "--workdir", os.devnull + "/w",
                                          *extra]),
    "tools.aot": lambda extra: aot.main(["--config", TINY, "--topology", "v5e:2x2", *extra]),
    "tools.batch_sweep": lambda extra: batch_sweep.main(
        ["--config", TINY, "--batch_sizes", "8", "--target_loss", "3", *extra]),
    "bench/throughput.py": lambda extra: _bench("throughput")(["--config", TINY, *extra]),
    "bench/baseline.py": lambda extra: _bench("baseline")(["--config", TINY, *extra]),
}


@pytest.mark.parametrize("cli", sorted(CLIS))
@pytest.mark.parametrize("extra,message", [
    (["--config.optim.learnin_rate=1"], "error: --config.optim.learnin_rate: unknown key "
     "'optim.learnin_rate'; did you mean 'optim.learning_rate'?"),
    (["--config.steps", "ten"], "error: --config.steps='ten': expected int (like the default "
     "300)"),
    (["--steps=3"], "error: unknown argument '--steps=3'; config overrides are "
     "--config.KEY=VALUE"),
])
def test_every_cli_rejects_a_bad_override_the_same_way(cli, extra, message, capsys):
  if cli.startswith("bench/") and extra == ["--steps=3"]:
    extra = ["--warmup=3"]  # the benches have a --steps option of their own
    message = message.replace("--steps=3", "--warmup=3")
  assert CLIS[cli](extra) == 2
  assert one_line(capsys.readouterr().err) == message


@pytest.mark.parametrize("tool", ["convert", "generate", "evaluate"])
@pytest.mark.parametrize("extra,message", [
    (["--config.mesh.dat=2"], "error: --config.mesh.dat: unknown key 'mesh.dat'; did you mean "
     "'mesh.data'?"),
    (["--config.steps=3"], "error: --config.steps: this tool takes only --config.mesh.* "
     "overrides"),
    (["--mesh.data=2"], "error: unknown argument '--mesh.data=2'; config overrides are "
     "--config.KEY=VALUE"),
])
def test_model_tools_take_mesh_overrides_like_train(tool, extra, message, tmp_path, capsys):
  """tools.convert / generate / evaluate pick their mesh with train.py's override parser."""
  module = importlib.import_module(f"tools.{tool}")
  args = {"convert": ["to-hf", str(tmp_path), "--out", str(tmp_path / "out")],
          "generate": ["--checkpoint", str(tmp_path), "--prompt_ids", "1,2"],
          "evaluate": ["--checkpoint", str(tmp_path)]}[tool]
  assert module.main(args + extra) == 2
  assert one_line(capsys.readouterr().err) == message


@pytest.mark.parametrize("tool", ["coord_check", "lr_transfer"])
def test_mup_tools_report_mistakes_in_one_line(tool, capsys):
  module = importlib.import_module(f"tools.{tool}")
  assert module.main(["--widths", "3,x"]) == 2
  assert one_line(capsys.readouterr().err).startswith("error: --widths")
  assert module.main(["--config.steps=3"]) == 2
  assert one_line(capsys.readouterr().err) == (
      f"error: this tool takes no --config.* overrides (python -m tools.{tool} --help)")


def test_lr_transfer_runs_a_subset_of_the_parametrizations(capsys):
  from tools import lr_transfer  # noqa: PLC0415
  assert lr_transfer.parse_args([]).parametrizations == ["sp", "mup"]
  assert lr_transfer.parse_args(["--parametrizations", "mup"]).parametrizations == ["mup"]
  assert lr_transfer.parse_args(["--axis", "depth"]).parametrizations == [
      "standard", "depth_mup", "completep"]
  assert lr_transfer.main(["--parametrizations", "completep"]) == 2
  assert one_line(capsys.readouterr().err).startswith(
      "error: --parametrizations ['completep']: choose among sp, mup")
