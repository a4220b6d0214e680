"""llama.cpp side of scripts/bench/bench_llm.sh: the same ~260-token agent prompt, timed by llama.cpp itself.

The prompt is rendered by the GGUF's own chat template through Hilum (`bench_local` prints the same
conversation); here llama.cpp tokenizes the identical ChatML text and generates up to 64 tokens.
"""
import json
import sys
import time

from llama_cpp import Llama

SYSTEM = ("You are Hilum, an assistant that analyses chest X-rays with tools. "
          "Images are referred to by ids such as img_3fa2c1; pass these ids to tools. "
          "Base every finding on tool results and say which result supports it; never invent numbers. "
          "When several tools are needed and do not depend on each other, call them all in the same turn: they run in parallel. "
          "If a tool fails, read its error and either fix the call or answer without it. "
          "Say plainly what is uncertain. Your answers support a radiologist; they are not a diagnosis.")
TOOL = {"type": "function", "function": {"name": "image_info", "description": (
    "Size, bit depth, format and intensity statistics (mean, standard deviation, percentiles, a 16-bin histogram) "
    "of an image. Use it to check what an image is before analysing it, e.g. whether it is 16-bit, very dark, or small."),
    "parameters": {"additionalProperties": False, "properties": {"image": {
        "description": "Id of an image in this session, e.g. img_3fa2c1b4d5e6", "pattern": "^img_[0-9a-f]{6,64}$",
        "type": "string"}}, "required": ["image"], "type": "object"}}}
PROMPT = ("<|im_start|>system\n" + SYSTEM + "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
          "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n" + json.dumps(TOOL) +
          "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
          "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
          "<|im_start|>user\nWhat are the size and bit depth of this image?\n\nImages: img_5d41402abc4b<|im_end|>\n<|im_start|>assistant\n")

# Generation on its own: no tools, a question whose answer runs to GEN_TOKENS (as bench_local's round 3).
GEN_QUESTION = ("List forty findings a chest X-ray report can mention, one per line, "
                "each with a one-sentence description.")
GEN_PROMPT = ("<|im_start|>system\n" + SYSTEM + "<|im_end|>\n<|im_start|>user\n" + GEN_QUESTION +
              "<|im_end|>\n<|im_start|>assistant\n")
GEN_TOKENS = 128

model, threads = sys.argv[1], int(sys.argv[2])
llm = Llama(model_path=model, n_threads=threads, n_threads_batch=threads, n_ctx=2048, verbose=False)
t = time.time()
out = llm.create_completion(PROMPT, max_tokens=64, temperature=0.0, stop=["<|im_end|>"])
total = time.time() - t
perf = llm._ctx.ctx and __import__("llama_cpp").llama_perf_context(llm._ctx.ctx)
res = {"prompt_tokens": out["usage"]["prompt_tokens"], "completion_tokens": out["usage"]["completion_tokens"],
       "total_s": total, "text": out["choices"][0]["text"]}
if perf:
    res["prefill_tok_s"] = perf.n_p_eval / max(perf.t_p_eval_ms / 1e3, 1e-9)
    res["decode_tok_s"] = perf.n_eval / max(perf.t_eval_ms / 1e3, 1e-9)
print(json.dumps(res))

llm.reset()
if llm._ctx.ctx:
    __import__("llama_cpp").llama_perf_context_reset(llm._ctx.ctx)
out = llm.create_completion(GEN_PROMPT, max_tokens=GEN_TOKENS, temperature=0.0, stop=["<|im_end|>"])
perf = llm._ctx.ctx and __import__("llama_cpp").llama_perf_context(llm._ctx.ctx)
if perf:
    print(json.dumps({"round": 3, "completion_tokens": out["usage"]["completion_tokens"],
                      "decode_tok_s": perf.n_eval / max(perf.t_eval_ms / 1e3, 1e-9)}))
