"""`graphtrain bench`: eager, torch.compile and graphtrain side by side on the same training step.

    graphtrain bench small                     # 4 models x 6 variants, interleaved
    graphtrain bench tiny --variants eager-fp32 eager-bf16
    python -m graphtrain.bench small --out bench_results --docs docs/design/benchmarks.md

Modules: suites (what runs), case (the one setup factory + worker process), runner (interleaved
timing), maxbatch (largest batch under a memory cap), flops (FLOP formula, measured peak, MFU),
report (tables, JSON, markdown, docs/design/benchmarks.md), cli (the subcommand).
"""
