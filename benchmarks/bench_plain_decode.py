"""Plain greedy decoding: our on-device while_loop sampler vs transformers `generate`.

Same weights (SmolLM2-135M-Instruct from its pinned GGUF, float32), same prompts, same
number of new tokens (no early stop), same CPU, measured side by side in one run and
reported as a ratio. Compile time is excluded on both sides (one warm-up call each).

    python benchmarks/bench_plain_decode.py --batch 1 8 --new-tokens 128 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from dblast_jax.config import SamplingConfig
from dblast_jax.generation import encode_prompts, load_target
from dblast_jax.sampler import cache_size_for, generate_tokens, pad_prompts

PROMPTS = [
    "Explain speculative decoding to a new engineer.",
    "Write a short poem about the sea at night.",
    "What are three tips for learning a new language?",
    "Summarise the plot of a heist movie in a paragraph.",
    "How does a hash map work?",
    "Give me a recipe for pancakes.",
    "Why is the sky blue?",
    "Describe your ideal weekend.",
]


def torch_model_from(target, folder):
    import torch
    from transformers import AutoModelForCausalLM

    from dblast_jax.io.hf import save_hf
    save_hf(target.params, target.config, folder)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def time_ours(target, ids, new_tokens, repeats):
    tokens, lengths = pad_prompts(ids)
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=new_tokens, stop_tokens=())
    cache = cache_size_for(tokens.shape[1], new_tokens)
    call = lambda: generate_tokens(target.params, tokens, lengths, jax.random.key(0),
                                   config=target.config, sampling=sampling, cache_size=cache)
    jax.block_until_ready(call())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out, counts = jax.block_until_ready(call())
        times.append(time.perf_counter() - t0)
    return statistics.median(times), np.asarray(out)


def time_transformers(model, ids, new_tokens, repeats, pad_id):
    import torch
    width = max(len(x) for x in ids)
    input_ids = torch.full((len(ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, x in enumerate(ids):  # left padding, as transformers expects for generation
        input_ids[i, width - len(x):] = torch.tensor(x)
        mask[i, width - len(x):] = 1
    kwargs = dict(attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                  do_sample=False, pad_token_id=pad_id)
    with torch.inference_mode():
        model.generate(input_ids, **kwargs)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = model.generate(input_ids, **kwargs)
            times.append(time.perf_counter() - t0)
    return statistics.median(times), out[:, width:].numpy()


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()

    import torch
    torch.set_num_threads(args.threads)
    target = load_target(args.model)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = torch_model_from(target, tmp)
        for batch in args.batch:
            ids = encode_prompts(target, [PROMPTS[i % len(PROMPTS)] for i in range(batch)])
            ours_s, ours_out = time_ours(target, ids, args.new_tokens, args.repeats)
            hf_s, hf_out = time_transformers(model, ids, args.new_tokens, args.repeats,
                                             target.tokenizer.pad_id or 0)
            n = batch * args.new_tokens
            agree = float((ours_out[:, :16] == hf_out[:, :16]).mean())
            rows.append({"batch": batch, "new_tokens": args.new_tokens,
                         "ours_tok_s": n / ours_s, "transformers_tok_s": n / hf_s,
                         "speedup": hf_s / ours_s, "first16_token_agreement": agree})
            print(json.dumps(rows[-1]), flush=True)
    print("\n| batch | ours tok/s | transformers tok/s | ratio | first-16 agreement |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['ours_tok_s']:.1f} | {r['transformers_tok_s']:.1f} | "
              f"{r['speedup']:.2f}x | {r['first16_token_agreement']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
