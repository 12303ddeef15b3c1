"""Turn text into tokenized shards that the training pipeline reads.

    python -m data.prepare --out DIR                        # the default corpus (Python stdlib)
    python -m data.prepare --out DIR a.txt docs/ b.jsonl c.parquet saved_hf_dataset/
    python -m data.prepare --out DIR --tokenizer path/to/tokenizer.json FILES...  # or an HF
                                                  # model dir, or a SentencePiece .model
    python -m data.prepare --out DIR --train_tokenizer bpe:4096 [FILES...]  # train a BPE first

DIR holds per split its shards (`train-*.bin` / `.idx`: token ids back to back, uint16 or
uint32, and each document's end offset; data/shards.py), `tokenizer/` and `meta.json`. Inputs:
data/sources.py. Work happens in `DIR.partial/`, one set of shards per unit of input
(`--workers` in parallel), renamed to DIR at the end: a rerun redoes only what had not
finished, and a DIR that holds anything is refused. User errors: one line, exit status 2.
Details: docs/data.md#inputs-and-tokenizers
"""
from __future__ import annotations

import argparse
import concurrent.futures
import fcntl
import hashlib
import multiprocessing
import os
import shutil
import sys

from tqdm import tqdm

from data import corpus, shards, sources
from data import tokenizer as tokenizers
from data.meta import FORMAT_VERSION, DataError, read_meta
from data.shards import COUNTS, SPLITS, ShardWriter, read_json, shard_files, split_of, write_json
from data.sources import SourceError, Unit
from data.tokenizer import TokenizerError
from data.tokens import SplitTokens


# ----------------------------------------------------------------------------------------------
# The whole preparation


def _setup_tokenizer(work: str, spec: str, units: list[Unit], plan: dict) -> dict:
  """Put the tokenizer's files into work/tokenizer/ (training a BPE if asked); its meta entry."""
  if spec == "byte":
    return tokenizers.describe(tokenizers.ByteTokenizer())
  tok_dir = os.path.join(work, "tokenizer")
  if spec.startswith("bpe:"):
    try:
      vocab = int(spec[4:])
    except ValueError:
      raise DataError(f"--train_tokenizer {spec!r}: expected bpe:VOCAB, e.g. bpe:4096") from None
    path = os.path.join(tok_dir, "tokenizer.json")
    if os.path.exists(path):  # trained before an interruption
      return tokenizers.describe(tokenizers.HFTokenizer(path), work)
    texts = (d.text for u in units for d in sources.documents(u, plan["text_field"])
             if split_of(d.key, plan["split_rule"], plan["validation_fraction"]) == "train")
    tok = tokenizers.train_bpe(texts, vocab, tok_dir + ".tmp")
    os.replace(tok_dir + ".tmp", tok_dir)
    return tokenizers.describe(tokenizers.HFTokenizer(path), work)
  tok = tokenizers.from_path(spec)
  shutil.rmtree(tok_dir, ignore_errors=True)
  os.makedirs(tok_dir)
  for f in tok.files():
    shutil.copy(f, tok_dir)
  info = tokenizers.describe(tok)
  info["files"] = [os.path.join("tokenizer", os.path.basename(f)) for f in tok.files()]
  info["source"] = os.path.abspath(spec)
  return info


def prepare(out_dir: str, units: list[Unit], *, source: dict, tokenizer: str = "byte",
            split_rule: str = "hash", validation_fraction: float = 0.01,
            text_field: str = "text", workers: int = 1) -> str:
  """Tokenize `units` into the prepared directory `out_dir` (see the module docstring).

  Every step can be interrupted and the same call run again: the work lives in `out_dir.partial`
  with the plan of the call (plan.json); each unit's shards are complete once its done-*.json
  exists, the move of a document to validation once moved.json exists, and the whole once
  meta.json exists; the files that meta.json does not name are removed only after that, the
  directory is renamed to `out_dir`, and its plan.json removed last."""
  work = os.path.abspath(out_dir).rstrip("/") + ".partial"
  plan = {"format": FORMAT_VERSION, "units": [dataclasses_asdict(u) for u in units],
          "tokenizer_spec": tokenizer, "split_rule": split_rule, "text_field": text_field,
          "validation_fraction": validation_fraction}
  finished_plan = os.path.join(out_dir, "plan.json")
  if os.path.exists(os.path.join(out_dir, "meta.json")) and read_json(finished_plan) == plan:
    os.remove(finished_plan)  # killed after its rename: only the plan was left to remove
    return out_dir
  _refuse_existing(out_dir)
  if not 0 <= validation_fraction < 1:
    raise DataError(f"--validation_fraction={validation_fraction}: must be in [0, 1)")
  if not units:
    raise DataError("data.prepare: no input documents found")
  plan_path = os.path.join(work, "plan.json")
  if os.path.exists(work) and read_json(plan_path) != plan:
    shutil.rmtree(work)  # another preparation was interrupted here, or this one's clean-up
  os.makedirs(work, exist_ok=True)
  write_json(plan_path, plan)
  if not os.path.exists(os.path.join(work, "meta.json")):
    write_json(os.path.join(work, "meta.json"), _tokenize(work, units, plan, source, workers))
  meta = read_meta(work)
  named = {"meta.json", "plan.json"} | {f.split(os.sep)[0] for f in meta["tokenizer"]["files"]}
  named |= {f for split in meta["splits"].values() for e in split["shards"]
            for f in shard_files(e)}
  for name in sorted(set(os.listdir(work)) - named):  # done-*, moved.json, replaced shards
    path = os.path.join(work, name)
    if os.path.isdir(path):  # a BPE trained before an interruption (tokenizer.tmp)
      shutil.rmtree(path)
    else:
      os.remove(path)
  try:
    os.rename(work, out_dir)
  except OSError:
    if not os.path.exists(os.path.join(out_dir, "meta.json")):
      raise
    shutil.rmtree(work)  # someone else finished the same corpus first; theirs is identical
    return out_dir
  os.remove(finished_plan)
  return out_dir


def _tokenize(work: str, units: list[Unit], plan: dict, source: dict, workers: int) -> dict:
  """Tokenize the units that are not done yet (in `work`); the meta.json of the whole."""
  tok_info = _setup_tokenizer(work, plan["tokenizer_spec"], units, plan)
  dtype = tokenizers.storage_dtype(tok_info["vocab_size"])
  job = {**plan, "tokenizer": tok_info, "token_dtype": dtype}
  pending = [i for i in range(len(units))
             if not os.path.exists(os.path.join(work, f"done-{i:05d}.json"))]
  _run_units(work, units, pending, job, workers)
  counts = [read_json(os.path.join(work, f"done-{i:05d}.json")) for i in range(len(units))]
  splits = {s: {"shards": [e for c in counts for e in c[s]["shards"]],
                **{k: sum(c[s][k] for c in counts) for k in COUNTS}} for s in SPLITS}
  if splits["train"]["documents"] + splits["validation"]["documents"] == 0:
    raise DataError("data.prepare: the inputs hold no documents")
  if splits["train"]["documents"] == 0:  # every document hashed to validation: train on them
    splits["train"] = splits["validation"]
    splits["validation"] = {"shards": [], **dict.fromkeys(COUNTS, 0)}
  if splits["validation"]["documents"] == 0:
    splits = _move_to_validation(work, splits, tokenizers.from_meta(tok_info, work), dtype,
                                 plan["validation_fraction"] or 0.01)
  return {"format": FORMAT_VERSION, "tokenizer": tok_info, "token_dtype": dtype,
          "vocab_size": tok_info["vocab_size"], "bos_id": tok_info["bos_id"],
          "eos_id": tok_info["eos_id"], "pad_id": tok_info["pad_id"], "source": source,
          "validation_fraction": plan["validation_fraction"], "splits": splits,
          "cleaned_documents": sum(c.get("cleaned", 0) for c in counts)}


def dataclasses_asdict(unit: Unit) -> dict:
  d = {k: getattr(unit, k) for k in Unit.__dataclass_fields__}
  d["paths"] = list(d["paths"])
  return d


def _run_units(work: str, units: list[Unit], pending: list[int], job: dict, workers: int):
  bar = tqdm(total=len(units), initial=len(units) - len(pending), desc="prepare", unit="shard",
             disable=None, leave=False)
  try:
    if workers <= 1 or len(pending) <= 1:
      for i in pending:
        shards.write_unit(work, i, units[i], job)
        bar.update()
      return
    ctx = multiprocessing.get_context("spawn")  # safe whatever threads the parent runs
    with concurrent.futures.ProcessPoolExecutor(min(workers, len(pending)), ctx) as pool:
      futures = [pool.submit(shards.write_unit, work, i, units[i], job) for i in pending]
      for fut in concurrent.futures.as_completed(futures):
        fut.result()
        bar.update()
  finally:
    bar.close()


def _move_to_validation(work: str, splits: dict, tok, dtype: str, fraction: float) -> dict:
  """The splits after giving an empty validation split the last training document (or, when
  there is only one document, its last `fraction` of tokens).

  Restartable: the shard it takes the document from is left as it is; the rest of that shard
  and the moved document go to new shards (train-kept, validation-moved), and then moved.json
  records the new splits, which is the switch. A rerun after the switch reads moved.json; one
  before it redoes the move from the untouched shard. `prepare` removes the old shard once
  meta.json names the new ones."""
  done = read_json(os.path.join(work, "moved.json"))
  if done is not None:
    return done
  train = splits["train"]
  last = {**train, "shards": train["shards"][-1:]}
  shard = SplitTokens(work, "train", f"the shard {last['shards'][0]['name']}",
                      meta={"token_dtype": dtype, "splits": {"train": last}})
  records = list(shard.documents())
  if train["documents"] >= 2:
    keep, moved = records[:-1], [records[-1]]
  else:
    ids = records[0]
    if len(ids) < 4:
      raise DataError("data.prepare: the corpus is a single document too short to split into "
                      "train and validation; give more text")
    cut = min(len(ids) - 2, max(2, round(len(ids) * (1 - fraction))))
    keep, moved = [ids[:cut]], [ids[cut:]]

  def count(docs):
    return {"documents": len(docs), "tokens": sum(map(len, docs)),
            "targets": sum(len(d) - 1 for d in docs),
            "bytes": sum(len(tok.decode(d).encode("utf-8")) for d in docs)}

  before, after, gone = count(records), count(keep), count(moved)
  new_shards = {}
  for name, docs in (("train-kept", keep), ("validation-moved", moved)):
    if docs:  # no train-kept when the shard held only the moved document
      writer = ShardWriter(work, name, dtype)
      for d in docs:
        writer.write(d)
      new_shards[name] = writer.close()
  new = {"train": {**{k: train[k] + after[k] - before[k] for k in COUNTS},
                   "shards": train["shards"][:-1] + [e for n, e in new_shards.items()
                                                     if n.startswith("train")]},
         "validation": {**gone, "shards": [new_shards["validation-moved"]]}}
  write_json(os.path.join(work, "moved.json"), new)
  return new


# ----------------------------------------------------------------------------------------------
# The default corpus and user files


def default_data_dir() -> str:
  """Where the default corpus is prepared: `$SCALETRAIN_DATA` or ~/.cache/scaletrain."""
  info = corpus.describe()
  base = os.environ.get("SCALETRAIN_DATA") or os.path.join(
      os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "scaletrain")
  return os.path.join(base, f"stdlib-py{info['python']}-{info['fingerprint']}-f{FORMAT_VERSION}")


def prepare_stdlib(out_dir: str, *, tokenizer: str = "byte", workers: int = 1) -> str:
  root = corpus.stdlib_root()
  paths = [os.path.join(root, f) for f in corpus.stdlib_files(root)]
  return prepare(out_dir, sources.group_files(paths, root), source=corpus.describe(),
                 tokenizer=tokenizer, split_rule="stdlib", workers=workers)


def ensure_default_corpus(data_dir: str = "") -> str:
  """The prepared default corpus (byte-level), preparing it on first use. Processes that start
  together on a fresh machine (two train.py runs, the test suite's workers) take turns on a lock
  file beside it: one prepares, the others find it prepared."""
  data_dir = data_dir or default_data_dir()
  if not os.path.exists(os.path.join(data_dir, "meta.json")):
    os.makedirs(os.path.dirname(os.path.abspath(data_dir)), exist_ok=True)
    with open(os.path.abspath(data_dir).rstrip("/") + ".lock", "w") as lock:
      fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
      if not os.path.exists(os.path.join(data_dir, "meta.json")):
        prepare_stdlib(data_dir)
  return data_dir


def prepare_files(out_dir: str, inputs: list[str], *, text_field: str = "text",
                  validation_fraction: float = 0.01, tokenizer: str = "byte",
                  workers: int = 1) -> str:
  _refuse_existing(out_dir, finishing=True)  # before reading the inputs; prepare() decides
  paths, datasets = sources.expand(inputs)
  if not paths and not datasets:
    raise DataError(f"data.prepare: no input files found in {inputs}")
  # Document keys (which decide the split) are paths relative to the inputs' common folder,
  # so the split does not depend on where the corpus lives.
  root = os.path.dirname(os.path.commonpath([os.path.abspath(p) for p in paths])) if paths else ""
  units = sources.group_files([os.path.abspath(p) for p in paths], root) + [
      u for d in datasets for u in sources.hf_units(d)]
  h = hashlib.sha256("\n".join([f"{p}\t{os.path.getsize(p)}" for p in paths]
                               + datasets).encode())
  source = {"name": "files", "inputs": inputs, "files": len(paths), "datasets": datasets,
            "fingerprint": h.hexdigest()[:16]}
  return prepare(out_dir, units, source=source, tokenizer=tokenizer, text_field=text_field,
                 validation_fraction=validation_fraction, workers=workers)


def _refuse_existing(out_dir: str, finishing: bool = False) -> None:
  """Preparation writes a new directory (renamed into place at the end): an --out that holds
  anything is refused before any work. An empty directory is taken; with `finishing`, also one
  that still holds the plan.json of a preparation killed right after its rename (`prepare`
  finishes it if the plan is this one's, else refuses)."""
  if finishing and os.path.exists(os.path.join(out_dir, "plan.json")):
    return
  if os.path.exists(os.path.join(out_dir, "meta.json")):
    raise DataError(f"{out_dir} already holds prepared data; remove it or choose another --out")
  if os.path.isdir(out_dir) and os.listdir(out_dir):
    entries = sorted(os.listdir(out_dir))
    raise DataError(f"{out_dir} is not empty ({len(entries)} entries, e.g. {entries[0]!r}) and "
                    "holds no prepared data; preparation writes a new directory: remove it or "
                    "choose another --out")
  if os.path.exists(out_dir) and not os.path.isdir(out_dir):
    raise DataError(f"{out_dir} is a file; give a directory that does not exist yet as --out")


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default="", help="output directory (default: the cache dir)")
  parser.add_argument("--tokenizer", default="byte",
                      help="byte, a tokenizer.json, an HF model dir or a SentencePiece .model")
  parser.add_argument("--train_tokenizer", default="",
                      help="bpe:VOCAB trains a byte-level BPE on the inputs' training split")
  parser.add_argument("--text_field", default="text", help="JSONL/Parquet/dataset text field")
  parser.add_argument("--validation_fraction", type=float, default=0.01)
  parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
  parser.add_argument("inputs", nargs="*", help="files, directories, globs, saved HF datasets, "
                      "hf:NAME[:CONFIG][@SPLIT]; none = the Python stdlib")
  return parser


def main(argv=None):
  parser = build_parser()
  args = parser.parse_args(argv)
  if args.train_tokenizer and args.tokenizer != "byte":
    parser.error("give --tokenizer or --train_tokenizer, not both")
  tok = args.train_tokenizer or args.tokenizer
  try:
    if args.inputs:
      if not args.out:
        parser.error("--out is required when preparing your own files")
      out = prepare_files(args.out, args.inputs, text_field=args.text_field, tokenizer=tok,
                          validation_fraction=args.validation_fraction, workers=args.workers)
    elif tok == "byte":
      out = args.out or default_data_dir()
      if not os.path.exists(os.path.join(out, "meta.json")):
        prepare_stdlib(out, workers=args.workers)
    else:
      if not args.out:
        parser.error("--out is required with a tokenizer other than byte")
      out = prepare_stdlib(args.out, tokenizer=tok, workers=args.workers)
  except (DataError, SourceError, TokenizerError) as e:
    print(f"error: {e}", file=sys.stderr)
    raise SystemExit(2) from None
  meta = read_meta(out)
  t = meta["tokenizer"]
  counts = ", ".join(f"{s}: {v['documents']} docs / {v['tokens']:,} tokens / {v['bytes']:,} "
                     f"bytes" for s, v in meta["splits"].items())
  print(f"prepared {out} ({counts}); tokenizer {t['kind']} vocab {t['vocab_size']:,}, "
        f"{meta['splits']['train']['bytes'] / max(meta['splits']['train']['tokens'], 1):.2f} "
        "bytes/token")
  if meta.get("cleaned_documents"):
    print(f"{meta['cleaned_documents']:,} documents held invalid Unicode (bytes that are not "
          "UTF-8, or lone surrogates such as a JSON \\ud83d); each such character is now U+FFFD")


if __name__ == "__main__":
  main()
