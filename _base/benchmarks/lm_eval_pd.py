"""lm-evaluation-harness against `pd launch` (its `local-completions` model over the OpenAI
API) and against `pd.LLM` in this process (a harness model that scores with prompt logprobs),
on two tasks written here from local data, no hub download:

- `pd_python_mc`: multiple choice (loglikelihood): a line of Python and four continuations, the
  right one the standard library's own; accuracy.
- `pd_python_next`: generation until a newline after a line of Python; exact match.

Both ways run the same tasks with the same harness; their figures are printed side by side,
and the per-request answers compared: each loglikelihood's largest difference, and how many
generations are the same text.
The loglikelihood requests go to the router as lm-eval sends them (token ids, `echo`,
`logprobs` 1, `max_tokens` 1).

    python benchmarks/lm_eval_pd.py [--model DIR] [--device cpu]   (needs `pip install lm-eval`)
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

MC = [  # context, the right continuation, three others
    ("def __init__(self", ", *args, **kwargs):", " = None", "]]]", " import os"),
    ("import os\nimport", " sys", " 42", " (", " def"),
    ("for i in range(", "len(self)):", "import", "))))", "class"),
    ("if __name__ ==", " '__main__':", " def", " 0.5.", " import"),
    ("class Error(", "Exception):", "1, 2, 3", "return", "import sys"),
    ("        return", " self", " def", " class", " import"),
    ("    def __repr__(self):\n        return", " '<%s>' % self.name", " import", " class",
     " for for"),
    ("try:\n    import", " _thread", " 123", " def", " return return"),
    ("with open(filename", ", 'rb') as f:", " import", " class", " def def"),
    ("raise ValueError(", "'invalid value'", "import", "class", "def def"),
    ("    @property\n    def", " name(self):", " import", " 42", " ]]"),
    ("except ImportError:\n", "    pass", "import import", "class class", ")))"),
]
NEXT = [  # context, the line the standard library would write next
    ("if __name__ == '__main__':\n", "    main()"),
    ("import os\nimport", " sys"),
    ("class Foo:\n    def __init__(self):\n", "        pass"),
    ("try:\n    import threading\nexcept ImportError:\n", "    import dummy_threading as threading"),
    ("    def __repr__(self):\n", "        return '<%s>' % self.__class__.__name__"),
    ("def main():\n", "    import sys"),
    ("for line in lines:\n", "    line = line.strip()"),
    ("    @property\n    def name(self):\n", "        return self._name"),
]


def write_tasks(root: Path) -> None:
    """The two tasks' data and YAML under `root` (absolute paths inside)."""
    mc = root / "mc.jsonl"
    mc.write_text("".join(json.dumps({"context": c, "choices": list(ch), "answer": 0}) + "\n"
                          for c, *ch in MC))
    nxt = root / "next.jsonl"
    nxt.write_text("".join(json.dumps({"context": c, "target": t}) + "\n" for c, t in NEXT))
    (root / "pd_python_mc.yaml").write_text(f"""task: pd_python_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {mc}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: ""
metric_list:
  - metric: acc
""")
    (root / "pd_python_next.yaml").write_text(f"""task: pd_python_next
dataset_path: json
dataset_kwargs:
  data_files:
    test: {nxt}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: target
target_delimiter: ""
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 24
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
""")


def pd_llm_model(model_dir: str, device: str):
    """A harness model over `pd.LLM` (the harness splits context and continuation into tokens
    as for any causal model): loglikelihoods from prompt logprobs, greedy generation."""
    from lm_eval.api.model import TemplateLM

    from pd.engine.llm import LLM
    from pd.wire.sampling_params import SamplingParams

    class PdLLM(TemplateLM):
        def __init__(self) -> None:
            super().__init__()
            kwargs = {"device": device, "dtype": "float32"} if device != "cpu" else {}
            self.llm = LLM(model_dir, **kwargs)
            self.tok = self.llm.tokenizer

        @property
        def eot_token_id(self) -> int:
            return self.tok.eos_token_ids[0]

        def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
            return self.tok.encode(string)

        def _loglikelihood_tokens(self, requests, **kwargs):
            out = []
            for _, ctx, cont in requests:
                got = self.llm.generate([ctx + cont], SamplingParams(
                    max_tokens=1, temperature=0.0, prompt_logprobs=0))[0].prompt_logprobs
                scored = got[len(ctx) - 1:]  # position p scores token p + 1
                out.append((sum(v for v, _, _ in scored), all(r == 1 for _, r, _ in scored)))
            return out

        def generate_until(self, requests, disable_tqdm: bool = False):
            out = []
            for req in requests:
                context, kwargs = req.args
                text = self.llm.generate([context], SamplingParams(
                    max_tokens=kwargs.get("max_gen_toks", 24), temperature=0.0))[0].text
                for stop in kwargs.get("until", []):
                    text = text.split(stop)[0]
                out.append(text)
            return out

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            raise NotImplementedError("not used by these tasks")

    return PdLLM()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model directory (default: the embedded one)")
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    import lm_eval
    from lm_eval.tasks import TaskManager

    from pd.engine.llm import default_model_dir
    from pd.service.procs import Launch

    model = str(args.model or default_model_dir())
    root = Path(tempfile.mkdtemp(prefix="pd-lm-eval-"))
    write_tasks(root)
    tasks = ["pd_python_mc", "pd_python_next"]
    runs = {}
    launch = Launch(model, "--device", args.device)
    try:
        name = Path(model).name
        runs["pd launch"] = lm_eval.simple_evaluate(
            model="local-completions", tasks=tasks, task_manager=TaskManager(include_path=str(root)),
            model_args=f"model={name},base_url={launch.url}/v1/completions,tokenizer={model},"
                       f"tokenizer_backend=huggingface,num_concurrent=1,max_retries=1",
            log_samples=True)
    finally:
        launch.stop()
    runs["pd.LLM"] = lm_eval.simple_evaluate(
        model=pd_llm_model(model, args.device), tasks=tasks,
        task_manager=TaskManager(include_path=str(root)), log_samples=True)
    results = {k: r["results"] for k, r in runs.items()}
    print(f"\n{'task':>16} | {'metric':>12} | " + " | ".join(f"{k:>10}" for k in results))
    for task in tasks:
        for metric in ("acc,none", "exact_match,none"):
            values = [results[k][task].get(metric) for k in results]
            if values[0] is not None:
                print(f"{task:>16} | {metric.split(',')[0]:>12} | "
                      + " | ".join(f"{v:>10.4f}" for v in values))
    served, local = (runs[k]["samples"] for k in ("pd launch", "pd.LLM"))
    lls = [(a[0], b[0]) for x, y in zip(served["pd_python_mc"], local["pd_python_mc"])
           for a, b in zip(x["resps"], y["resps"])]
    gens = [(x["resps"][0][0], y["resps"][0][0])
            for x, y in zip(served["pd_python_next"], local["pd_python_next"])]
    print(f"loglikelihoods: {len(lls)}, largest difference {max(abs(a[0] - b[0]) for a, b in lls):.2e}, "
          f"greedy flags equal {sum(a[1] == b[1] for a, b in lls)}/{len(lls)}; generations: "
          f"{sum(a == b for a, b in gens)}/{len(gens)} the same text")


if __name__ == "__main__":
    main()
