// Runs flowprefill's CUDA kernels on the CPU, for the tests that compare them with the Rust
// references on machines without a GPU. It maps the CUDA launch model onto threads:
//
//   launch(grid, block):  one launch at a time (like one stream); block.x std::threads,
//                         created once per launch; each runs every
//                         block of the grid in turn (blockIdx set per block), with a barrier
//                         between blocks, so `__shared__` (a function-local static) belongs to
//                         one block at a time
//   __syncthreads()       a barrier of the block's threads
//   __syncwarp(), shuffles  a barrier of the warp's threads (32, or fewer in a last, partial
//                         warp) and an exchange array per warp
//
// What it cannot show (the README lists it): races between blocks (blocks run one after the
// other), memory-ordering and coherence bugs, tensor-core instructions, the real warp
// scheduler (lanes of a warp are threads that meet at barriers, not lock-step), occupancy and
// speed. Kernels must keep every lane of a warp in every shuffle, and one-dimensional blocks.

#pragma once

#include <math.h>

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
    dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

namespace fp_shim {

struct Warp {
    explicit Warp(std::ptrdiff_t lanes) : bar(lanes) {}
    std::barrier<> bar;
    uint64_t slot[32] = {};
};

struct Block {
    explicit Block(unsigned threads) : bar(threads) {
        for (unsigned w = 0; w < (threads + 31) / 32; w++) {
            unsigned lanes = threads - 32 * w < 32 ? threads - 32 * w : 32;
            warps.push_back(std::make_unique<Warp>(lanes));
        }
    }
    std::barrier<> bar;
    std::vector<std::unique_ptr<Warp>> warps;
};

inline thread_local dim3 thread_idx;
inline thread_local dim3 block_idx;
inline thread_local Block* block = nullptr;
inline dim3 block_dim;
inline dim3 grid_dim;

inline Warp& warp() { return *block->warps[thread_idx.x / 32]; }

template <typename T>
inline T exchange(T v, unsigned src_lane) {
    static_assert(sizeof(T) <= 8, "shuffles move at most 8 bytes");
    Warp& w = warp();
    unsigned lane = thread_idx.x % 32;
    uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    w.slot[lane] = bits;
    w.bar.arrive_and_wait();
    uint64_t got = w.slot[src_lane % 32];
    w.bar.arrive_and_wait();
    T out;
    std::memcpy(&out, &got, sizeof(T));
    return out;
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

inline void __syncthreads() { fp_shim::block->bar.arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { fp_shim::warp().bar.arrive_and_wait(); }

template <typename T>
inline T __shfl_xor_sync(unsigned, T v, int lane_mask) {
    return fp_shim::exchange(v, (fp_shim::thread_idx.x % 32) ^ (unsigned)lane_mask);
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
using std::min;

namespace fp_shim {

// One launch at a time, like one stream: `blockDim`, `gridDim` and every `__shared__` array
// are process-wide here, so two launches from two threads would share them.
inline std::mutex launch_lock;

// Runs `kernel(args...)` over `grid` x `block` (one-dimensional blocks).
template <typename... P, typename... A>
void launch(dim3 grid, dim3 block_shape, void (*kernel)(P...), A... args) {
    std::lock_guard<std::mutex> one_at_a_time(launch_lock);
    unsigned threads = block_shape.x;
    block_dim = block_shape;
    grid_dim = grid;
    Block shared_block(threads);
    std::vector<std::thread> pool;
    pool.reserve(threads);
    for (unsigned t = 0; t < threads; t++) {
        pool.emplace_back([&, t] {
            thread_idx = dim3(t, 0, 0);
            block = &shared_block;
            for (unsigned z = 0; z < grid.z; z++) {
                for (unsigned y = 0; y < grid.y; y++) {
                    for (unsigned x = 0; x < grid.x; x++) {
                        block_idx = dim3(x, y, z);
                        kernel(args...);
                        shared_block.bar.arrive_and_wait();
                    }
                }
            }
        });
    }
    for (auto& th : pool) {
        th.join();
    }
}

}  // namespace fp_shim
