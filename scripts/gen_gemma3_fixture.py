"""Reference behaviour of Gemma 3 270M (base, Q4_K_M GGUF) under llama.cpp, for the local backend's
SentencePiece tokenizer and Gemma 3 forward pass (crates/hilum-llm-local/tests/it/gemma3.rs).

Records, with llama-cpp-python (built by scripts/llama_server_check.sh into scripts/.venv-llama):
- the tokenization of a corpus of texts (BOS added, special-token text parsed), and
- for a few prompts, the greedy continuation token ids, how far each chosen token's logit is
  ahead of the runner-up, and the top-5 logits of the first step; one prompt is longer than the
  model's 512-token sliding window.

    scripts/fetch_local_llm.sh --gemma3
    scripts/.venv-llama/bin/python scripts/gen_gemma3_fixture.py [MODEL.gguf]

Writes crates/hilum-llm-local/tests/fixtures/gemma3_llamacpp.json.
"""
import json
import os
import pathlib
import sys

import numpy as np
from llama_cpp import Llama

MODELS = pathlib.Path(os.environ.get("HILUM_MODELS_DIR", pathlib.Path.home() / ".local/share/hilum/models"))
MODEL = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else MODELS / "llm/gemma-3-270m-q4_k_m.gguf"
OUT = pathlib.Path(__file__).resolve().parent.parent / "crates/hilum-llm-local/tests/fixtures/gemma3_llamacpp.json"
NEW_TOKENS = 24

TOKENIZE = [
    "Hello world",
    " leading space and  two   spaces",
    "trailing spaces   ",
    "Line one\nLine two\n\nLine four\n\n\n\ttabbed",
    "<start_of_turn>user\nHow large are the lungs?<end_of_turn>\n<start_of_turn>model\n",
    "<bos>already has a bos",
    "HTML: <div class=\"x\"></div></iframe></footer>",
    "Numbers 12345 67.89 -0.001 1e-6",
    "Unicode: café naïve Zürich 北京 東京 Ελληνικά Русский",
    "Emoji and rare: 🫁🩻 🦀 \u2028 \u0007 ￿",
    "{\"name\": \"image_info\", \"arguments\": {\"image\": \"img_3fa2c1\"}}",
    "def f(x):\n    return x ** 2  # square\n",
    "▁already▁escaped and <0x41> literal",
    "",
    " ",
    "\n",
    "a" * 40,
]


def long_prompt():
    # Longer than the 512-token sliding window, with a pattern the model can continue.
    colours = ["red", "green", "blue", "yellow", "purple", "orange", "white", "black"]
    lines = [f"Item {i}: a {colours[i % len(colours)]} box holds {i * 3} marbles." for i in range(1, 61)]
    return "\n".join(lines) + "\nItem 61:"


GENERATE = [
    "The capital of France is",
    "A chest X-ray shows",
    "def fibonacci(n):\n",
    "<start_of_turn>user\nWhat is the largest planet?<end_of_turn>\n<start_of_turn>model\n",
    long_prompt(),
]


def main():
    llm = Llama(str(MODEL), n_ctx=2048, n_batch=512, logits_all=True, verbose=False, seed=0)
    tokenize = []
    for text in TOKENIZE:
        tokenize.append({"text": text, "ids": llm.tokenize(text.encode(), add_bos=True, special=True)})
    generate = []
    for text in GENERATE:
        prompt = llm.tokenize(text.encode(), add_bos=True, special=True)
        llm.reset()
        llm.eval(prompt)
        first = np.array(llm.scores[len(prompt) - 1], dtype=np.float32)
        top = np.argsort(-first)[:5]
        out = []
        margins = []
        for _ in range(NEW_TOKENS):
            logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
            t = int(np.argmax(logits))
            out.append(t)
            # How far the chosen token is ahead of the runner-up: a near tie may go either way
            # under other (equally valid) rounding.
            second = np.partition(logits, -2)[-2]
            margins.append(round(float(logits[t] - second), 4))
            if t in (1, 106):
                break
            llm.eval([t])
        generate.append({
            "prompt": text,
            "prompt_ids": prompt,
            "greedy": out,
            "margins": margins,
            "top5": [[int(i), float(first[i])] for i in top],
            "text": llm.detokenize(out).decode("utf-8", "replace"),
        })
        print(f"{len(prompt):4} prompt tokens -> {generate[-1]['text']!r}", file=sys.stderr)
    fixture = {
        "model": MODEL.name,
        "generator": "scripts/gen_gemma3_fixture.py (llama-cpp-python "
        + __import__("llama_cpp").__version__ + ")",
        "new_tokens": NEW_TOKENS,
        "tokenize": tokenize,
        "generate": generate,
    }
    OUT.write_text(json.dumps(fixture, ensure_ascii=False, indent=1) + "\n")
    print(f"wrote {OUT}", file=sys.stderr)


if __name__ == "__main__":
    main()
