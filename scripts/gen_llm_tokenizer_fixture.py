"""Reference tokenization of a corpus of prompts for the local Qwen2.5 GGUF model.

Two references. `--llama-cpp` tokenizes with llama.cpp itself (llama-cpp-python, built by
scripts/llama_server_check.sh into scripts/.venv-llama, ~20 min compile) and writes
tokenization_llamacpp.json; each case says whether its text changes under NFC, the one place
where llama.cpp (no normalisation) and Qwen's own tokenizer (NFC) differ.

    scripts/.venv-llama/bin/python scripts/gen_llm_tokenizer_fixture.py --llama-cpp [MODEL.gguf]

Without it, the reference is Hugging Face
`tokenizers` (the library Qwen publishes its tokenizer for, and the one llama.cpp's own tokenizer
tests compare against), built the way Qwen2's tokenizer.json is built: NFC normaliser, Qwen2
split regex + byte-level pre-tokenizer, BPE with the vocabulary and merges read from the GGUF,
control/user-defined tokens as added tokens.

    python3 -m venv scripts/.venv-llm && scripts/.venv-llm/bin/pip install -r scripts/requirements-llm.txt
    scripts/.venv-llm/bin/python scripts/gen_llm_tokenizer_fixture.py [MODEL.gguf]
"""
import json
import os
import pathlib
import sys

import unicodedata

LLAMA_CPP = "--llama-cpp" in sys.argv[1:]
ARGS = [a for a in sys.argv[1:] if a != "--llama-cpp"]
MODELS = pathlib.Path(os.environ.get("HILUM_MODELS_DIR", pathlib.Path.home() / ".local/share/hilum/models"))
MODEL = pathlib.Path(ARGS[0]) if ARGS else MODELS / "llm/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
FIXTURES = pathlib.Path(__file__).resolve().parent.parent / "crates/hilum-llm-local/tests/fixtures/local_llm"
OUT = FIXTURES / "tokenization.json"

# Qwen2's published pre-tokenizer pattern (tokenizer.json of Qwen/Qwen2.5-*).
QWEN2_PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

CORPUS = [
    "How large are the lungs in this image?",
    "Images: img_3fa2c1b4d5e6",
    "<|im_start|>system\nYou are Hilum, a chest X-ray assistant.<|im_end|>\n<|im_start|>user\nHow large are the lungs?\n\nImages: img_3fa2c1<|im_end|>\n<|im_start|>assistant\n",
    "<tool_call>\n{\"name\": \"image_info\", \"arguments\": {\"image\": \"img_3fa2c1\"}}\n</tool_call>",
    "<|im_start|>user\n<tool_response>\n{\"width\": 1024, \"height\": 1024, \"bit_depth\": 8, \"mean\": 126.73}\n</tool_response><|im_end|>\n",
    "The cardiothoracic ratio is 0.47 (normal < 0.5); lung area 41.2% of the field.",
    "Right lower lobe consolidation, small left pleural effusion. No pneumothorax.",
    "Pneumothorax   with    many     spaces\tand\ttabs",
    "lines\n\n\nand\r\nwindows\r\n\r\nnewlines   \n  ",
    "numbers 1234567890 3.14159 -42 1e-6 0x1F 2026-11-22T04:40Z",
    "ÄÖÜ äöü ß é è ê ñ ç — “quotes” ‘single’ … ©®™",
    "中文胸部X光片 日本語の胸部レントゲン 한국어 흉부 엑스레이",
    "emoji 🫁🩻🏥👩‍⚕️ and ZWJ sequences",
    "Ünïcödé NFC vs NFD: e\u0301 vs é, A\u030a vs Å",
    "fn main() {\n    let x: Vec<u32> = (0..10).map(|i| i * 2).collect();\n    println!(\"{x:?}\");\n}\n",
    "def f(x):\n\treturn {'a': [1, 2, 3], \"b\": None}  # comment\n",
    "I'm sure it's what they'll've said; YOU'RE right, I'D think. don't WON'T",
    "<|endoftext|>text after endoftext<|im_end|><|im_start|>",
    "   leading spaces and trailing   ",
    "",
    "a",
    "\n",
    "PA view, 16-bit DICOM (MONOCHROME1), window 40/400, pixel spacing 0.143 mm.",
    "JSON: {\"type\": \"object\", \"properties\": {\"image\": {\"type\": \"string\", \"pattern\": \"^img_[0-9a-f]{6,64}$\"}}, \"required\": [\"image\"]}",
    "URL https://example.invalid/path?q=1&x=%20y#frag and email a.b@c.de",
    "Mixed: CXR_001.png, img_00ff00, v2.5-coder, x86_64, AVX2/FMA, 2×2 µm, 37 °C, ±0.5",
    "repeated!!!!!!!!!!!!!!!!!!!!!!!!!!! ??????? ........ ------",
    "Arabic: الأشعة السينية على الصدر Hebrew: צילום חזה Russian: рентген грудной клетки",
]


def main_llama_cpp():
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(MODEL), vocab_only=True, verbose=False)
    cases = [{
        "text": text,
        "ids": llm.tokenize(text.encode("utf-8"), add_bos=False, special=True),
        "changes_under_nfc": unicodedata.normalize("NFC", text) != text,
    } for text in CORPUS]
    out = FIXTURES / "tokenization_llamacpp.json"
    out.write_text(json.dumps({
        "model": MODEL.name,
        "reference": f"llama.cpp via llama-cpp-python {llama_cpp.__version__} (tokenize, add_bos=False, special=True)",
        "cases": cases,
    }, ensure_ascii=False, indent=1) + "\n")
    print(f"wrote {out} ({len(cases)} cases, {sum(len(c['ids']) for c in cases)} tokens)")


def main():
    import gguf
    import tokenizers
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, decoders

    r = gguf.GGUFReader(str(MODEL))
    f = r.fields
    def strings(key):
        fld = f[key]
        return [bytes(fld.parts[i]).decode("utf-8") for i in fld.data]
    tokens = strings("tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in strings("tokenizer.ggml.merges")]
    types = [int(f["tokenizer.ggml.token_type"].parts[i][0]) for i in f["tokenizer.ggml.token_type"].data]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    # Control (3) and user-defined (4) tokens are added tokens, matched before BPE.
    added = [tokenizers.AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty in (3, 4)]
    tok.add_special_tokens(added)
    cases = []
    for text in CORPUS:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids, skip_special_tokens=False) == unicodedata.normalize("NFC", text), text
        cases.append({"text": text, "ids": ids})
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({
        "model": MODEL.name,
        "reference": f"huggingface tokenizers {tokenizers.__version__}, vocab/merges from the GGUF (gguf {gguf.__version__ if hasattr(gguf, '__version__') else 'pinned'})",
        "cases": cases,
    }, ensure_ascii=False, indent=1) + "\n")
    print(f"wrote {OUT} ({len(cases)} cases, {sum(len(c['ids']) for c in cases)} tokens)")


if __name__ == "__main__":
    main_llama_cpp() if LLAMA_CPP else main()
