// graphtrain's CPU allocator (memory/allocator.py): huge pages, the block cache, priming. Why C++: torch's CPU
// allocator is only replaceable from C++ (c10::SetCPUAllocator); the rest of the reasons follow.
#include <torch/extension.h>

// graphtrain's CPU allocator for blocks of 2 MiB and more, and from 128 KiB while the block cache is on
// (memory/allocator.py). Smaller blocks go to the allocator this one replaced. Two independent settings:
// - huge pages: a block is madvise(MADV_HUGEPAGE)d before its first touch, so it faults in 2 MiB at a time
//   instead of 4 KiB (what c10 does under THP_MEM_ALLOC_ENABLE=1, which torch reads once, at its first
//   allocation: too early for a library to set);
// - the block cache: a freed block of 128 KiB or more is kept for the next request of its size (to 4 KiB), as a
//   step's allocations repeat every step, so its pages are not faulted in again. Blocks below 2 MiB were not kept
//   at first: under release glibc maps each of them afresh, and on HF Llama small bf16 (b8 s128, 2-core AMX Xeon)
//   the step faulted 91k pages of 4 KiB; kept, 0.5-6k, and the step took 0.27-0.35 s instead of 0.39-0.45 s, the
//   process peak unchanged (docs/design/memory.md). Bounded: the bytes in use plus
//   the bytes cached never exceed the most ever in use at once (a request that would pass that first evicts
//   the smallest cached block that makes room, else the largest), counting every block from 128 KiB up (what
//   release would give back to the OS), so the process peak stays what returning every freed block gives
//   (docs/design/memory.md).
// - priming (a warm start's first step): a background thread faults in, ahead of time, blocks of the sizes a
//   recorded first step asked for (its gradients and optimizer state), while the main thread is still tracing;
//   the step then finds them ready. A primed block asked for once stays with this allocator (back to the idle
//   blocks when freed, cache on or off): glibc would serve the next step's request from the main thread's heap,
//   not from the priming thread's, and fault it in again. Primed blocks never asked for are given back when
//   the first step is settled (block_cache_settle).
// Written by hand: c10's CPU allocator has no caching (its CUDA one does), and glibc's heap, which does keep
// freed blocks, fragments (docs/design/memory.md) and has no such bound. Every block is freed the same way (profiler
// report, then free), so either deleter frees either block.
#include <c10/core/CPUAllocator.h>
#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>
#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace {
constexpr size_t kHugePage = size_t(2) << 20;
constexpr size_t kPage = 4096;
constexpr size_t kTracked = size_t(128) << 10;  // glibc's mmap threshold under release: from here blocks count
constexpr size_t kMaxRecorded = size_t(1) << 20;  // a recording never settled stops growing here
c10::Allocator* gt_base_allocator = nullptr;

struct BlockCache {
  std::mutex mu;
  std::atomic<bool> huge{true}, cache{false};  // read without mu on the fast path
  std::unordered_map<void*, size_t> in_use;  // blocks counted, in use -> size (rounded to 4 KiB)
  std::multimap<size_t, void*> idle;         // the cache: size -> block
  std::multimap<size_t, void*> primed;       // primed, not asked for yet: outside the bound until settled
  std::unordered_set<void*> sticky;          // primed blocks asked for: idle when freed, cache on or off
  size_t in_use_bytes = 0, cached_bytes = 0, high_water = 0, primed_bytes = 0;
  uint64_t hits = 0, misses = 0, evictions = 0, missed_bytes = 0, primed_made = 0, primed_hits = 0;
  // the recorder (a first step's requests of 2 MiB and more that no block freed before it could serve)
  bool recording = false;
  std::vector<int64_t> recorded;
  std::unordered_map<size_t, int64_t> freed_while_recording;

  // under mu: cached blocks to give back so that `need` more bytes keep in use + cached <= high_water
  void evict_for(size_t need, std::vector<void*>& out) {
    while (cached_bytes > 0 && in_use_bytes + cached_bytes + need > high_water) {
      const size_t short_by = in_use_bytes + cached_bytes + need - high_water;
      auto victim = idle.lower_bound(short_by);  // the smallest block that makes room alone, else the largest
      if (victim == idle.end()) victim = std::prev(idle.end());
      cached_bytes -= victim->first;
      out.push_back(victim->second);
      sticky.erase(victim->second);
      idle.erase(victim);
      ++evictions;
    }
  }
  void drain(std::vector<void*>& out) {
    for (auto& kv : idle) {
      out.push_back(kv.second);
      sticky.erase(kv.second);
    }
    idle.clear();
    cached_bytes = 0;
  }
};
BlockCache gt_blocks;
std::thread* gt_prime_thread = nullptr;  // never destroyed: a process may exit while it runs
std::atomic<bool> gt_prime_stop{false};

// fork: the child gets the lock in the state it had. Held across the fork by the forking thread, it is free in
// both processes afterwards (a DataLoader forking its workers while another thread allocates).
void gt_fork_prepare() { gt_blocks.mu.lock(); }
void gt_fork_after() { gt_blocks.mu.unlock(); }
void gt_fork_child() {
  // the priming thread does not exist in the child: forget it without joining (its primed blocks stay usable)
  gt_prime_thread = nullptr;
  gt_blocks.mu.unlock();
}

void gt_release(const std::vector<void*>& blocks) {
  for (void* p : blocks) std::free(p);
}

void gt_huge_delete(void* p) {
  c10::profiledCPUMemoryReporter().Delete(p);
  {
    std::lock_guard<std::mutex> g(gt_blocks.mu);
    auto it = gt_blocks.in_use.find(p);
    if (it != gt_blocks.in_use.end()) {
      size_t r = it->second;
      gt_blocks.in_use.erase(it);
      gt_blocks.in_use_bytes -= r;
      if (gt_blocks.recording && r >= kHugePage) ++gt_blocks.freed_while_recording[r];
      if ((gt_blocks.cache && r >= kTracked) || (gt_blocks.sticky.count(p) != 0 && r >= kHugePage)) {
        gt_blocks.idle.emplace(r, p);
        gt_blocks.cached_bytes += r;
        return;
      }
    }
  }
  std::free(p);
}

struct HugePageCPUAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    // Under the cache, blocks from 128 KiB up count towards its bound too (those release would give back to the
    // OS): a step's smaller blocks, a backward's gradients of small weights say, must not come on top of the
    // cached ones. They are served and freed as c10 does (64-byte aligned), never cached.
    const bool small = n < kHugePage;
    if (small && (n < kTracked || !gt_blocks.cache)) return gt_base_allocator->allocate(n);
    const size_t r = (n + kPage - 1) / kPage * kPage;  // not to 2 MiB: a partial last huge page costs up to 2 MiB
    void* p = nullptr;
    bool huge = true;
    std::vector<void*> evicted;
    {
      std::lock_guard<std::mutex> g(gt_blocks.mu);
      huge = gt_blocks.huge && !small;
      auto it = gt_blocks.idle.find(r);
      if (it != gt_blocks.idle.end()) {
        p = it->second;
        gt_blocks.idle.erase(it);
        gt_blocks.cached_bytes -= r;
        ++gt_blocks.hits;
      } else if (!small && (it = gt_blocks.primed.find(r)) != gt_blocks.primed.end()) {
        p = it->second;
        gt_blocks.primed.erase(it);
        gt_blocks.primed_bytes -= r;
        gt_blocks.sticky.insert(p);
        ++gt_blocks.primed_hits;
      } else {
        if (gt_blocks.cache) {  // a small block reaches here only with the cache on: every block here is cacheable
          ++gt_blocks.misses;
          gt_blocks.missed_bytes += r;
        }
        gt_blocks.evict_for(r, evicted);
      }
    }
    gt_release(evicted);
    const size_t align = small ? 64 : kHugePage;
    if (p == nullptr) {
      if (posix_memalign(&p, align, r) != 0 || p == nullptr) {
        std::vector<void*> rest;  // out of memory: give back every cached block and try once more
        {
          std::lock_guard<std::mutex> g(gt_blocks.mu);
          gt_blocks.drain(rest);
        }
        gt_release(rest);
        p = nullptr;
        if (posix_memalign(&p, align, r) != 0 || p == nullptr) {
          c10::profiledCPUMemoryReporter().OutOfMemory(n);
          TORCH_CHECK(false, "graphtrain's CPU allocator: out of memory allocating ", n, " bytes");
        }
      }
      if (huge) madvise(p, r, MADV_HUGEPAGE);  // advice only: where the kernel declines, the block still works
    }
    {
      std::lock_guard<std::mutex> g(gt_blocks.mu);
      gt_blocks.in_use.emplace(p, r);
      gt_blocks.in_use_bytes += r;
      if (gt_blocks.recording && !small) {
        auto f = gt_blocks.freed_while_recording.find(r);
        if (f != gt_blocks.freed_while_recording.end() && f->second > 0) --f->second;  // what a cache would reuse
        else if (gt_blocks.recorded.size() < kMaxRecorded) gt_blocks.recorded.push_back((int64_t)r);
      }
      if (gt_blocks.in_use_bytes > gt_blocks.high_water) gt_blocks.high_water = gt_blocks.in_use_bytes;
    }
    c10::profiledCPUMemoryReporter().New(p, n);
    return {p, p, &gt_huge_delete, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &gt_huge_delete; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};
HugePageCPUAllocator gt_huge_allocator;

// The priming thread: faults in one block per size (madvised as the allocator would), then offers it.
void gt_prime_run(std::vector<size_t> sizes, bool huge, bool follow) {
  // SCHED_IDLE: run only on a core nobody else wants. The time to use is a core idling while the main thread
  // traces in Python; a step's OpenMP threads would wait at their barriers for a core this thread holds.
  sched_param idle_param{};
  pthread_setschedparam(pthread_self(), SCHED_IDLE, &idle_param);
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (gt_prime_stop.load()) return;
    {
      // the step records its requests as it goes (the same list, when it repeats the recorded step): the ones it
      // made already were served without us, so skip to the next it will make
      std::lock_guard<std::mutex> g(gt_blocks.mu);
      if (follow && gt_blocks.recording && gt_blocks.recorded.size() > i) i = gt_blocks.recorded.size();
    }
    if (i >= sizes.size()) return;
    const size_t r = sizes[i];
    void* p = nullptr;
    if (posix_memalign(&p, kHugePage, r) != 0 || p == nullptr) return;
    if (huge) madvise(p, r, MADV_HUGEPAGE);
    // A write per page (a read would map the shared zero page). Not MADV_POPULATE_WRITE: faster alone (3.0 against
    // 1.5-1.8 GB/s with 4 KiB pages on a 2-core Zen 4 VM), it slowed the main thread's trace beside it so much that
    // the first step took longer than without priming (docs/design/first-step.md).
    volatile char* c = static_cast<volatile char*>(p);
    for (size_t off = 0; off < r; off += kPage) c[off] = 0;
    std::lock_guard<std::mutex> g(gt_blocks.mu);
    gt_blocks.primed.emplace(r, p);
    gt_blocks.primed_bytes += r;
    ++gt_blocks.primed_made;
  }
}

// Stop priming, give back the primed blocks nobody asked for; returns [blocks primed, asked for, bytes given back].
std::vector<int64_t> gt_settle() {
  gt_prime_stop.store(true);
  if (gt_prime_thread != nullptr) {
    gt_prime_thread->join();
    delete gt_prime_thread;
    gt_prime_thread = nullptr;
  }
  std::vector<void*> unused;
  int64_t made, asked, bytes;
  {
    std::lock_guard<std::mutex> g(gt_blocks.mu);
    for (auto& kv : gt_blocks.primed) unused.push_back(kv.second);
    gt_blocks.primed.clear();
    bytes = (int64_t)gt_blocks.primed_bytes;
    gt_blocks.primed_bytes = 0;
    made = (int64_t)gt_blocks.primed_made;
    asked = (int64_t)gt_blocks.primed_hits;
  }
  gt_release(unused);
  return {made, asked, bytes};
}
}  // namespace

// Install graphtrain's allocator as torch's CPU allocator (on) with huge pages and the block cache as asked, or
// give back the one it replaced (off; the cache is emptied either way when `cache` is false). Returns whether it
// is the CPU allocator now.
bool block_allocator(bool on, bool huge_pages, bool cache) {
  static const int fork_handlers = pthread_atfork(gt_fork_prepare, gt_fork_after, gt_fork_child);
  (void)fork_handlers;
  if (!on) gt_settle();
  std::vector<void*> drained;
  {
    std::lock_guard<std::mutex> g(gt_blocks.mu);
    gt_blocks.huge = huge_pages;
    gt_blocks.cache = on && cache;
    if (!gt_blocks.cache) gt_blocks.drain(drained);
  }
  gt_release(drained);
  c10::Allocator* current = c10::GetCPUAllocator();
  if (on && current != &gt_huge_allocator) {
    gt_base_allocator = current;
    c10::SetCPUAllocator(&gt_huge_allocator, /*priority=*/0);  // the default allocator's priority
  } else if (!on && current == &gt_huge_allocator && gt_base_allocator != nullptr) {
    c10::SetCPUAllocator(gt_base_allocator, /*priority=*/0);
  }
  return c10::GetCPUAllocator() == &gt_huge_allocator;
}

// Give every cached block back to the OS now and restart the bound from the bytes in use now (a peak before
// this point, a compile's say, no longer lets the cache hold more); returns the bytes given back.
int64_t block_cache_drain() {
  std::vector<void*> drained;
  size_t bytes = 0;
  {
    std::lock_guard<std::mutex> g(gt_blocks.mu);
    bytes = gt_blocks.cached_bytes;
    gt_blocks.drain(drained);
    gt_blocks.high_water = gt_blocks.in_use_bytes;
  }
  gt_release(drained);
  return (int64_t)bytes;
}

// [bytes in use, bytes cached, most bytes ever in use, hits, misses, evictions, bytes missed, bytes primed and
// not yet asked for]: blocks of 2 MiB+, and from 128 KiB while the cache is on.
std::vector<int64_t> block_cache_stats() {
  std::lock_guard<std::mutex> g(gt_blocks.mu);
  return {(int64_t)gt_blocks.in_use_bytes, (int64_t)gt_blocks.cached_bytes, (int64_t)gt_blocks.high_water,
          (int64_t)gt_blocks.hits, (int64_t)gt_blocks.misses, (int64_t)gt_blocks.evictions,
          (int64_t)gt_blocks.missed_bytes, (int64_t)gt_blocks.primed_bytes};
}

// Start faulting in blocks of these sizes (bytes, rounded to 4 KiB) in a background thread, for the requests of
// a first step. `follow`: the sizes are block_cache_record's list from an earlier process, in the step's order, so
// skip the ones the step (recording) has already asked for. Ends a priming still running first.
bool block_cache_prime(std::vector<int64_t> sizes, bool follow) {
  gt_settle();
  std::vector<size_t> rounded;
  for (int64_t n : sizes)
    if (n >= (int64_t)kHugePage) rounded.push_back(((size_t)n + kPage - 1) / kPage * kPage);
  bool huge;
  {
    std::lock_guard<std::mutex> g(gt_blocks.mu);
    gt_blocks.primed_made = gt_blocks.primed_hits = 0;
    huge = gt_blocks.huge;
  }
  gt_prime_stop.store(false);
  gt_prime_thread = new std::thread(gt_prime_run, std::move(rounded), huge, follow);
  return true;
}

// Stop faulting in more blocks (the ones primed stay offered until block_cache_settle).
void block_cache_prime_stop() { gt_prime_stop.store(true); }

// End priming: [blocks primed, of them asked for, bytes given back unasked].
std::vector<int64_t> block_cache_settle() { return gt_settle(); }

// Record (on) or stop recording and return (off) the sizes of the requests of 2 MiB and more that no block freed
// since recording started could have served, in order: what priming must fault in for that stretch of work.
std::vector<int64_t> block_cache_record(bool on) {
  std::lock_guard<std::mutex> g(gt_blocks.mu);
  std::vector<int64_t> out;
  if (on) {
    gt_blocks.recorded.clear();
    gt_blocks.freed_while_recording.clear();
  } else {
    out.swap(gt_blocks.recorded);
    gt_blocks.freed_while_recording.clear();
  }
  gt_blocks.recording = on;
  return out;
}
