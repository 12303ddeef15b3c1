"""The lm-evaluation-harness adapter: its three request types against direct computation, and a
whole harness run on local task files (no downloads). Needs the `lm-eval` extra."""
import json

import jax
import numpy as np
import pytest

pytest.importorskip("lm_eval", reason="needs the `lm-eval` extra")

from lm_eval.api.instance import Instance  # noqa: E402

from data import tokenizer  # noqa: E402
from tests.conftest import tiny_config  # noqa: E402
from tools.lm_eval_adapter import ScaletrainLM  # noqa: E402
from trainer.run.loop import Run  # noqa: E402


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("lmeval") / "run")
  Run(tiny_config(steps=2), workdir).train()
  return ScaletrainLM(workdir, batch_size=4, max_length=32)


def req(kind, *args):
  return Instance(request_type=kind, doc={}, arguments=args, idx=0)


def direct_logprobs(lm, tokens):
  """log p(tokens[i] | tokens[:i]) for i >= 1, from one forward of the whole sequence."""
  logits = np.asarray(jax.jit(lambda p, t: lm.spec.model(p)(t))(lm.params,
                                                                 np.asarray([tokens[:-1]])))[0]
  logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
      - logits.max(-1, keepdims=True)
  return logp[np.arange(len(tokens) - 1), tokens[1:]], logits.argmax(-1) == tokens[1:]


def test_loglikelihood_and_rolling_match_direct_computation(lm):
  ctx, cont = "def main(", "argv):"
  (ll, greedy), = lm.loglikelihood([req("loglikelihood", ctx, cont)])
  tokens = list(tokenizer.encode(ctx + cont, eos=False))
  logp, is_greedy = direct_logprobs(lm, tokens)
  assert ll == pytest.approx(float(logp[-len(cont):].sum()), rel=1e-5)
  assert greedy == bool(is_greedy[-len(cont):].all())

  text = "import os\nimport sys\n" * 4  # 89 tokens: three windows of 32
  (rolling,) = lm.loglikelihood_rolling([req("loglikelihood_rolling", text)])
  tokens = np.asarray(tokenizer.encode(text, eos=False))
  expected = 0.0
  for start in range(0, len(tokens) - 1, 32):
    w = tokens[start:start + 33]
    expected += float(direct_logprobs(lm, list(w))[0].sum())
  assert rolling == pytest.approx(expected, rel=1e-5)


def test_generate_until_stops_at_the_stop_string(lm):
  (full,) = lm.generate_until([req("generate_until", "import ", {"max_gen_toks": 12})])
  assert len(full) > 2
  stop = full[2]
  (cut,) = lm.generate_until([req("generate_until", "import ",
                                  {"until": [stop], "max_gen_toks": 12})])
  assert cut == full[:full.index(stop)]


def write_tasks(tmp_path):
  """Three task YAMLs over a local jsonl file: multiple choice, rolling perplexity, generation."""
  docs = [{"question": f"{a} + {b} =", "choices": [f" {a + b}", f" {a + b + 1}"], "answer": 0,
           "text": f"{a} plus {b} is {a + b}."} for a, b in [(1, 2), (3, 4), (2, 2), (5, 1)]]
  data = tmp_path / "docs.jsonl"
  data.write_text("\n".join(json.dumps(d) for d in docs))
  common = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
            "test_split: test\n")
  (tmp_path / "mc.yaml").write_text(
      "task: local_mc\n" + common + "output_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
      "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\n"
      "metric_list:\n  - metric: acc\n")
  (tmp_path / "ppl.yaml").write_text(
      "task: local_ppl\n" + common + "output_type: loglikelihood_rolling\ndoc_to_text: ''\n"
      "doc_to_target: '{{text}}'\nmetric_list:\n  - metric: word_perplexity\n"
      "  - metric: bits_per_byte\n")
  (tmp_path / "gen.yaml").write_text(
      "task: local_gen\n" + common + "output_type: generate_until\ndoc_to_text: '{{question}}'\n"
      "doc_to_target: '{{choices[0]}}'\ngeneration_kwargs:\n  until: ['\\n']\n"
      "  max_gen_toks: 4\nmetric_list:\n  - metric: exact_match\n")
  return docs


@pytest.fixture
def offline(monkeypatch):
  monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_harness_runs_local_tasks(lm, tmp_path, offline):
  import lm_eval
  from lm_eval.tasks import TaskManager
  docs = write_tasks(tmp_path)
  results = lm_eval.simple_evaluate(
      model=lm, tasks=["local_mc", "local_ppl", "local_gen"],
      task_manager=TaskManager(include_path=str(tmp_path)), bootstrap_iters=0,
      log_samples=False)["results"]
  # The harness's accuracy is what our loglikelihoods say (choices follow a " " delimiter).
  lls = [[lm.loglikelihood([req("loglikelihood", d["question"], " " + c)])[0][0]
          for c in d["choices"]] for d in docs]
  assert results["local_mc"]["acc,none"] == pytest.approx(
      np.mean([int(np.argmax(ll) == 0) for ll in lls]))
  assert results["local_ppl"]["bits_per_byte,none"] > 0
  assert "exact_match,none" in results["local_gen"]


@pytest.mark.slow  # the default run keeps test_harness_runs_local_tasks
def test_harness_cli_with_the_registered_model(lm, tmp_path, offline, capsys):
  from tools import lm_eval_adapter
  write_tasks(tmp_path)
  lm_eval_adapter.main(["--model_args", f"checkpoint={lm.checkpoint},max_length=32",
                        "--batch_size", "4",
                        "--tasks", "local_mc", "--include_path", str(tmp_path)])
  out = capsys.readouterr().out
  assert "local_mc" in out and "acc" in out
