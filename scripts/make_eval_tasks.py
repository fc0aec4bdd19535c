"""Write the repo's offline harness tasks (tasks/*.jsonl) from the held-out half of the documentation
every CPython ships (quantize.python_docs_text), so that `eval.py --tasks tasks/pydoc_cloze.yaml`
needs no download. The files are committed: a scheme's score must not move with the Python version.

    python scripts/make_eval_tasks.py            # rewrites tasks/pydoc_{cloze,complete,ending}.jsonl

pydoc_cloze (multiple choice): a sentence without its last word, and four words to end it with, the
true one and three that end other sentences. pydoc_complete (generation): the same kind of sentence
in other examples; the model's first word must be the missing one. pydoc_ending (multiple choice,
shaped like HellaSwag): the first half of one of pydoc_cloze's sentences, and four second halves,
its own and three of other sentences: choices of several tokens each.
"""

import argparse
import json
import random
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastllama.checkpoint import write_atomically  # noqa: E402
from fastllama.quantize import python_docs_text  # noqa: E402

TASKS = Path(__file__).resolve().parents[1] / "tasks"
PER_TASK = 200


def sentences(text: str) -> list[tuple[str, str]]:
    """(the sentence up to its last word, the last word) for prose sentences of 6 to 40 words whose
    last word is a plain word of at least 4 letters, in the order of the text, each once."""
    found, seen = [], set()
    for paragraph in text.split("\n\n"):
        paragraph = " ".join(paragraph.split())
        for sentence in re.split(r"(?<=[a-z])\. (?=[A-Z])", paragraph):
            sentence = sentence.rstrip(".")
            words = sentence.split(" ")
            if not 6 <= len(words) <= 40 or re.search(r"[^A-Za-z0-9 ,;:'\"()-]", sentence) or sentence in seen:
                continue
            last = words[-1]
            if len(last) >= 4 and last.isalpha() and last.islower():
                seen.add(sentence)
                found.append((" ".join(words[:-1]), last))
    return found


def main():
    pairs = sentences(python_docs_text("held-out"))
    rng = random.Random(0)
    rng.shuffle(pairs)
    endings = sorted({word for _, word in pairs})
    cloze, complete = pairs[:PER_TASK], pairs[PER_TASK: 2 * PER_TASK]
    examples = []
    for context, word in cloze:
        choices = [word] + rng.sample([w for w in endings if w != word], 3)
        rng.shuffle(choices)
        examples.append(dict(context=context, choices=choices, label=choices.index(word)))
    write_jsonl("pydoc_cloze", examples)
    write_jsonl("pydoc_complete", [dict(context=context, answer=word) for context, word in complete])
    # the held-out docs have ~400 such sentences: pydoc_ending reuses pydoc_cloze's, cut elsewhere
    halves = [split_in_half(f"{context} {word}") for context, word in cloze]
    examples = []
    for start, end in halves:
        choices = [end] + rng.sample([other for _, other in halves if other != end], 3)
        rng.shuffle(choices)
        examples.append(dict(context=start, choices=choices, label=choices.index(end)))
    write_jsonl("pydoc_ending", examples)
    print(f"wrote {len(cloze)} + {len(complete)} + {len(halves)} examples from {len(pairs)} sentences into {TASKS}")


def write_jsonl(task: str, examples: list[dict]):
    """tasks/{task}.jsonl, one example a line, renamed into place only once written whole."""
    write_atomically(TASKS / f"{task}.jsonl", lambda f: f.writelines(json.dumps(e) + "\n" for e in examples))


def split_in_half(sentence: str) -> tuple[str, str]:
    """(the sentence's first half of its words, the rest), the rest ending with the sentence's period."""
    words = sentence.split(" ")
    return " ".join(words[: len(words) // 2]), " ".join(words[len(words) // 2:]) + "."


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                            allow_abbrev=False).parse_args()
    main()
