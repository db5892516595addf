"""The generation of one GRPO/RLOO benchmark step, timed alone: rlhf_core's lean loop vs ``model.generate``.

    .venv/bin/python bench/online_generation.py [repeats]

Workload (e)'s model, tokenizer and sampling settings (64 prompts of 4 words, 20 new tokens, temperature 1,
top_k 0, top_p 1, one thread): ``generate_batched`` (the path GRPOTrainer/RLOOTrainer take, ``decode.py``'s
loop) and transformers' ``generate`` (the path TRL 1.16 takes) on the same padded batch, each from the same
seed, alternating. Prints one JSON line: seconds per call (min and median over the repeats) of each, and
whether the two returned the same tokens.
"""

import importlib.util
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # this checkout's rlhf_core
spec = importlib.util.spec_from_file_location("online_workload", os.path.join(HERE, "workloads", "online.py"))
workload = importlib.util.module_from_spec(spec)
spec.loader.exec_module(workload)


def main():
    from transformers import AutoModelForCausalLM

    from rlhf_core.trainers.generation import generate_batched, generation_defaults, pad_queries

    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    torch.set_num_threads(1)
    tokenizer = workload.common.load_tokenizer(workload.tokenizer_path(), padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(str(workload.model_dir())).eval()
    texts = workload.prompts(workload.DEFAULTS["prompt_words"])[:workload.DEFAULTS["completions_per_step"]]
    queries = [torch.tensor(ids) for ids in tokenizer(texts)["input_ids"]]
    settings = dict(do_sample=True, max_new_tokens=workload.DEFAULTS["max_completion_length"], temperature=1.0,
                    top_k=0, top_p=1.0, repetition_penalty=1.0)
    batch = pad_queries(queries, tokenizer.pad_token_id)

    def lean():
        return generate_batched(model, tokenizer, queries, device="cpu", batch_size=len(queries),
                                return_prompt=False, **settings)

    def generate():
        with torch.no_grad():
            return model.generate(**batch, **generation_defaults(tokenizer, settings))

    seconds = {"lean": [], "generate": []}
    outputs = {}
    for _ in range(repeats):
        for name, call in (("lean", lean), ("generate", generate)):
            torch.manual_seed(0)
            t = time.perf_counter()
            outputs[name] = call()
            seconds[name].append(time.perf_counter() - t)
    width = batch["input_ids"].shape[1]
    same = all(torch.equal(r, row[width:width + len(r)]) for r, row in zip(outputs["lean"], outputs["generate"]))
    print(json.dumps({name: {"min_s": min(v), "median_s": statistics.median(v)} for name, v in seconds.items()}
                     | {"same_tokens": same, "repeats": repeats, "load": os.getloadavg()}))


if __name__ == "__main__":
    main()
