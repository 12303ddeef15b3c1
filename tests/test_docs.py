"""Docs that cannot rot: README.md and docs/*.md checked against the code.

- Links: every relative link and image points at a file that exists, and every `#anchor` at a
  heading of its page (GitHub's anchors); every page of docs/ is linked from the README.
- Names: every repository file they name (`trainer/config/defaults.py`, `docs/x.{csv,png}`) exists, and
  a name after it (`models/attention.py:choose_impl`, `tests/test_x.py::test_y`) is defined
  there; every config key named in a code span (`optim.lr_rule`, `mesh.{data,fsdp}`,
  `--config.mesh.dcn_data=2`) is a key of `trainer.config.defaults.default_config()`, a value given with
  it (`model.moe.shared_expert=384`) parses with that key's type, and a dotted name that is no
  key is a module attribute (`sharding.make_mesh`).
- Commands: every `python train.py`, `python -m tools.*`, `python -m experiments.*`,
  `python -m data.prepare` and `python bench/*.py` command, in a fenced block or a code span,
  is parsed by its entry point's own parser (`build_parser()`), its `--config.KEY=VALUE`
  overrides are applied to its config (`--config FILE`, or the entry point's default) by
  `trainer.config.cli`, and the result goes through `trainer.config.checks.validate`, the checks
  train.py runs before compiling. A renamed key or flag, a bad value, a mesh that does not fit
  the command's devices: the test fails on the page and line.

What is not checked, and why:
- Placeholders stand for the user's own: a value in capitals (`DIR`, `NAME`, `X`, a path with
  such a part, `configs/NAME.py`), one small letter (`ring_head_chunks=c`), `...`, `$VAR`, or a
  path under `path/to/`. An override with
  such a value is checked for its key only; a `--config` file that is one is not loaded.
- What a command reads at run time is the user's: a `data.dir` or `data.mixture` directory that
  does not exist here is validated as the default corpus (the mixture's syntax is still
  parsed), a `checkpoint.init_from` that does not exist is dropped, and checkpoints, nanodo
  checkouts and data given to the tools are not opened.
- Devices: the mesh is checked against the devices the command names
  (`XLA_FLAGS=--xla_force_host_platform_device_count=N`, `JAX_NUM_CPU_DEVICES=N` x
  `JAX_NUM_PROCESSES`, `tools.aot --topology` with the config's `mesh.dcn_*` slices,
  `bench/pipeline.py --devices N`); where it names none (a GPU box, a TPU VM), against as many as
  the mesh itself asks for (its fixed sizes, -1 counting one), so every check runs but "the
  mesh fits this machine". None of it touches a device.
- The checks an entry point makes after parsing (comma-separated lists, prompt options) and
  anything that needs the run (data, compiling) are not run. `tools.lm_eval_adapter` takes
  lm-evaluation-harness's flags, which are not ours to check. ```python blocks are example code
  (a config file), not commands.
"""
from __future__ import annotations

import functools
import glob
import importlib
import math
import os
import re
import shlex
import subprocess
import sys
import types

import ml_collections
import pytest

from conftest import ROOT, bench_module
from trainer.config import ConfigError, default_config
from trainer.config.checks import validate
from trainer.config.cli import CliParser, apply_override, load

PAGES = ["README.md"] + sorted(os.path.relpath(p, ROOT)
                               for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
SPAN = re.compile(r"`([^`\n]+(?:\n(?!\n)[^`\n]*)*)`")  # a code span, across lines of a paragraph
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
TOP_DIRS = ("bench", "configs", "data", "docs", "experiments", "kernels", "models", "notebooks",
            "optim", "sharding", "tests", "tools", "trainer", r"\.ci")
PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w./{},-]*[\w}]|train\.py|pyproject\.toml)(::?\w+)?"
                  % "|".join(TOP_DIRS))
PACKAGES = ("models", "kernels", "sharding", "optim", "data", "trainer", "tools", "experiments")
COMMAND = re.compile(r"(?:^|(?<=[\s!'\"(]))python3? +(train\.py|-m +[\w.]+|bench/\w+\.py)(.*)$",
                     re.M)


def read(page: str) -> str:
  with open(os.path.join(ROOT, page)) as f:
    return f.read()


def line_of(text: str, offset: int) -> int:
  return text.count("\n", 0, offset) + 1


def placeholder(value: str) -> bool:
  """Whether a value stands for the user's own (see the module docstring)."""
  return bool(value == "..." or re.fullmatch(r"[a-z]", value) or "path/to/" in value or
              "$" in value or "<" in value or
              any(part.isupper() for part in re.split(r"[/.:,=]", value)))


def split(text: str):
  """(prose with fenced blocks blanked out, [(language, block text, offset)]). Blanking keeps
  offsets, so line numbers stay right."""
  blocks = [(m.group(1), m.group(2), m.start(2)) for m in FENCE.finditer(text)]
  prose = FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
  return prose, blocks


def spans(text: str):
  """[(code span text on one line, offset)] of the prose."""
  prose, _ = split(text)
  return [(" ".join(m.group(1).split()), m.start(1)) for m in SPAN.finditer(prose)]


# ------------------------------------------------------------------------------------------------
# Links and anchors


def slug(heading: str) -> str:
  """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
  return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@functools.cache
def anchors(page: str) -> set[str]:
  return anchors_of(read(page))


def anchors_of(text: str) -> set[str]:
  prose, _ = split(text)
  seen, out = {}, set()
  for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", prose, re.M):
    base = slug(m.group(1))
    n = seen.get(base, 0)
    seen[base] = n + 1
    out.add(base if n == 0 else f"{base}-{n}")
  return out


def link_problems(page: str, text: str) -> list[str]:
  """Every relative link of `text` (the page `page`) that does not resolve, as 'line: why'."""
  prose, _ = split(text)
  prose = SPAN.sub(lambda m: " " * len(m.group(0)), prose)  # a link in code is no link
  problems = []
  for m in LINK.finditer(prose):
    target = m.group(1)
    if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
      continue
    path, _, anchor = target.partition("#")
    where = f"{page}:{line_of(text, m.start())}: {target}"
    full = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), path)) if path else \
        os.path.join(ROOT, page)
    if not os.path.exists(full):
      problems.append(f"{where}: no such file")
    elif anchor and anchor not in (anchors(os.path.relpath(full, ROOT)) if path else
                                   anchors_of(text)):
      problems.append(f"{where}: no heading with that anchor")
  return problems


@pytest.mark.parametrize("page", PAGES)
def test_links_and_anchors_resolve(page):
  assert link_problems(page, read(page)) == []


def test_every_page_is_linked_from_the_readme():
  linked = {os.path.normpath(m.group(1).partition("#")[0])
            for m in LINK.finditer(split(read("README.md"))[0])}
  assert [p for p in PAGES[1:] if p not in linked] == []


def test_ci_finds_the_quickstart_test_command():
  """.ci/run reads the second command of the README's Quickstart block; run its own snippet."""
  ci = read(".ci/run")
  snippet = ci[ci.index("<<'PY'\n") + 7:ci.index("\nPY\n")]
  out = subprocess.run([sys.executable, "-c", snippet], cwd=ROOT, capture_output=True,
                       text=True, check=True).stdout.strip()
  assert out.endswith("python -m pytest -q -n 2 --dist loadfile"), out


# ------------------------------------------------------------------------------------------------
# Files, names and config keys


def expand(text: str) -> list[str]:
  """Brace expansion: `a.{b,c}` -> [a.b, a.c]."""
  m = re.search(r"\{([^{}]*)\}", text)
  if not m:
    return [text]
  return [x for part in m.group(1).split(",")
          for x in expand(text[:m.start()] + part + text[m.end():])]


def name_problems(page: str, text: str) -> list[str]:
  """Repository files (with an extension) that do not exist, or lack the name after them."""
  prose, blocks = split(text)
  sources = [(prose, 0)] + [(b, off) for lang, b, off in blocks if lang != "python"]
  problems = []
  for source, base in sources:
    for m in PATH.finditer(source):
      where = f"{page}:{line_of(text, base + m.start())}: {m.group(0)}"
      for path in expand(m.group(1)):
        if not os.path.splitext(path)[1] or placeholder(path):  # a directory, a user's data dir
          continue
        full = os.path.join(ROOT, path)
        if not os.path.isfile(full):
          problems.append(f"{where}: no such file")
        elif m.group(2):
          name = m.group(2).lstrip(":")
          if not re.search(rf"^\s*(?:def|class)\s+{name}\b|^{name}\s*[:=]", read(path), re.M):
            problems.append(f"{where}: {name} is not defined in {path}")
  return problems


@pytest.mark.parametrize("page", PAGES)
def test_named_files_exist(page):
  assert name_problems(page, read(page)) == []


def is_key(dotted: str) -> bool:
  """A key of the config (a `*`, `<x>` or capital part matches any key at that place)."""
  def walk(node, parts):
    if not parts:
      return True
    head, rest = parts[0], parts[1:]
    if not isinstance(node, ml_collections.ConfigDict):
      return False
    if head == "*" or head.isupper() or head.startswith("<"):
      return any(walk(node[k], rest) for k in node)
    pattern = re.compile(re.escape(head).replace(r"\*", r"\w*") + "$")
    return any(walk(node[k], rest) for k in node if pattern.match(k))
  return walk(default_config(), dotted.split("."))


def is_attribute(dotted: str) -> bool:
  """A module, or an attribute of one (`tools.*`: any module of the package)."""
  parts = dotted.removesuffix(".*").split(".")
  for i in range(len(parts), 0, -1):
    try:
      node = importlib.import_module(".".join(parts[:i]))
    except ImportError:
      continue
    try:
      for attr in parts[i:]:
        node = getattr(node, attr)
    except AttributeError:
      return False
    return True
  return False


def is_leaf(dotted: str) -> bool:
  """A key naming one value (no group, no wildcard)."""
  node = default_config()
  for part in dotted.split("."):
    if not isinstance(node, ml_collections.ConfigDict) or part not in node:
      return False
    node = node[part]
  return not isinstance(node, ml_collections.ConfigDict)


def key_problems(page: str, text: str) -> list[str]:
  groups = [k for k, v in default_config().items() if isinstance(v, ml_collections.ConfigDict)]
  key = re.compile(r"(?:--config\.)?((?:%s)(?:\.[\w{},*<>]+)+)(?:\s*=\s*(.*))?" % "|".join(
      sorted(set(groups) | set(PACKAGES))))
  problems = []
  for span, offset in spans(text):
    m = key.fullmatch(span)
    if not m:
      continue
    where = f"{page}:{line_of(text, offset)}: `{span}`"
    for dotted in expand(m.group(1)):
      if not (is_key(dotted) or (not span.startswith("--") and is_attribute(dotted))):
        problems.append(f"{where}: {dotted} is no config key (trainer/config/defaults.py) nor a module "
                        "attribute")
      elif m.group(2) and is_leaf(dotted) and not placeholder(value := m.group(2).split()[0]):
        try:  # `KEY=VALUE`: the value parses with the key's type, as on the command line
          apply_override(default_config(), dotted, value.strip('"'))
        except ConfigError as e:
          problems.append(f"{where}: {e}")
  return problems


@pytest.mark.parametrize("page", PAGES)
def test_named_config_keys_exist(page):
  assert key_problems(page, read(page)) == []


# ------------------------------------------------------------------------------------------------
# Command lines


def commands(page: str, text: str):
  """[(line, environment prefix, the command's tokens after `python`)]."""
  prose, blocks = split(text)
  found = [(s, off) for s, off in spans(text)]
  found += [(b.replace("\\\n", " "), off) for lang, b, off in blocks if lang != "python"]
  out = []
  for source, base in found:
    for m in COMMAND.finditer(source):
      rest = m.group(1) + m.group(2)
      for cut in ("&&", ";", " | ", " &"):  # the next shell command
        rest = rest.split(cut)[0]
      try:
        tokens = shlex.split(rest, comments=True)
      except ValueError:  # the closing quote of an outer string (gcloud --command='...')
        tokens = shlex.split(rest.rstrip().rstrip("'\""), comments=True)
      prefix = source[source.rfind("\n", 0, m.start()) + 1:m.start()]
      env = dict(re.findall(r"(\w+)=(\S+)", prefix))
      tokens = [t.strip("[]") for t in tokens if t.strip("[]") not in ("", "...")]
      out.append((line_of(text, base + m.start()), env, tokens))
  return out


def ours(tokens: list[str]) -> bool:
  """Whether a command runs one of this repository's entry points (pytest does not; the
  lm-evaluation-harness adapter takes the harness's flags)."""
  if tokens[0] == "train.py" or tokens[0].startswith("bench/"):
    return True
  name = tokens[1]  # python -m NAME
  return name != "tools.lm_eval_adapter" and (name == "data.prepare" or
                                              name.split(".")[0] in ("tools", "experiments"))


def entry_point(tokens: list[str]):
  """(the module a command runs, its arguments)."""
  if tokens[0] == "train.py":
    return importlib.import_module("train"), tokens[1:]
  if tokens[0].startswith("bench/"):
    return bench_module(os.path.basename(tokens[0])[:-3]), tokens[1:]
  return importlib.import_module(tokens[1]), tokens[2:]


def devices_for(env: dict, args, cfg) -> int | list:
  """The devices the command names (or the mesh's own), as validate() takes them."""
  from sharding.mesh import DCN_AXES, MESH_AXES  # noqa: PLC0415
  from tools.targets import config_slices, topology_devices  # noqa: PLC0415
  slices = config_slices(cfg.mesh)
  replicas = max(int(cfg.optim.diloco.replicas), 1)  # DiLoCo: the mesh is one replica's
  flags = re.search(r"device_count=(\d+)", env.get("XLA_FLAGS", ""))
  if getattr(args, "topology", None):  # tools.aot compiles one copy of it per replica
    n = topology_devices(args.topology, slices) * replicas
  elif "JAX_NUM_CPU_DEVICES" in env:
    n = int(env["JAX_NUM_CPU_DEVICES"]) * int(env.get("JAX_NUM_PROCESSES", 1))
  elif flags:
    n = int(flags.group(1))
  elif getattr(args, "devices", 0):
    n = args.devices
  else:  # nothing named: as many as the mesh asks for
    n = math.prod(max(int(cfg.mesh[a]), 1) for a in MESH_AXES + DCN_AXES) * replicas
  if slices == 1:
    return n
  return [types.SimpleNamespace(slice_index=i * slices // n) for i in range(n)]


def check_command(env: dict, tokens: list[str]) -> str:
  """Parse and validate one command; a ConfigError (or AotError) names what is wrong."""
  from data import mixture  # noqa: PLC0415
  module, argv = entry_point(tokens)
  parser = module.build_parser()
  if isinstance(parser, CliParser):
    args, overrides = parser.parse(argv)
  else:  # data.prepare: plain argparse, no overrides
    try:
      args, overrides = parser.parse_args(argv), []
    except SystemExit:
      raise ConfigError(f"{' '.join(argv)}: argparse refused it (see the output above)") from None
  if getattr(args, "vary", None):  # bench/variants.py, collectives.py: each value an override
    key, values = bench_module("variants").parse_vary(args.vary)
    overrides += [(key, v) for v in values]
  size = getattr(args, "size", None)
  if size and size != "none" and not placeholder(size):  # a bench's sized model: its overrides
    baseline = bench_module("baseline")  # first, as `load_sized` applies them
    sized = [o[len("--config."):].split("=", 1) for o in baseline.size_overrides(
        size.split(",")[0], {**baseline.SIZES, **baseline.SHAPES})]
    overrides = [tuple(kv) for kv in sized] + list(overrides)
  path = getattr(args, "config", None)
  if path and placeholder(path):
    path = None
  cfg = load(os.path.join(ROOT, path), []) if path else default_config()  # ROOT: any cwd
  for key, value in overrides:  # the real override code; a placeholder value keeps the default
    current = cfg
    for part in key.split(".")[:-1]:
      current = current.get(part, ml_collections.ConfigDict())
    keep = str(current.get(key.split(".")[-1], ""))
    apply_override(cfg, key, keep if placeholder(value) else value)
  if not path:
    return "flags and override keys"
  if cfg.data.mixture:
    sources = mixture.parse(cfg.data.mixture)
    if not all(os.path.isdir(os.path.join(ROOT, s.dir)) for s in sources):
      cfg.data.mixture = ""
  if cfg.data.dir and not os.path.isdir(os.path.join(ROOT, cfg.data.dir)):
    cfg.data.dir = ""
  if cfg.checkpoint.init_from and not os.path.exists(os.path.join(ROOT, cfg.checkpoint.init_from)):
    cfg.checkpoint.init_from = ""
  validate(cfg, devices_for(env, args, cfg))
  return "validated"


COMMANDS = [(f"{page}:{line}", env, tokens) for page in PAGES
            for line, env, tokens in commands(page, read(page)) if ours(tokens)]


def test_the_docs_show_commands():
  assert len(COMMANDS) > 50 and {t[0] for _, _, t in COMMANDS} >= {"train.py", "-m"}


@pytest.mark.parametrize("where,env,tokens", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_command_parses_and_validates(where, env, tokens):
  from tools.targets import AotError  # noqa: PLC0415
  try:
    check_command(env, tokens)
  except (ConfigError, AotError) as e:
    pytest.fail(f"{where}: python {' '.join(tokens)}\n  {e}")


# ------------------------------------------------------------------------------------------------
# The checks can fail


def test_a_broken_link_a_missing_file_and_a_misspelt_key_are_caught():
  text = ("# Page\n\nSee [configs](docs/configs.md#no-such-heading), [gone](docs/gone.md), "
          "[ok](#page) and `trainer/no_such.py`, `models/attention.py:no_such_function`,\n"
          "`optim.learnin_rate`.\n")
  assert [p.split(": ", 2)[2] for p in link_problems("README.md", text)] == [
      "no heading with that anchor", "no such file"]
  assert [p.split(": ", 2)[2] for p in name_problems("README.md", text)] == [
      "no such file", "no such file",  # docs/gone.md, trainer/no_such.py
      "no_such_function is not defined in models/attention.py"]
  assert "optim.learnin_rate is no config key" in key_problems("README.md", text)[0]


@pytest.mark.parametrize("text,message", [
    ("python train.py --config configs/lm_tiny.py --workdir runs/x --config.optim.learnin_rate=1",
     "did you mean 'optim.learning_rate'?"),
    ("python train.py --config configs/lm_tiny.py --workdir runs/x --config.steps=ten",
     "expected int"),
    ("python -m tools.aot --config configs/moe_1b.py --topology v5e:2x2", "mesh"),
    ("XLA_FLAGS=--xla_force_host_platform_device_count=8 python train.py --config "
     "configs/lm_tiny.py --workdir runs/x --config.mesh.data=3", "mesh"),
    ("python bench/throughput.py --config configs/lm_tiny.py --stepz 20", "--stepz"),
    ("python -m tools.generate --checkpoint runs/tiny --max_new_tokens many", "max_new_tokens"),
])
def test_a_misspelt_command_is_caught(text, message):
  [(line, env, tokens)] = commands("README.md", f"```bash\n{text}\n```\n")
  with pytest.raises(ConfigError, match=re.escape(message)):
    check_command(env, tokens)
