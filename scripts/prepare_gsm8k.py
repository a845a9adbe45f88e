"""GSM8K (downloaded by you) -> this project's JSONL prompts.

    python scripts/prepare_gsm8k.py gsm8k/train.jsonl data/gsm8k_train.jsonl

Input lines: {"question": ..., "answer": "... #### 42"} (the dataset's own format).
Output lines: {"prompt": ..., "label": "42"}, scored by rl.tasks.rewards.math_answer.
"""

from __future__ import annotations

import json
import sys

INSTRUCTION = "\nSolve the problem step by step. Put the final number after '####'."


def convert(src: str, dst: str) -> int:
    n = 0
    with open(src, encoding="utf-8") as f, open(dst, "w", encoding="utf-8") as out:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            try:
                label = row["answer"].split("####")[-1].strip().replace(",", "")
                prompt = row["question"].strip() + INSTRUCTION
            except KeyError as e:
                sys.exit(f"{src}:{lineno}: expected 'question' and 'answer' fields (missing {e})")
            out.write(json.dumps({"prompt": prompt, "label": label}) + "\n")
            n += 1
    return n


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    print(f"wrote {convert(sys.argv[1], sys.argv[2])} prompts to {sys.argv[2]}")
