#!/usr/bin/env python3
"""Prompts for the prefix-caching measurement (bench/RESULTS.md, "Paged KV and prefix caching").

Writes a JSONL of {"prompt": ...} in the order they are sent (fmoe-bench serve --prompt-match
order): MT-Bench's two-turn questions behind one shared system prompt, as a chat client sends
them. Each conversation's second turn repeats its first turn, a fixed stand-in answer and the
second question, so it begins with every token of the first turn's prompt. A conversation's
second turn comes two conversations after its first.

  bench/prefix_prompts.py ../shared/data > /tmp/prefix-chat.jsonl
"""
import json
import sys
from pathlib import Path

data = Path(sys.argv[1] if len(sys.argv) > 1 else "../shared/data")
corpus = (data / "corpus" / "olmoe-c4.txt").read_text(encoding="utf-8").split()
system = ("System: You are a careful assistant. Use the reference text below when it helps.\n"
          "Reference: " + " ".join(corpus[:200]) + "\n\n")
answer = "Assistant: " + " ".join(corpus[300:340]) + "\n\n"
conversations = [json.loads(line) for line in (data / "prompts" / "mt-bench-questions.jsonl")
                 .read_text(encoding="utf-8").splitlines() if line.strip()]
first = [system + "User: " + c["turns"][0] + "\n\n" for c in conversations]
second = [first[i] + answer + "User: " + c["turns"][1] + "\n\n"
          for i, c in enumerate(conversations) if len(c["turns"]) > 1]
order = []
for i in range(len(first)):
    order.append(first[i])
    if i >= 2 and i - 2 < len(second):
        order.append(second[i - 2])
for p in order:
    print(json.dumps({"prompt": p + "Assistant:"}))
