"""CPU allocator settings: return freed activation buffers to the OS (memory first), or keep them for the next
step (speed first).

glibc's malloc serves blocks >= its mmap threshold with mmap (returned to the OS on free) and
smaller ones from its heap (kept after free). The threshold is dynamic: each time an mmapped
block is freed, it rises to that block's size, up to 32 MiB. A training step frees thousands of
activation buffers of 1-32 MiB, so after the first step they all come from the heap, which then
holds the freed ones and fragments. Measured (gpt2-mini, seq 128, batch 16, 2-core EPYC, aten
provider): peak resident tensor memory 517 MiB with glibc's default, 427 MiB with the threshold
pinned at 128 KiB, which is what ``predict_peak`` predicts (425 MiB); step time unchanged within
noise.

The other way round, glibc's threshold never grows past 32 MiB, so every block larger than that (a language
model's logits and their gradient: [1016, 16384] fp32 is 67 MB) is a fresh mmap each step whose pages fault in
on first touch. On the 2-core AMX Xeon (2026-11-25) a clone of such a tensor took 15.4 ms fresh and 4.4 ms from
glibc's heap, log_softmax 19.0 vs 8.9 ms, and a whole Hugging Face GPT-2 small step (b8 s128, fp32) ~12% less
for eager and graphtrain alike. ``keep_freed_blocks`` serves such blocks from the heap and keeps freed heap
memory (no trim), so the next step reuses the same pages. The process does not give memory back between steps,
and while it warms up its heap can grow by a few large blocks: posix_memalign (c10's 64-byte-aligned CPU
allocations) asks for size + alignment + 32 bytes, so a freed chunk whose slack a small allocation took no longer
fits a request of its own size (a 64 MiB tensor allocated and freed in a loop: 1 to 5 blocks more, then none).
Written by hand because glibc's ``mallopt`` is the interface (no library wraps it).

Huge pages (``use_huge_pages``): a block's first touch faults its pages in one 4 KiB page at a time. The first
step of a large model touches its gradients and optimizer state for the first time (GPT-2 Medium: 4.2 GB, ~1M
faults), and without ``keep`` every step faults its fresh activation blocks in again. With the kernel's
transparent huge pages a block faults in 2 MiB at a time: measured on a 2-core Zen 4 (GPT-2 Medium, batch 1,
seq 128, eager, glibc default) the first step took 9.2/7.9 s with 4 KiB pages and 6.0/5.9 s with huge pages, the
later ones 3.5 vs 2.9 s; with ``keep`` the first step 9.0 vs 5.6 s, the later ones alike. torch offers this as
THP_MEM_ALLOC_ENABLE=1, read once at torch's first allocation (before any library can set it), so graphtrain
installs an allocator of its own that does the same (kernels/csrc/allocator.cpp: C++, because torch's CPU allocator is
only replaceable from C++).

What huge pages cost after the first step: a matrix whose rows lie 2^k bytes apart (a power-of-two width: 4096,
16384, 32768 fp32 columns) and that a GEMM reads transposed (a weight gradient, d Y^T @ X) has every row of a
column in the same few sets of a physically indexed cache once it sits on 2 MiB pages, where 4 KiB pages scatter
the upper set bits; BLAS's packing of it then thrashes. Measured on a 2-core AVX2 EPYC (Zen 2, 512 KiB 8-way L2),
MKL, d Y [512, 16384]: 190.5 ms a GEMM on huge pages against 106.5 on 4 KiB pages, 66.4 with its rows padded by
one cache line (scripts/huge_page_gemm.py; docs/design/memory.md "huge pages and power-of-two rows"). graphtrain
pads the buffer it owns there (the LM head's logits, kernels/linear_cross_entropy.py logits_row_stride); the
activation gradients aten allocates for the layers' weight gradients are not padded.

The block cache (``use_block_cache``, on under ``release``): huge pages make a fresh block's faults cheaper, but
under ``release`` every step still faults its fresh activations in (measured: Hugging Face GPT-2 with
``recompute="full"``, 640k minor faults a step with 4 KiB pages). The same allocator keeps a freed block of 128 KiB
or more (what ``release`` gives back to the OS) for the next request of its size, bounded so that the bytes in use
plus the bytes kept never pass the most ever in use at once: a request that would pass it evicts kept blocks first.
Counting only the cached sizes as in use let the backward's smaller blocks (gradients of small weights) come on top
of the kept ones, 9 MiB over release's peak on gpt2-mini; keeping only blocks of 2 MiB and more left the smaller
ones to fault in every step (HF Llama small bf16: 91k minor faults a step against 0.5-6k kept). A step's requests
repeat every step, so most are served from the cache; the ones that are not are the sizes the backward frees in
place of the forward's (ViT, batch 32, ``full``: 176 hits and 58 misses a step). No eviction order fixes that under
the bound: on a recorded HF Llama wide step, replayed, evicting the block whose size is asked for last (the best any
order can do) missed 97-100% of the bytes the order used misses. Measured in docs/design/memory.md ("The block cache
under release").
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path
from typing import Any

from graphtrain.kernels import _cpu_ext

M_TRIM_THRESHOLD = -1  # mallopt parameter numbers in glibc's malloc.h
M_MMAP_THRESHOLD = -3
DEFAULT_THRESHOLD = 128 * 1024
KEEP_THRESHOLD = 1 << 30
"""Blocks under 1 GiB come from the heap in ``keep`` mode; larger ones (rare on a CPU step) still get their own
mmap, so one huge tensor is not held for the rest of the process."""


def _glibc() -> ctypes.CDLL | None:
    """glibc, where this process runs on it (mallopt is glibc's); None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def _ext() -> Any:
    """The C++ extension holding graphtrain's allocator, or None where it cannot be built."""
    return _cpu_ext.load()


def pin_mmap_threshold(threshold: int = DEFAULT_THRESHOLD) -> bool:
    """Pin glibc's mmap threshold (disables its dynamic growth). Returns False where not glibc."""
    libc = _glibc()
    return libc is not None and bool(libc.mallopt(M_MMAP_THRESHOLD, int(threshold)))


def keep_freed_blocks(threshold: int = KEEP_THRESHOLD) -> bool:
    """Serve blocks under `threshold` from glibc's heap and trim it only past 2 GiB of free top: a freed
    activation's pages are reused by the next step instead of being faulted in again. False where not glibc."""
    libc = _glibc()
    # the trim threshold first: once the mmap threshold is set glibc stops adjusting it. mallopt takes a C int:
    # trim only past twice the threshold of free heap top, at most 2 GiB - 1
    return (
        libc is not None
        and bool(libc.mallopt(M_TRIM_THRESHOLD, min(2 * int(threshold), 2**31 - 1)))
        and bool(libc.mallopt(M_MMAP_THRESHOLD, int(threshold)))
    )


def apply(mode: str) -> bool:
    """Set this process's CPU allocator: ``release`` (pin_mmap_threshold), ``keep`` (keep_freed_blocks) or
    ``default`` (leave glibc as it is). Returns whether a setting was applied."""
    if mode == "release":
        return pin_mmap_threshold()
    if mode == "keep":
        return keep_freed_blocks()
    if mode == "default":
        return False
    raise ValueError(f"CPU allocator mode {mode!r}: choose release, keep or default")


def trim() -> None:
    """Give the block cache's blocks and the heap's free pages back to the OS now (glibc malloc_trim)."""
    if _BLOCK_CACHE:
        if (mod := _ext()) is not None:
            mod.block_cache_drain()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # no glibc, or a libc without malloc_trim
        pass


THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_available() -> tuple[bool, str]:
    """(whether this kernel gives a process transparent huge pages where it asks for them, the kernel's mode or
    why not)."""
    try:
        text = THP_ENABLED.read_text()
        mode = text[text.index("[") + 1 : text.index("]")]
    except (OSError, ValueError):
        return False, f"no transparent huge pages on this system ({THP_ENABLED} is missing)"
    if mode == "never":
        return False, "transparent huge pages are switched off on this machine (mode [never])"
    return True, mode


_HUGE_PAGES: bool | None = None
_BLOCK_CACHE = False


def _install(huge: bool, cache: bool) -> bool:
    """Install graphtrain's allocator for blocks of 2 MiB and more with these settings (or give back the one it
    replaced when neither is on). Returns whether it is installed; False where the C++ kernels cannot be built."""
    mod = _ext()
    if mod is None:
        return False
    return bool(mod.block_allocator(huge or cache, huge, cache))


def use_huge_pages(on: bool = True) -> bool:
    """Make torch's CPU allocator put blocks of 2 MiB and more on transparent huge pages (on), or stop (off: the
    allocator it replaced comes back unless the block cache still needs graphtrain's). Returns whether huge-page
    allocation is on now: False where the kernel offers no huge pages or graphtrain's C++ kernels cannot be built
    (the allocator lives there)."""
    global _HUGE_PAGES
    if on and not huge_pages_available()[0]:
        return False
    installed = _install(bool(on), _BLOCK_CACHE)
    _HUGE_PAGES = bool(on) and installed
    return _HUGE_PAGES


def huge_pages_on() -> bool | None:
    """Whether graphtrain's huge-page allocator is installed (None: never asked in this process)."""
    return _HUGE_PAGES


def use_block_cache(on: bool = True) -> bool:
    """Keep freed blocks of 128 KiB and more for the next request of their size (on), bounded so that the bytes in use
    (blocks from 128 KiB up) plus the bytes kept never pass the most ever in use at once; off gives every kept
    block back. Under ``release`` this keeps its peak and saves the page faults of re-touching each step's fresh
    activations: the step's allocations repeat every step. Returns whether it is on (False where the C++ kernels
    cannot be built)."""
    global _BLOCK_CACHE
    _BLOCK_CACHE = _install(bool(_HUGE_PAGES), bool(on)) and bool(on)
    return _BLOCK_CACHE


def block_cache_on() -> bool:
    """Whether the block cache is on in this process."""
    return _BLOCK_CACHE


def block_cache_stats() -> dict[str, int] | None:
    """The block cache's counters, or None where graphtrain's allocator was never installed: bytes in use, cached
    and the most ever in use (blocks of 2 MiB and more, and from 128 KiB while the cache is on); hits, misses,
    evictions and the bytes of the misses; the bytes primed (memory/prefault.py) and not yet asked for."""
    if _HUGE_PAGES is None and not _BLOCK_CACHE:
        return None
    mod = _ext()
    if mod is None:
        return None
    keys = (
        "in_use_bytes",
        "cached_bytes",
        "high_water_bytes",
        "hits",
        "misses",
        "evictions",
        "missed_bytes",
        "primed_bytes",
    )
    return dict(zip(keys, (int(v) for v in mod.block_cache_stats())))


def record_requests(on: bool) -> list[int] | None:
    """Start recording (on) or stop and return (off) the sizes of the CPU blocks of 2 MiB and more requested since
    the start that no block freed since the start could have served: the fresh memory that stretch of work needs,
    in the order it asked. Needs graphtrain's allocator installed (use_huge_pages or use_block_cache); None where
    the C++ kernels cannot be built."""
    mod = _ext()
    return None if mod is None else [int(n) for n in mod.block_cache_record(bool(on))]


def prime(sizes: list[int], follow: bool = True) -> bool:
    """Fault in blocks of these sizes (bytes, 2 MiB and more) in a background C++ thread that does not hold the GIL,
    in order, and hand them to the next requests of their size (memory/prefault.py). `follow`: `sizes` is a
    recorded list in the step's order, so the thread skips past the requests the step (recording) already made.
    Needs graphtrain's allocator installed. False where the C++ kernels cannot be built."""
    mod = _ext()
    return mod is not None and bool(mod.block_cache_prime([int(n) for n in sizes], bool(follow)))


def stop_priming() -> None:
    """Fault in no more blocks (the ones primed stay offered until settle_priming)."""
    if (mod := _ext()) is not None:
        mod.block_cache_prime_stop()


def settle_priming() -> dict[str, int] | None:
    """Stop priming and give back the primed blocks nobody asked for: {primed, taken, returned_bytes}."""
    mod = _ext()
    if mod is None:
        return None
    made, taken, returned = (int(v) for v in mod.block_cache_settle())
    return dict(primed=made, taken=taken, returned_bytes=returned)
