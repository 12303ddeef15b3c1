"""The layout holds (tools/layout.py): no import cycle (imports inside functions included), no
arrow between parts that the README's dependency order forbids, a reason that holds for every
import inside a function, modules of a readable size, and the README's reading-path numbers as
the script counts them. Each check is also shown failing on a small tree that breaks it."""
import asyncio
import gc
import os
import re

import pytest

from tools import layout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_LINES = 420  # a module's length (the guide's "~400")
MAX_DOC_LINES = 15  # a module docstring's length; longer reasoning goes to docs/


@pytest.fixture(scope="module")
def found():
  return layout.imports(ROOT)


def test_no_import_cycle(found):
  assert layout.cycles(layout.graph(found)) == []


def test_imports_follow_the_readme_order(found):
  with open(os.path.join(ROOT, "README.md")) as f:
    order = layout.read_order(f.read())
  assert "trainer.run" in order[1] and "kernels" in order[0]
  assert layout.forbidden(layout.graph(found), order) == []


def test_every_function_level_import_has_a_reason_that_holds(found):
  assert layout.unjustified(found) == []


def test_modules_and_their_docstrings_are_short():
  too_long = []
  for path in layout.modules(ROOT).values():
    with open(os.path.join(ROOT, path)) as f:
      text = f.read()
    doc = re.match(r'\s*(?:"""(.*?)"""|\'\'\'(.*?)\'\'\')', text, re.S)
    doc_lines = len((doc.group(1) or doc.group(2)).strip().splitlines()) if doc else 0
    if len(text.splitlines()) > MAX_LINES or doc_lines > MAX_DOC_LINES:
      too_long.append(f"{path}: {len(text.splitlines())} lines, docstring {doc_lines}")
  assert too_long == []


def test_readme_reading_path_is_counted():
  """The README's table of the core reading path carries the script's numbers."""
  with open(os.path.join(ROOT, "README.md")) as f:
    readme = f.read()
  rows = layout.reading_path(ROOT)
  for what, path, lines, code in rows:
    assert re.search(rf"\| {re.escape(what)} \| `{re.escape(path)}` \| {lines} \| {code} \|",
                     readme), (what, path, lines, code)
  total = f"| total | | {sum(r[2] for r in rows)} | {sum(r[3] for r in rows)} |"
  assert total in readme


# ------------------------------------------------------------------------------------------------
# The checks catch what they guard against (a small tree of its own)


def write_tree(root, files: dict[str, str]) -> str:
  for path, text in files.items():
    full = os.path.join(root, path)
    os.makedirs(os.path.dirname(full), exist_ok=True)
    with open(full, "w") as f:
      f.write(text)
  return str(root)


README = "```text\n# dependency order\nkernels, data < models < trainer\n" \
         "trainer/: config < run\n```\n"


def test_the_checks_fail_on_a_tree_that_breaks_them(tmp_path):
  root = write_tree(tmp_path, {
      "README.md": README,
      "kernels/__init__.py": "", "data/__init__.py": "", "models/__init__.py": "",
      "trainer/__init__.py": "", "trainer/config/__init__.py": "",
      "trainer/run/__init__.py": "",
      # a cycle hidden inside a function: a <-> b
      "models/a.py": "import jax\nfrom models import b\n",
      "models/b.py": "def f():\n  from models import a  # noqa: PLC0415  start-up\n",
      # an arrow the order forbids: data -> models; a room reaching up: config -> run
      "data/c.py": "from models import a\n",
      "trainer/config/d.py": "from trainer.run import e\n",
      "trainer/run/e.py": "import os\n",
      # function-level imports: no reason; 'start-up' where the module imports jax anyway;
      # 'optional' for a required package; and one that holds
      "kernels/k.py": "import jax\ndef f():\n  import numpy  # noqa: PLC0415\n"
                      "def g():\n  import optax  # noqa: PLC0415  start-up\n"
                      "def h():\n  import numpy  # noqa: PLC0415  optional\n",
      "trainer/run/light.py": "def f():\n  from models import a  # noqa: PLC0415  start-up\n",
  })
  found = layout.imports(root)
  edges = layout.graph(found)
  assert layout.cycles(edges) == [["models.a", "models.b"]]
  with open(os.path.join(root, "README.md")) as f:
    bad = layout.forbidden(edges, layout.read_order(f.read()))
  assert any(b.startswith("data -> models") for b in bad), bad
  assert any(b.startswith("trainer.config -> trainer.run") for b in bad), bad
  unjustified = layout.unjustified(found)
  assert len(unjustified) == 3, unjustified
  assert any("kernels.k:3" in u and "no reason" in u for u in unjustified)
  assert any("kernels.k:5" in u and "imports jax anyway" in u for u in unjustified)
  assert any("kernels.k:7" in u and "not an optional dependency" in u for u in unjustified)
  assert layout.problems(root)  # the tool's exit code would be 1


def test_the_layout_tool_reports_the_repository(capsys):
  assert layout.main([ROOT]) == 0
  out = capsys.readouterr().out
  assert "core reading path:" in out and "0 problem(s)" in out


def test_parsing_survives_a_finalizer_that_formats_a_traceback():
  """Python 3.11: an asyncio task whose exception nobody read, collected during `ast.parse`,
  logs its traceback (which parses source lines) and broke the outer parse with SystemError."""
  async def fail():
    try:
      [][0]
    except IndexError as e:
      raise RuntimeError("unread") from e

  async def leave_unread():
    tasks = [asyncio.ensure_future(fail()) for _ in range(3)]
    cycle = [tasks]
    cycle.append(cycle)  # collected only by the cycle collector, at some later allocation
    await asyncio.sleep(0)

  with open(os.path.join(ROOT, "kernels", "flash_attention.py")) as f:
    text = f.read()
  threshold = gc.get_threshold()
  gc.disable()
  try:
    asyncio.run(leave_unread())
    # The next collection falls a few hundred allocations on: inside the parse, were it allowed.
    gc.set_threshold(gc.get_count()[0] + 200)
    gc.enable()
    assert layout.parse(text, "kernels/flash_attention.py").body
  finally:
    gc.set_threshold(*threshold)
    gc.enable()
  gc.collect()


def test_a_relative_import_is_resolved_against_the_importers_package(tmp_path):
  """`from ..run import inprocess, loop` planted in a copy of trainer/config/checks.py: an arrow
  up the README's order (config -> run) and a cycle (inprocess imports checks in a function),
  both reported (relative imports were skipped: nothing was)."""
  import shutil  # noqa: PLC0415
  copy = tmp_path / "repo"
  shutil.copytree(ROOT, copy, ignore=lambda d, names: [
      n for n in names if n.startswith(".") or n in layout.SKIP_DIRS
      or (os.path.isfile(os.path.join(d, n)) and not n.endswith((".py", ".md")))])
  before = set(layout.problems(str(copy)))
  with open(copy / "trainer" / "config" / "checks.py", "a") as f:
    f.write("from ..run import inprocess, loop\n")
  found = [i for i in layout.imports(str(copy)) if i.importer == "trainer.config.checks"]
  assert any(i.target == "trainer.run.loop" and i.in_repo for i in found), found
  problems = set(layout.problems(str(copy))) - before
  assert any(p.startswith("forbidden arrow: trainer.config -> trainer.run") for p in problems), \
      problems
  assert any(p.startswith("import cycle: trainer.config.checks <-> ") and
             p.endswith(" <-> trainer.run.inprocess") for p in problems), problems
