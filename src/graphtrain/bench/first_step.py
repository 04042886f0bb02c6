"""Time to first step of a Hugging Face model built from config, in this fresh process (#20's figures).

    python -m graphtrain.bench.first_step --arch gpt2 --layers 12 --width 256 --batch 4 --seq 128 \\
        --mode graphtrain --cache /tmp/ttfs-cache          # again with the same --cache: warm

--mode eager | compile (model.compile(), torch.compile's defaults) | graphtrain (graphtrain.accelerate(model)).
--cache points GRAPHTRAIN_CACHE and TORCHINDUCTOR_CACHE_DIR at one folder: an empty one is a cold start. Models:
SDPA attention, the config's dropout (0.1), fused AdamW. The first step is the wall time of the first forward,
backward and optimizer step; the later steps are printed too (single samples: `graphtrain bench` measures speed).
graphtrain sets the process's CPU allocator at its first compile (glibc keeps freed blocks; blocks of 2 MiB and
more on transparent huge pages, which is most of a large model's first step); `--same-allocator` gives eager and
torch.compile that setting too.
For graphtrain on a cold cache the first steps run on aten while Inductor compiles in a background process
(provider auto's tiered compile); `--settle` then waits for it and prints the step that switches (it loads Inductor
from the caches and times both providers) and a step after it, so the whole cost of getting to the final speed shows.
"""

from __future__ import annotations

import argparse
import os
import time

# Imports inside functions: order: a first-step run points GRAPHTRAIN_CACHE and TORCHINDUCTOR_CACHE_DIR at its cache
# before the engine loads.


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="gpt2", choices=("gpt2", "bert", "llama"))
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--mode", default="graphtrain", choices=("eager", "compile", "graphtrain"))
    p.add_argument("--cache", help="the compile cache folder (empty: cold)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument(
        "--same-allocator",
        action="store_true",
        help="eager and compile: the process allocator graphtrain sets at its first compile (glibc keeps "
        "freed blocks, 2 MiB+ blocks on huge pages: engine.cpu_allocator, engine.cpu_huge_pages)",
    )
    p.add_argument(
        "--engine",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="graphtrain: engine settings, e.g. cpu_huge_pages=false compile_in_background=false",
    )
    p.add_argument(
        "--settle",
        action="store_true",
        help="graphtrain: wait for the background compile, then time the switching step and one more",
    )
    a = p.parse_args(argv)
    if a.cache:
        os.environ["GRAPHTRAIN_CACHE"] = a.cache
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(a.cache, "compile")
    import torch
    import transformers

    torch.manual_seed(0)
    heads = max(a.width // 64, 1)
    if a.arch == "gpt2":
        model = transformers.GPT2LMHeadModel(
            transformers.GPT2Config(
                n_layer=a.layers,
                n_embd=a.width,
                n_head=heads,
                vocab_size=a.vocab,
                n_positions=max(a.seq, 128),
                attn_implementation="sdpa",
            )
        )
    elif a.arch == "bert":
        model = transformers.BertForMaskedLM(
            transformers.BertConfig(
                num_hidden_layers=a.layers,
                hidden_size=a.width,
                num_attention_heads=heads,
                intermediate_size=4 * a.width,
                vocab_size=a.vocab,
                attn_implementation="sdpa",
            )
        )
    else:
        model = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(
                num_hidden_layers=a.layers,
                hidden_size=a.width,
                num_attention_heads=heads,
                num_key_value_heads=max(a.width // 128, 1),
                intermediate_size=int(2.7 * a.width),
                vocab_size=a.vocab,
                attn_implementation="sdpa",
                attention_dropout=0.1,
            )
        )
    model.train()
    ids = torch.randint(0, a.vocab, (a.batch, a.seq))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    if a.same_allocator and a.mode != "graphtrain":
        from graphtrain.runtime.allocator import huge_pages_as_graphtrain, set_cpu_allocator

        set_cpu_allocator("keep", huge_pages=False)
        huge_pages_as_graphtrain(model)
    if a.mode == "graphtrain":
        import yaml

        import graphtrain

        settings = {k: yaml.safe_load(v) for k, _, v in (kv.partition("=") for kv in a.engine)}
        model = graphtrain.accelerate(model, **settings)
    elif a.mode == "compile":
        model.compile()

    def step() -> float:
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step.loss = loss.item()
        return time.perf_counter() - t0

    times = [step() for _ in range(a.steps)]
    print(
        f"{a.mode} {a.arch} {a.layers} layers width {a.width}: first step {times[0]:.1f} s, later "
        f"{', '.join(f'{t:.3f}' for t in times[1:])} s, loss {step.loss:.3f}"
    )
    if a.settle and a.mode == "graphtrain":
        import graphtrain

        t0 = time.perf_counter()
        graphtrain.wait_compiled(model)
        waited = time.perf_counter() - t0
        switch, after = step(), step()
        providers = [g["provider"] for g in graphtrain.report(model).graphs]
        print(
            f"settle: waited {waited:.1f} s more for the background compile ({a.steps} steps ran meanwhile); "
            f"switching step {switch:.2f} s, then {after:.3f} s; providers {providers}"
        )
    if a.mode == "graphtrain":
        import graphtrain

        rep = graphtrain.report(model)
        c = rep.cache or {}
        print(
            f"graphs {len(rep.graphs)} ({', '.join(rep.blocks)}); cache: pass results {c.get('passes_hit')} hit "
            f"{c.get('passes_miss')} miss, Inductor FX graphs {c.get('fxgraph_hit')} hit {c.get('fxgraph_miss')} "
            f"miss"
        )
        if rep.first_step_memory:
            from graphtrain.tools.report_text import first_step_line

            print(first_step_line(rep.first_step_memory))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
