// Runs flowprefill's CUDA kernels on the CPU, for the tests that compare them with the Rust
// references on machines without a GPU. It maps the CUDA launch model onto fibers:
//
//   launch(grid, block, dynamic shared bytes):  one launch at a time (like one stream); one
//                         fiber per thread of a block (blocks of 1 to 3 dimensions), all on
//                         the calling thread, created once per launch; each runs every block of
//                         the grid in turn (blockIdx set per block), with barriers between
//                         blocks, so `__shared__` (a function-local static) and the dynamic
//                         shared memory (one buffer per launch, refilled with 0xff bytes before
//                         every block: a read before a write shows up as NaN) belong to one
//                         block at a time. A fiber runs until it waits (a barrier, a shuffle,
//                         an mma, an mbarrier), then the next one runs, round robin by thread
//                         index: a wait costs a switch of stacks, not a wake-up of an OS thread
//                         (the emulation ran one std::thread per CUDA thread before 2026-11-30,
//                         about 5x slower on two cores)
//   __syncthreads()       a barrier of the block's threads
//   __syncwarp(), shuffles, __any_sync  a barrier of the warp's threads (32, or fewer in a
//                         last, partial warp) and an exchange array per warp
//   mma.sync m16n8k16     the lanes scatter their fragments into a per-warp staging tile by the
//                         PTX ISA's layouts, meet at a barrier, and each computes its four
//                         outputs (bf16 products are exact in f32; sums in a fixed order)
//   ldmatrix (.trans)     each lane posts its row address; each reads its words by the layout
//   cp.async              the 16 destination bytes are poisoned (0xff) at issue and written
//                         when a wait_group retires the group, so a read without the wait sees
//                         NaN or an impossible position; a group still in flight when a block
//                         ends is reported as an error of the launch
//   deadlocks             a barrier or a wait that can never complete (every live thread waits
//                         on something no thread can change) is reported and released within
//                         two rounds of the fibers, never a hang (`fiber_deadlock`). A thread that returns early
//                         arrives at the block's end, the barrier `__syncthreads` also uses:
//                         it completes one more `__syncthreads` of the others (as with the
//                         threads before); the kernels return early only where the others no
//                         longer use `__syncthreads` (flash_hopper.cu's idle producer warps)
//
// What it cannot show (the README lists it): races between blocks (blocks run one after the
// other), memory-ordering and coherence bugs, the hardware's summation order inside mma,
// shared-memory bank conflicts, the real warp scheduler (lanes of a warp are fibers that meet
// at barriers, not lock-step; between two waits a thread runs alone, in a fixed order: the
// last to arrive at a barrier goes on at once, the others in turn by thread index, forwards
// and backwards in alternate rounds; so a missing barrier shows only where that order has a
// thread read before its writer wrote or write before its reader read, where OS threads could
// show any order, at random), occupancy and speed. Kernels must keep every lane of a warp in
// every shuffle, mma and ldmatrix.

#pragma once

#define FP_CPU_SHIM 1

#include <math.h>

#include <sys/mman.h>
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
    dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

namespace fp_shim {

inline void fail(const std::string& what);

// ---- Fibers: the threads of a launch take turns on the calling thread. ----

// One CUDA thread's fiber: its stack, where it stopped, whether its work is done.
struct Fiber {
    unsigned char* stack = nullptr;  // the lowest usable byte of FIBER_STACK (a guard page below)
    void* sp = nullptr;  // its saved stack pointer while it does not run (x86-64)
    ucontext_t ctx;      // the same, elsewhere
    bool done = false;
};

// The running fiber (null outside a launch) and the scheduler's place while one runs. One
// launch at a time (launch_lock), so one scheduler in the process.
inline Fiber* fiber_now = nullptr;
inline void* scheduler_sp = nullptr;
inline ucontext_t scheduler_ctx;

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(FP_FIBER_UCONTEXT)
#define FP_FIBER_ASM 1
// Saves the callee-saved registers on this stack and its pointer in *save, then continues the
// stack at `load` where its own call of this function saved them (or a fresh fiber's frame).
// Nothing else needs saving across a call (System V AMD64 ABI); the floating-point control
// words are the same for every fiber.
__attribute__((naked, noinline)) static void fiber_switch(void** save, void* load) {
    asm("pushq %rbp\n\t"
        "pushq %rbx\n\t"
        "pushq %r12\n\t"
        "pushq %r13\n\t"
        "pushq %r14\n\t"
        "pushq %r15\n\t"
        "movq %rsp, (%rdi)\n\t"
        "movq %rsi, %rsp\n\t"
        "popq %r15\n\t"
        "popq %r14\n\t"
        "popq %r13\n\t"
        "popq %r12\n\t"
        "popq %rbx\n\t"
        "popq %rbp\n\t"
        "ret\n\t");
}
#else
// Elsewhere (or built with -DFP_FIBER_UCONTEXT) ucontext's swapcontext: a system call for
// the signal mask per switch, slower.
#define FP_FIBER_ASM 0
#endif

// The running fiber lets the next one run; returns when its turn comes again.
inline void fiber_yield() {
    Fiber* f = fiber_now;
    if (f == nullptr) {
        return;
    }
#if FP_FIBER_ASM
    fiber_switch(&f->sp, scheduler_sp);
#else
    swapcontext(&f->ctx, &scheduler_ctx);
#endif
}

// Deadlocks, found exactly: the launch's progress is a count bumped whenever a thread arrives
// at a barrier, leaves a wait, changes an mbarrier or finishes (`moved`). A thread that runs
// does one of these before it yields again; so two whole rounds of the scheduler without a
// bump mean every live thread waits on something no thread can change any more. The
// scheduler then sets `fiber_deadlock`, and every wait that sees it reports what it waited for
// (`fail`, which keeps the first report as the launch's error) and gives up: never a hang, and
// never a timeout mistaken for one (a thread may wait for the others' long work legitimately).
// A wait gives up only after it has yielded, so one reached in the round that releases the
// others is not failed at once.
inline unsigned long long fiber_progress = 0;
inline bool fiber_deadlock = false;
inline void moved() { fiber_progress++; }

// A barrier of `count` fibers: each arrival waits (yielding) until the last one arrives. One
// that can never complete is reported and released (`fiber_deadlock`).
struct FiberBarrier {
    explicit FiberBarrier(std::ptrdiff_t count) : count((unsigned)count) {}
    unsigned count;
    unsigned arrived = 0;
    unsigned long long generation = 0;
    void arrive_and_wait() {
        moved();
        const unsigned long long gen = generation;
        if (++arrived == count) {
            arrived = 0;
            generation++;
            return;
        }
        while (generation == gen) {
            fiber_yield();
            if (generation == gen && fiber_deadlock) {
                fail("a barrier of " + std::to_string(count) + " threads can never complete (" +
                     std::to_string(arrived) + " arrived, the others wait elsewhere or have finished)");
                arrived = 0;
                generation++;
            }
        }
        moved();
    }
};

struct Warp {
    explicit Warp(std::ptrdiff_t lanes) : bar(lanes), lanes((unsigned)lanes) {}
    FiberBarrier bar;
    unsigned lanes;
    uint64_t slot[32] = {};
    // mma staging: A 16x16, B 16x8 (k x n), as floats (bf16 values are exact in f32).
    float mma_a[16][16] = {};
    float mma_b[16][8] = {};
};

// What a wgmma.mma_async of one thread names (all 128 of a warpgroup must agree).
struct WgmmaIssue {
    uint64_t da = 0, db = 0;
    int n = 0;
    bool rs = false, trans_b = false, accumulate = false;
    bool operator!=(const WgmmaIssue& o) const {
        return da != o.da || db != o.db || n != o.n || rs != o.rs || trans_b != o.trans_b ||
               accumulate != o.accumulate;
    }
};

// Four warps (cpu_shim_hopper.h): a barrier of their threads, what each issued, and the A
// operand of a register-sourced wgmma (64 x 16).
struct WarpGroup {
    explicit WarpGroup(std::ptrdiff_t lanes) : bar(lanes), lanes((unsigned)lanes) {}
    FiberBarrier bar;
    unsigned lanes;
    WgmmaIssue issue[128];
    float a_stage[64][16] = {};
};

struct Block {
    explicit Block(unsigned threads) : bar(threads) {
        for (unsigned w = 0; w < (threads + 31) / 32; w++) {
            unsigned lanes = threads - 32 * w < 32 ? threads - 32 * w : 32;
            warps.push_back(std::make_unique<Warp>(lanes));
        }
        for (unsigned g = 0; g < (threads + 127) / 128; g++) {
            unsigned lanes = threads - 128 * g < 128 ? threads - 128 * g : 128;
            groups.push_back(std::make_unique<WarpGroup>(lanes));
        }
    }
    FiberBarrier bar;
    std::vector<std::unique_ptr<Warp>> warps;
    std::vector<std::unique_ptr<WarpGroup>> groups;
};

// One asynchronous copy of `size` bytes (16 or 4): src_bytes from src, zeros after.
struct AsyncCopy {
    void* dst;
    const void* src;
    unsigned src_bytes;
    unsigned size;
};

// The running CUDA thread's own state (and cpu_shim_hopper.h's wgmma state): plain globals,
// since one launch runs at a time (`launch_lock`) and all of its threads are fibers of the
// launching thread; `ThreadState` swaps each fiber's copy in while it runs.
inline dim3 thread_idx;
inline unsigned thread_linear = 0;
inline dim3 block_idx;
inline Block* block = nullptr;
inline std::vector<AsyncCopy> open_group;
inline std::deque<std::vector<AsyncCopy>> committed;
inline dim3 block_dim;
inline dim3 grid_dim;
inline std::vector<unsigned char> dynamic_shared;
inline unsigned dynamic_bytes = 0;  // what the launch asked for
inline std::mutex error_lock;
inline std::string launch_error;

inline unsigned lane() { return thread_linear % 32; }
inline Warp& warp() { return *block->warps[thread_linear / 32]; }

inline void fail(const std::string& what) {
    std::lock_guard<std::mutex> g(error_lock);
    if (launch_error.empty()) {
        launch_error = what;
    }
}

template <typename T>
inline T exchange(T v, unsigned src_lane) {
    static_assert(sizeof(T) <= 8, "shuffles move at most 8 bytes");
    Warp& w = warp();
    uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    w.slot[lane()] = bits;
    w.bar.arrive_and_wait();
    uint64_t got = w.slot[src_lane % 32];
    w.bar.arrive_and_wait();
    T out;
    std::memcpy(&out, &got, sizeof(T));
    return out;
}

// A vote: true when pred holds on some lane of the warp.
inline bool vote_any(bool pred) {
    Warp& w = warp();
    w.slot[lane()] = pred ? 1 : 0;
    w.bar.arrive_and_wait();
    bool any = false;
    for (unsigned l = 0; l < w.lanes; l++) {
        any = any || w.slot[l] != 0;
    }
    w.bar.arrive_and_wait();
    return any;
}

// The launch's dynamic shared memory, aligned to 1024 bytes (the shared addresses of
// cpu_shim_hopper.h are offsets from it).
inline unsigned char* dynamic_smem() {
    return (unsigned char*)(((uintptr_t)dynamic_shared.data() + 1023) & ~(uintptr_t)1023);
}

}  // namespace fp_shim

#define threadIdx (fp_shim::thread_idx)
#define blockIdx (fp_shim::block_idx)
#define blockDim (fp_shim::block_dim)
#define gridDim (fp_shim::grid_dim)
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __restrict__
#define __launch_bounds__(...)
struct float2 {
    float x, y;
};
inline float2 make_float2(float x, float y) { return float2{x, y}; }
#define FP_DYNAMIC_SMEM(name) unsigned char* name = fp_shim::dynamic_smem()

inline void __syncthreads() { fp_shim::block->bar.arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { fp_shim::warp().bar.arrive_and_wait(); }

inline int __any_sync(unsigned, int pred) { return fp_shim::vote_any(pred != 0) ? 1 : 0; }

template <typename T>
inline T __shfl_xor_sync(unsigned, T v, int lane_mask) {
    return fp_shim::exchange(v, fp_shim::lane() ^ (unsigned)lane_mask);
}
template <typename T>
inline T __shfl_sync(unsigned, T v, int src_lane) {
    return fp_shim::exchange(v, (unsigned)src_lane);
}

inline float __uint_as_float(unsigned x) {
    float f;
    std::memcpy(&f, &x, 4);
    return f;
}
inline unsigned __float_as_uint(float f) {
    unsigned x;
    std::memcpy(&x, &f, 4);
    return x;
}
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline void sincos(double x, double* s, double* c) {
    *s = std::sin(x);
    *c = std::cos(x);
}
using std::max;
using std::min;

// ---- The twins of common.cuh's PTX wrappers. ----

namespace fp_shim {
inline unsigned short bf16_round(float f) {
    unsigned x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) {
        return (unsigned short)((x >> 16) | 0x40u);
    }
    x += 0x7fffu + ((x >> 16) & 1u);
    return (unsigned short)(x >> 16);
}
inline float bf16_lo(unsigned r) { return __uint_as_float(r << 16); }
inline float bf16_hi(unsigned r) { return __uint_as_float(r & 0xffff0000u); }
}  // namespace fp_shim

inline void fp_mma_bf16_16816(float d[4], const unsigned a[4], const unsigned b[2]) {
    using namespace fp_shim;
    Warp& w = warp();
    unsigned g = lane() / 4, t = lane() % 4;
    w.mma_a[g][2 * t] = bf16_lo(a[0]);
    w.mma_a[g][2 * t + 1] = bf16_hi(a[0]);
    w.mma_a[g + 8][2 * t] = bf16_lo(a[1]);
    w.mma_a[g + 8][2 * t + 1] = bf16_hi(a[1]);
    w.mma_a[g][2 * t + 8] = bf16_lo(a[2]);
    w.mma_a[g][2 * t + 9] = bf16_hi(a[2]);
    w.mma_a[g + 8][2 * t + 8] = bf16_lo(a[3]);
    w.mma_a[g + 8][2 * t + 9] = bf16_hi(a[3]);
    w.mma_b[2 * t][g] = bf16_lo(b[0]);
    w.mma_b[2 * t + 1][g] = bf16_hi(b[0]);
    w.mma_b[2 * t + 8][g] = bf16_lo(b[1]);
    w.mma_b[2 * t + 9][g] = bf16_hi(b[1]);
    w.bar.arrive_and_wait();
    for (int e = 0; e < 4; e++) {
        unsigned row = g + (e >= 2 ? 8 : 0), col = 2 * t + (e & 1);
        float acc = 0.0f;
        for (int k = 0; k < 16; k++) {
            acc += w.mma_a[row][k] * w.mma_b[k][col];
        }
        d[e] += acc;
    }
    w.bar.arrive_and_wait();
}

namespace fp_shim {
template <bool Trans>
inline void ldmatrix_x4(unsigned r[4], const unsigned short* row) {
    Warp& w = warp();
    unsigned l = lane(), g = l / 4, t = l % 4;
    uint64_t addr = (uint64_t)(uintptr_t)row;
    if (addr % 16 != 0) {
        fail("ldmatrix: a row address is not 16-byte aligned");
    }
    w.slot[l] = addr;
    w.bar.arrive_and_wait();
    for (int i = 0; i < 4; i++) {
        unsigned short lo, hi;
        if (Trans) {
            lo = ((const unsigned short*)(uintptr_t)w.slot[8 * i + 2 * t])[g];
            hi = ((const unsigned short*)(uintptr_t)w.slot[8 * i + 2 * t + 1])[g];
        } else {
            const unsigned short* p = (const unsigned short*)(uintptr_t)w.slot[8 * i + g];
            lo = p[2 * t];
            hi = p[2 * t + 1];
        }
        r[i] = (unsigned)lo | ((unsigned)hi << 16);
    }
    w.bar.arrive_and_wait();
}
}  // namespace fp_shim

inline void fp_ldmatrix_x4(unsigned r[4], const unsigned short* row) { fp_shim::ldmatrix_x4<false>(r, row); }
inline void fp_ldmatrix_x4_trans(unsigned r[4], const unsigned short* row) { fp_shim::ldmatrix_x4<true>(r, row); }

// A 16-byte copy reads all 16 bytes or none: a size operand between (the last positions of a
// list) reads no more on the hardware, but compute-sanitizer's memcheck counts all 16 bytes and
// stops the kernel when they pass the allocation's end (H200, 2026-11-27); such tails are
// copied 4 bytes at a time (`fp_cp_async4`).
inline void fp_cp_async16(void* dst, const void* src, unsigned src_bytes) {
    if ((uintptr_t)dst % 16 != 0 || (src_bytes > 0 && (uintptr_t)src % 16 != 0)) {
        fp_shim::fail("cp.async: a misaligned address");
    }
    if (src_bytes != 0 && src_bytes != 16) {
        fp_shim::fail("cp.async of 16 bytes reading only some of them (copy a tail with fp_cp_async4)");
    }
    std::memset(dst, 0xff, 16);
    fp_shim::open_group.push_back({dst, src, src_bytes, 16});
}

inline void fp_cp_async4(void* dst, const void* src, unsigned src_bytes) {
    if ((uintptr_t)dst % 4 != 0 || (uintptr_t)src % 4 != 0 || (src_bytes != 0 && src_bytes != 4)) {
        fp_shim::fail("cp.async of 4 bytes: a misaligned address or another size");
    }
    std::memset(dst, 0xff, 4);
    fp_shim::open_group.push_back({dst, src, src_bytes, 4});
}

// Shared addresses (common.cuh: 32-bit on the GPU) are byte pointers here; `+ bytes` alike.
typedef unsigned char* fp_sptr;
inline fp_sptr fp_sptr_of(const void* p) { return (fp_sptr)p; }
inline void fp_ldsm_x4(unsigned r[4], fp_sptr a) { fp_shim::ldmatrix_x4<false>(r, (const unsigned short*)a); }
inline void fp_ldsm_x4_trans(unsigned r[4], fp_sptr a) { fp_shim::ldmatrix_x4<true>(r, (const unsigned short*)a); }
inline void fp_cp_async16_s(fp_sptr dst, const void* src, unsigned src_bytes) { fp_cp_async16(dst, src, src_bytes); }
inline void fp_cp_async16_full(fp_sptr dst, const void* src) { fp_cp_async16(dst, src, 16); }
inline void fp_cp_async4_s(fp_sptr dst, const void* src, unsigned src_bytes) { fp_cp_async4(dst, src, src_bytes); }

inline void fp_cp_async_commit() {
    fp_shim::committed.push_back(std::move(fp_shim::open_group));
    fp_shim::open_group.clear();
}

template <int N>
inline void fp_cp_async_wait() {
    while (fp_shim::committed.size() > (size_t)N) {
        for (const fp_shim::AsyncCopy& c : fp_shim::committed.front()) {
            std::memcpy(c.dst, c.src, c.src_bytes);
            std::memset((unsigned char*)c.dst + c.src_bytes, 0, c.size - c.src_bytes);
        }
        fp_shim::committed.pop_front();
    }
}

inline unsigned fp_pack_bf16x2(float lo, float hi) {
    return (unsigned)fp_shim::bf16_round(lo) | ((unsigned)fp_shim::bf16_round(hi) << 16);
}

inline float fp_exp2(float x) { return exp2f(x); }

#include "cpu_shim_hopper.h"

namespace fp_shim {

// One launch at a time, like one stream: `blockDim`, `gridDim`, the dynamic shared memory and
// every `__shared__` array are process-wide here, so two launches from two threads would
// share them.
inline std::mutex launch_lock;

// What is a CUDA thread's own (its registers, so to speak): the shim keeps the running one's in
// globals, which all fibers share, so each fiber's copy is swapped in while it runs and out
// when it yields.
struct ThreadState {
    dim3 thread_idx;
    unsigned thread_linear = 0;
    dim3 block_idx;
    std::vector<AsyncCopy> open_group;
    std::deque<std::vector<AsyncCopy>> committed;
    bool wgmma_fenced = false;
    std::vector<WgmmaOp> wgmma_open;
    std::deque<std::vector<WgmmaOp>> wgmma_committed;
    std::map<float*, std::pair<std::vector<float>, int>> wgmma_acc;

    void swap_with_running() {
        std::swap(thread_idx, fp_shim::thread_idx);
        std::swap(thread_linear, fp_shim::thread_linear);
        std::swap(block_idx, fp_shim::block_idx);
        open_group.swap(fp_shim::open_group);
        committed.swap(fp_shim::committed);
        std::swap(wgmma_fenced, fp_shim::wgmma_fenced);
        wgmma_open.swap(fp_shim::wgmma_open);
        wgmma_committed.swap(fp_shim::wgmma_committed);
        wgmma_acc.swap(fp_shim::wgmma_acc);
    }
};

// Stacks of fibers, kept for later launches (launches are serialised): 256 KiB each, with a
// guard page below (an overflow faults rather than writing over a neighbour).
constexpr size_t FIBER_STACK = 256 * 1024;
inline std::vector<unsigned char*> fiber_stacks;
inline std::function<void(unsigned)> fiber_body;
inline Fiber* fiber_base = nullptr;  // the launch's fibers, by thread index

inline unsigned char* fiber_stack(size_t i) {
    while (fiber_stacks.size() <= i) {
        const size_t page = 4096;
        void* m = mmap(nullptr, FIBER_STACK + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (m == MAP_FAILED) {
            return nullptr;
        }
        if (mprotect(m, page, PROT_NONE) != 0) {
            munmap(m, FIBER_STACK + page);
            return nullptr;
        }
        fiber_stacks.push_back((unsigned char*)m + page);
    }
    return fiber_stacks[i];
}

// Where a fiber starts: runs its thread's body, marks it done, and goes back to the
// scheduler for good.
inline void fiber_main() {
    Fiber* f = fiber_now;
    fiber_body((unsigned)(f - fiber_base));
    f->done = true;
    moved();
#if FP_FIBER_ASM
    void* unused = nullptr;
    fiber_switch(&unused, scheduler_sp);
#else
    swapcontext(&f->ctx, &scheduler_ctx);
#endif
    std::abort();  // a finished fiber is never resumed
}

// Runs `body(t)` for t in [0, n) as fibers, round robin, until every one has returned. Returns
// false (and runs nothing) when stacks cannot be mapped.
inline bool run_fibers(unsigned n, const std::function<void(unsigned)>& body) {
    std::vector<Fiber> fibers(n);
    std::vector<ThreadState> states(n);
    for (unsigned t = 0; t < n; t++) {
        Fiber& f = fibers[t];
        f.stack = fiber_stack(t);
        if (f.stack == nullptr) {
            return false;
        }
#if FP_FIBER_ASM
        // A frame fiber_switch pops: six saved registers, then the return address fiber_main
        // (entered with the stack 8 bytes off 16, as after a call), then a dummy return
        // address of fiber_main's own.
        uintptr_t top = ((uintptr_t)(f.stack + FIBER_STACK)) & ~(uintptr_t)15;
        void** frame = (void**)(top - 64);
        for (int r = 0; r < 6; r++) {
            frame[r] = nullptr;
        }
        frame[6] = (void*)&fiber_main;
        frame[7] = nullptr;
        f.sp = frame;
#else
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = f.stack;
        f.ctx.uc_stack.ss_size = FIBER_STACK;
        f.ctx.uc_link = nullptr;
        makecontext(&f.ctx, (void (*)())&fiber_main, 0);
#endif
    }
    fiber_body = body;
    fiber_base = fibers.data();
    fiber_deadlock = false;
    unsigned live = n, idle_rounds = 0;
    for (unsigned long long round = 0; live > 0; round++) {
        const unsigned long long before = fiber_progress;
        // Rounds alternate the order (by thread index, then back): a missing barrier shows
        // whichever of two threads runs ahead, the reader or the writer.
        for (unsigned k = 0; k < n; k++) {
            const unsigned t = round % 2 == 0 ? k : n - 1 - k;
            Fiber& f = fibers[t];
            if (f.done) {
                continue;
            }
            states[t].swap_with_running();
            fiber_now = &f;
#if FP_FIBER_ASM
            fiber_switch(&scheduler_sp, f.sp);
#else
            swapcontext(&scheduler_ctx, &f.ctx);
#endif
            fiber_now = nullptr;
            states[t].swap_with_running();
            if (f.done) {
                live--;
            }
        }
        // Two rounds in which no thread moved: every live one waits for good (see `moved`).
        if (fiber_progress != before) {
            idle_rounds = 0;
            fiber_deadlock = false;
        } else if (++idle_rounds >= 2) {
            fiber_deadlock = true;
        }
    }
    fiber_deadlock = false;
    fiber_body = nullptr;
    fiber_base = nullptr;
    return true;
}

// Runs `kernel(args...)` over `grid` x `block` with `shared_bytes` of dynamic shared memory.
// Returns the first error a primitive reported (empty: none).
template <typename... P, typename... A>
std::string launch(dim3 grid, dim3 block_shape, unsigned shared_bytes, void (*kernel)(P...), A... args) {
    std::lock_guard<std::mutex> one_at_a_time(launch_lock);
    unsigned threads = block_shape.x * block_shape.y * block_shape.z;
    block_dim = block_shape;
    grid_dim = grid;
    launch_error.clear();
    dynamic_bytes = shared_bytes;
    dynamic_shared.assign(shared_bytes + 16 + 1024, 0xff);
    Block shared_block(threads);
    block = &shared_block;
    const bool ran = run_fibers(threads, [&](unsigned t) {
        thread_linear = t;
        thread_idx = dim3(t % block_shape.x, (t / block_shape.x) % block_shape.y, t / (block_shape.x * block_shape.y));
        open_group.clear();
        committed.clear();
        for (unsigned z = 0; z < grid.z; z++) {
            for (unsigned y = 0; y < grid.y; y++) {
                for (unsigned x = 0; x < grid.x; x++) {
                    block_idx = dim3(x, y, z);
                    if (t == 0) {
                        std::fill(dynamic_shared.begin(), dynamic_shared.end(), 0xff);
                        hopper_block_start();
                    }
                    hopper_thread_start();
                    shared_block.bar.arrive_and_wait();
                    kernel(args...);
                    hopper_thread_end();
                    if (!committed.empty() || !open_group.empty()) {
                        fail("cp.async groups still in flight when a block ended (a missing wait_group)");
                        open_group.clear();
                        committed.clear();
                    }
                    shared_block.bar.arrive_and_wait();
                    if (t == 0) {
                        hopper_block_end();
                    }
                }
            }
        }
    });
    block = nullptr;
    if (!ran) {
        fail("could not map the stacks of " + std::to_string(threads) + " fibers");
    }
    return launch_error;
}

}  // namespace fp_shim
