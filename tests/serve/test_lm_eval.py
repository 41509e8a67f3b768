"""lm-evaluation-harness against the served app (`local-completions`, speculation on) and against transformers
(`hf`) on the same tiny fp32 weights: two local tasks, one `loglikelihood` (multiple choice, scored with echo and
logprobs) and one `generate_until`; their scores and every sample's answers are equal. Slow: `pytest -m slow`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.serve.conftest import API_KEY, MODEL, ServedApp
from tests.unit.helpers import question_texts

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval[api] is an optional test dependency (pip install 'lm-eval[api]')")

pytestmark = pytest.mark.slow

CHOICE_TASK = """task: specfleet_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
GEN_TASK = """task: specfleet_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["."]
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
"""
WORDS = ("red", "green", "blue", "yellow")


def write_tasks(root: Path) -> Path:
    """The two tasks and their data, built from the test prompts' texts."""
    texts = question_texts()
    choice = [{"question": t, "choices": [f" {w}" for w in WORDS], "answer": i % len(WORDS)}
              for i, t in enumerate(texts[:8])]
    gen = [{"prompt": t, "target": " yes"} for t in texts[:6]]
    for name, rows, template in (("choice", choice, CHOICE_TASK), ("gen", gen, GEN_TASK)):
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (root / f"{name}.yaml").write_text(template.format(data=data))
    return root


def evaluate(model: str, model_args: dict, include: Path) -> dict:
    from lm_eval.tasks import TaskManager
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["specfleet_choice", "specfleet_gen"],
                                   task_manager=TaskManager(include_path=str(include)), log_samples=True,
                                   batch_size=1, device="cpu")


def compare(served: dict, hf: dict) -> list[tuple]:
    """Each task's (task, metric, hf score, served score, samples with equal answers, samples, largest difference
    of a loglikelihood)."""
    rows = []
    for task, metric in (("specfleet_choice", "acc,none"), ("specfleet_gen", "exact_match,none")):
        s_samples, h_samples = served["samples"][task], hf["samples"][task]
        assert len(s_samples) == len(h_samples) > 0
        equal, worst = 0, 0.0
        for s, h in zip(s_samples, h_samples):
            if task == "specfleet_choice":  # (loglikelihood, is_greedy) per choice
                pairs = list(zip([r[0] for r in s["resps"]], [r[0] for r in h["resps"]]))
                worst = max([worst] + [abs(a[0] - b[0]) for a, b in pairs])
                equal += all(abs(a[0] - b[0]) < 1e-3 and a[1] == b[1] for a, b in pairs)
            else:
                equal += s["resps"] == h["resps"]
        rows.append((task, metric, hf["results"][task][metric], served["results"][task][metric], equal,
                     len(s_samples), worst))
    return rows


def table(rows: list[tuple]) -> str:
    lines = ["| task | metric | hf | served | samples with equal answers | max loglikelihood difference |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {t} | {m} | {h:.4f} | {s:.4f} | {e}/{n} | {w:.1e} |" for t, m, h, s, e, n, w in rows]
    return "\n".join(lines)


def test_lm_eval_scores_of_the_served_app_equal_transformers(served_app: ServedApp, tmp_path: Path,
                                                             monkeypatch) -> None:
    include = write_tasks(tmp_path)
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    served = evaluate("local-completions", {"model": MODEL, "base_url": f"{served_app.url}/v1/completions",
                                            "tokenizer_backend": "huggingface", "tokenizer": str(served_app.target),
                                            "max_retries": 1}, include)
    hf = evaluate("hf", {"pretrained": str(served_app.target), "dtype": "float32"}, include)
    rows = compare(served, hf)
    print("\n" + table(rows))
    for _, _, h, s, equal, n, _ in rows:
        assert h == s and equal == n


def main() -> None:
    """The same comparison against a running app: `python -m tests.serve.test_lm_eval URL MODEL HF_DIR` with
    $OPENAI_API_KEY set to an API key of the app (docs/benchmarks.md)."""
    import sys
    import tempfile
    url, model, hf_dir = sys.argv[1:4]
    include = write_tasks(Path(tempfile.mkdtemp()))
    served = evaluate("local-completions", {"model": model, "base_url": f"{url}/v1/completions",
                                            "tokenizer_backend": "huggingface", "tokenizer": hf_dir,
                                            "max_retries": 1}, include)
    hf = evaluate("hf", {"pretrained": hf_dir, "dtype": "float32"}, include)
    print(table(compare(served, hf)))


if __name__ == "__main__":
    main()
