"""lm-evaluation-harness against the router, as its users run it: the `local-completions` model
with the remote tokenizer (the router's /tokenizer_info, /tokenize and /detokenize; no
transformers, no torch), scoring a multiple-choice task from a local file by loglikelihood.
Each request's loglikelihood must equal the sum of its continuation's token logprobs that the
router reports for the whole text scored directly (echo, logprobs, max_tokens 0), so that no
continuation token is lost (the last one was dropped whenever the greedy next token was eos),
and its accuracy must be what those sums pick.

Usage: lm_eval_check.py BASE_URL API_KEY MODEL (BASE_URL ends in /v1)
"""

import json
import math
import os
import sys
import tempfile
import urllib.request

import lm_eval

BASE, KEY, MODEL = sys.argv[1], sys.argv[2], sys.argv[3]
ROOT = BASE[: -len("/v1")]

QUESTIONS = [
    ("In the beginning God created the", ["heaven", "car", "table"], 0),
    ("And God said, Let there be", ["light", "rain", "cheese"], 0),
    ("The history of the city begins", ["with", "purple", "seven"], 0),
    ("Water boils at one hundred degrees", ["Celsius", "banana", "north"], 0),
    ("She opened the door and saw", ["a", "the", "nothing"], 1),
]


def post(path, body):
    req = urllib.request.Request(
        ROOT + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": "Bearer " + KEY},
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def tokens(text):
    return post("/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"]


def direct_loglikelihood(context, continuation):
    """The continuation's summed logprob, from the router's echo of the whole text."""
    ctx, whole = tokens(context), tokens(context + continuation)
    assert whole[: len(ctx)] == ctx, (context, continuation)
    out = post(
        "/v1/completions",
        {"model": MODEL, "prompt": whole, "max_tokens": 0, "echo": True, "logprobs": 1},
    )
    lps = out["choices"][0]["logprobs"]["token_logprobs"]
    assert len(lps) == len(whole), (len(lps), len(whole))
    return sum(lps[len(ctx):])


def main():
    tmp = tempfile.mkdtemp(prefix="fmoe-lm-eval-")
    data = os.path.join(tmp, "questions.jsonl")
    with open(data, "w") as f:
        for q, choices, answer in QUESTIONS:
            f.write(json.dumps({"question": q, "choices": choices, "answer": answer}) + "\n")
    with open(os.path.join(tmp, "fmoe_mc.yaml"), "w") as f:
        f.write(
            "task: fmoe_mc\n"
            "dataset_path: json\n"
            "dataset_kwargs:\n"
            f"  data_files:\n    test: {data}\n"
            "test_split: test\n"
            "output_type: multiple_choice\n"
            "doc_to_text: '{{question}}'\n"
            "doc_to_choice: '{{choices}}'\n"
            "doc_to_target: '{{answer}}'\n"
            "target_delimiter: ' '\n"
            "metric_list:\n  - metric: acc\n"
        )
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={
            "model": MODEL,
            "base_url": BASE + "/completions",
            "tokenizer_backend": "remote",
            "tokenized_requests": True,
            "num_concurrent": 1,
            "max_retries": 1,
            # The API key: for the completions (the header) and for the remote tokenizer.
            "header": {"Authorization": "Bearer " + KEY},
            "auth_token": KEY,
        },
        tasks=["fmoe_mc"],
        task_manager=lm_eval.tasks.TaskManager(include_path=tmp),
        log_samples=True,
        apply_chat_template=False,
    )
    samples = results["samples"]["fmoe_mc"]
    assert len(samples) == len(QUESTIONS), len(samples)
    correct = 0
    for s in samples:
        q, choices, answer = QUESTIONS[s["doc_id"]]
        scores = []
        for k, (arg, resp) in enumerate(zip(s["arguments"], s["resps"])):
            context, continuation = arg[0], arg[1]
            got = resp[0][0]
            want = direct_loglikelihood(context, continuation)
            assert math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-4), (q, choices[k], got, want)
            scores.append(want)
        correct += int(max(range(len(scores)), key=lambda k: scores[k]) == answer)
        print(f"{q!r}: {[round(x, 3) for x in scores]}")
    acc = results["results"]["fmoe_mc"]["acc,none"]
    assert math.isclose(acc, correct / len(QUESTIONS)), (acc, correct)
    print(f"acc {acc:.2f} over {len(QUESTIONS)} questions")
    print("all checks passed")


if __name__ == "__main__":
    main()
