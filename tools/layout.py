"""The repository's layout, measured: the import graph of every module (function-level imports
included), its cycles, the arrows between parts that the README's dependency order forbids, the
function-level imports without a reason, and the core reading path with its line counts.

    python -m tools.layout [ROOT]      # the report; exit code 1 if the layout has a problem

tests/test_layout.py runs the same checks. A function-level import must carry one of these reasons
in its comment (`# noqa: PLC0415  start-up`, ...), and the reason must hold:

  start-up   the importing module does not import jax (or another package slow to import,
             `HEAVY`) when it is imported, and the imported one does: train.py's and the
             tools' command lines answer `--help` and config errors, and choose jax's
             platforms (`platforms.choose()`), before jax starts
  optional   an optional dependency (an extra of pyproject.toml, or a peer checked out by hand)
  version    an API that only some jax versions or platforms have
"""
from __future__ import annotations

import ast
import dataclasses
import gc
import os
import re
import sys
from collections.abc import Iterable

from trainer.config.cli import CliParser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARTS = ("kernels", "data", "sharding", "optim", "models", "trainer", "configs", "tools",
         "experiments", "bench")
SKIP_DIRS = {"tests", "docs", "notebooks", "runs", "__pycache__"}
# Slow to import (a second or more): jax, what imports it, and tensorboardX.
HEAVY = {"jax", "jaxlib", "flax", "optax", "orbax", "chex", "tensorstore", "grain", "tensorboardX"}
OPTIONAL = {"matplotlib", "torch", "transformers", "wandb", "lm_eval", "datasets", "pyarrow",
            "libtpu", "nanodo", "mnist1d"}
VERSION = ("jax._src.",)
REASONS = ("start-up", "optional", "version")
# The core reading path: what one step of training is, end to end.
READING_PATH = (
    ("model", "models/llama.py"),
    ("rules", "sharding/rules.py"),
    ("step", "trainer/step/train_step.py"),
    ("loop", "trainer/run/loop.py"),
    ("data order", "data/windows.py"),
    ("checkpoint", "trainer/checkpoint/persistent.py"),
)


@dataclasses.dataclass(frozen=True)
class Import:
  importer: str  # module name
  target: str  # in-repo module name, or the third-party name as written
  line: int
  function_level: bool
  comment: str
  in_repo: bool


def modules(root: str = ROOT) -> dict[str, str]:
  """{module name: path relative to `root`} of every Python file outside tests and docs."""
  out = {}
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in SKIP_DIRS)
    for name in filenames:
      if name.endswith(".py"):
        path = os.path.relpath(os.path.join(dirpath, name), root)
        module = path[:-3].replace(os.sep, ".")
        out[module.removesuffix(".__init__")] = path
  return out


def parse(text: str, path: str) -> ast.Module:
  """`ast.parse` with the garbage collector paused: on Python 3.11 a finalizer that runs during
  the parse and formats a traceback (an asyncio task whose exception nobody read: 3.11's
  traceback module parses the failing line) breaks the outer parse with "SystemError: AST
  constructor recursion depth mismatch"."""
  was = gc.isenabled()
  gc.disable()
  try:
    return ast.parse(text, path)
  finally:
    if was:
      gc.enable()


def _resolve(name: str, known: dict[str, str]) -> str | None:
  while name and name not in known:
    name = name.rpartition(".")[0]
  return name or None


def _absolute(node: ast.ImportFrom, module: str, path: str) -> str:
  """The absolute module a `from X import ...` names: X itself, or a relative X (`from ..run
  import loop`) resolved against the importer's package, as Python does."""
  if not node.level:
    return node.module
  package = module if os.path.basename(path) == "__init__.py" else module.rpartition(".")[0]
  parts = package.split(".") if package else []
  base = ".".join(parts[:len(parts) - node.level + 1]) if node.level <= len(parts) else ""
  return ".".join(p for p in (base, node.module) if p)


def imports(root: str = ROOT) -> list[Import]:
  """Every import statement of every module, with where it stands and its comment."""
  known = modules(root)
  out = []
  for module, path in known.items():
    with open(os.path.join(root, path)) as f:
      lines = f.read().splitlines()
    tree = parse("\n".join(lines), path)

    def visit(node, in_function: bool):
      for child in ast.iter_child_nodes(node):
        inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
        if isinstance(child, ast.Import):
          written = [(a.name, a.name) for a in child.names]
        elif isinstance(child, ast.ImportFrom) and (child.level or child.module):
          base = _absolute(child, module, path)
          written = [(f"{base}.{a.name}" if base else a.name, base or a.name)
                     for a in child.names]
        else:
          written = []
        comment = lines[child.lineno - 1].partition("#")[2].strip() if written else ""
        for name, third_party in written:
          target = _resolve(name, known)
          out.append(Import(module, target or third_party, child.lineno, in_function, comment,
                            target is not None))
        visit(child, inside)

    visit(tree, False)
  return out


def _parents(module: str) -> list[str]:
  """The packages Python imports before `module` itself ("a.b.c" -> "a", "a.b")."""
  parts = module.split(".")
  return [".".join(parts[:i]) for i in range(1, len(parts))]


def graph(found: Iterable[Import], *, function_level: bool = True) -> dict[str, set[str]]:
  """{module: in-repo modules it imports}, function-level imports included unless
  `function_level` is False."""
  edges: dict[str, set[str]] = {}
  for i in found:
    edges.setdefault(i.importer, set())
    if i.in_repo and i.target != i.importer and (function_level or not i.function_level):
      edges[i.importer].add(i.target)
  return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
  """The import cycles: strongly connected components of more than one module (Tarjan)."""
  index, low, stack, on_stack, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(edges.get(v, ())):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        out.append(sorted(component))

  sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
  for v in sorted(edges):
    if v not in index:
      visit(v)
  return out


def imports_jax(found: list[Import]) -> dict[str, bool]:
  """{module: whether importing it imports jax} through module-level imports alone (importing
  a module runs its packages' `__init__` first: those count too)."""
  heavy_direct = {i.importer for i in found
                  if not i.function_level and not i.in_repo and i.target.split(".")[0] in HEAVY}
  edges = graph(found, function_level=False)

  def heavy(m: str) -> bool:
    seen, todo = set(), [m]
    while todo:
      x = todo.pop()
      if x in heavy_direct:
        return True
      if x not in seen:
        seen.add(x)
        todo.extend([*_parents(x), *edges.get(x, ())])
    return False

  return {m: heavy(m) for m in edges}


# ------------------------------------------------------------------------------------------------
# The dependency order, as the README states it


def part(module: str) -> str:
  """The part of the layout a module belongs to: a top-level folder, train.py, or a room of
  trainer/ ("trainer.run", "trainer.errors", ...)."""
  pieces = module.split(".")
  return "trainer." + pieces[1] if pieces[0] == "trainer" and len(pieces) > 1 else pieces[0]


def read_order(readme: str) -> tuple[dict[str, int], dict[str, int]]:
  """The README's dependency order, ({part: level}, {trainer room: level}), from its block

      ```text
      # dependency order ...
      kernels, data < sharding < ...
      trainer/: errors < config < ...
      ```
  """
  m = re.search(r"```text\n# dependency order[^\n]*\n(.*?)```", readme, re.S)
  if not m:
    raise ValueError("README.md has no ```text block starting '# dependency order'")
  parts: dict[str, int] = {}
  rooms: dict[str, int] = {}
  for line in m.group(1).splitlines():
    line = line.split("#")[0].strip()
    into, prefix = (rooms, "trainer.") if line.startswith("trainer/:") else (parts, "")
    line = line.removeprefix("trainer/:")
    for level, names in enumerate(line.split("<") if line else []):
      for name in names.split(","):
        into[prefix + name.strip().removesuffix(".py")] = level
  return parts, rooms


def forbidden(edges: dict[str, set[str]], order: tuple[dict[str, int], dict[str, int]]
              ) -> list[str]:
  """Arrows the order forbids: a part imports only parts of lower levels; between two rooms of
  trainer/ the rooms' order decides, otherwise each room counts as trainer."""
  parts, rooms = order
  out = set()
  for a, targets in edges.items():
    for b in targets:
      pa, pb = part(a), part(b)
      ta, tb = pa.split(".")[0], pb.split(".")[0]
      if pa == pb or pb == "trainer":  # the trainer package itself holds nothing
        continue
      levels, ka, kb = (rooms, pa, pb) if ta == tb == "trainer" else (parts, ta, tb)
      if ka not in levels or kb not in levels:
        out.add(f"{ka if ka not in levels else kb} is not in the README's dependency order")
      elif levels[ka] <= levels[kb]:
        out.add(f"{pa} -> {pb} ({a} -> {b})")
  return sorted(out)


def unjustified(found: list[Import]) -> list[str]:
  """Function-level imports whose comment gives no reason, or a reason that does not hold."""
  heavy = imports_jax(found)
  out = []
  for i in found:
    if not i.function_level:
      continue
    reason = next((r for r in REASONS if r in i.comment), None)
    where = f"{i.importer}:{i.line} imports {i.target}"
    top = i.target.split(".")[0]
    target_heavy = heavy.get(i.target, False) if i.in_repo else top in HEAVY
    if reason is None:
      out.append(f"{where} inside a function, with no reason ({', '.join(REASONS)})")
    elif reason == "start-up" and (heavy.get(i.importer, False) or not target_heavy):
      out.append(f"{where}: 'start-up' does not hold (" + (
          f"{i.importer} imports jax anyway)" if heavy.get(i.importer) else
          f"{i.target} does not import jax)"))
    elif reason == "optional" and (i.in_repo or top not in OPTIONAL):
      out.append(f"{where}: 'optional', but {top} is not an optional dependency")
    elif reason == "version" and not i.target.startswith(VERSION):
      out.append(f"{where}: 'version', but {i.target} is a stable API")
  return out


# ------------------------------------------------------------------------------------------------
# The reading path


def code_lines(path: str) -> tuple[int, int]:
  """(lines, lines of code: not blank, not a comment, not a docstring) of a file."""
  with open(path) as f:
    text = f.read()
  lines = text.splitlines()
  doc = set()
  for node in ast.walk(parse(text, path)):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) \
        and node.body and isinstance(node.body[0], ast.Expr) \
        and isinstance(node.body[0].value, ast.Constant) \
        and isinstance(node.body[0].value.value, str):
      doc.update(range(node.body[0].lineno, node.body[0].end_lineno + 1))
  code = sum(1 for n, line in enumerate(lines, 1)
             if line.strip() and not line.strip().startswith("#") and n not in doc)
  return len(lines), code


def reading_path(root: str = ROOT) -> list[tuple[str, str, int, int]]:
  """[(what, file, lines, lines of code)] of the core reading path."""
  return [(what, path, *code_lines(os.path.join(root, path))) for what, path in READING_PATH]


def problems(root: str = ROOT) -> list[str]:
  """Everything the layout breaks: cycles, forbidden arrows, unjustified function-level imports."""
  found = imports(root)
  edges = graph(found)
  with open(os.path.join(root, "README.md")) as f:
    orders = read_order(f.read())
  return ([f"import cycle: {' <-> '.join(c)}" for c in cycles(edges)]
          + [f"forbidden arrow: {a}" for a in forbidden(edges, orders)]
          + unjustified(found))


def build_parser():
  parser = CliParser("-m tools.layout", __doc__, config=False)
  parser.add_argument("root", nargs="?", default=ROOT, help="the repository (default: this one)")
  return parser


def main(argv: list[str]) -> int:
  args, _ = build_parser().parse(argv)
  root = args.root
  found = imports(root)
  known = modules(root)
  size = {}
  for module, path in known.items():
    size.setdefault(part(module), [0, 0])
    size[part(module)][0] += 1
    size[part(module)][1] += code_lines(os.path.join(root, path))[0]
  print("parts (modules, lines):")
  for name in sorted(size):
    print(f"  {name:22s} {size[name][0]:3d} {size[name][1]:6,d}")
  statements = {(i.importer, i.line): i.comment for i in found if i.function_level}
  print(f"imports inside functions: {len(statements)} ("
        + ", ".join(f"{r} {sum(r in c for c in statements.values())}" for r in REASONS) + ")")
  print("core reading path:")
  rows = reading_path(root)
  for what, path, lines, code in rows:
    print(f"  {what:12s} {path:36s} {lines:5d} lines, {code:5d} of code")
  print(f"  {'total':12s} {'':36s} {sum(r[2] for r in rows):5d} lines, "
        f"{sum(r[3] for r in rows):5d} of code")
  found_problems = problems(root)
  for p in found_problems:
    print(f"problem: {p}")
  print(f"{len(found_problems)} problem(s)")
  return 1 if found_problems else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
