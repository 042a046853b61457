// The CUDA kernels of kernels/cuda/, compiled for the CPU with the launch shim, behind one C
// entry point shaped like cuLaunchKernel: a kernel name, the launch shape, and one 8-byte cell
// per argument. The files and the table of kernels come from the sources (build.rs writes
// files.inc and kernels.inc; shapes.inc is the launch-shape header of
// flowprefill_kernels::gpu::shapes, and configs.inc declares flash2.cu's other configurations,
// built in translation units of their own); the argument types are checked here against each kernel's real
// C++ parameter types, besides the check of the Rust side against the `.cu` declarations
// (flowprefill_kernels::gpu::Call::check).

#include "cpu_shim.h"
// clang-format off
#include "shapes.inc"
#include "common.cuh"
#include "flash_tiles.cuh"
#include "hopper.cuh"
#include "files.inc"
#include "configs.inc"
// clang-format on

#include <cstdio>
#include <type_traits>
#include <utility>

namespace {

// The codes of flowprefill_kernels::gpu::Param::code.
template <typename T>
constexpr int type_code() {
    using P = std::remove_cv_t<std::remove_pointer_t<T>>;
    if constexpr (std::is_pointer_v<T>) {
        if constexpr (std::is_same_v<P, float>) return 1;
        if constexpr (std::is_same_v<P, bf16_t>) return 2;
        if constexpr (std::is_same_v<P, u32>) return 3;
        if constexpr (std::is_same_v<P, double>) return 4;
        if constexpr (std::is_same_v<P, u64>) return 8;
        return -1;
    } else {
        if constexpr (std::is_same_v<T, u32>) return 5;
        if constexpr (std::is_same_v<T, u64>) return 6;
        if constexpr (std::is_same_v<T, float>) return 7;
        return -1;
    }
}

template <typename T>
T from_cell(uint64_t cell) {
    static_assert(sizeof(T) <= 8);
    T v;
    std::memcpy(&v, &cell, sizeof(T));  // 4-byte values sit in the low half (little-endian)
    return v;
}

template <typename... P, size_t... I>
std::string call(void (*kernel)(P...), dim3 grid, dim3 block, unsigned shared, const uint64_t* cells,
                 std::index_sequence<I...>) {
    return fp_shim::launch(grid, block, shared, kernel, from_cell<P>(cells[I])...);
}

template <typename... P>
std::string invoke(const char* name, void (*kernel)(P...), dim3 grid, dim3 block, unsigned shared,
                   const uint64_t* cells, const int* codes, int nargs) {
    constexpr int want[] = {type_code<P>()...};
    if (nargs != (int)sizeof...(P)) {
        return std::string(name) + ": " + std::to_string(nargs) + " arguments for " +
               std::to_string(sizeof...(P)) + " parameters";
    }
    for (int i = 0; i < nargs; i++) {
        if (codes[i] != want[i]) {
            return std::string(name) + ": argument " + std::to_string(i) + " has type code " +
                   std::to_string(codes[i]) + ", the kernel's parameter " + std::to_string(want[i]);
        }
    }
    return call(kernel, grid, block, shared, cells, std::index_sequence_for<P...>{});
}

}  // namespace

// Launches `kernel` and waits for it. Returns 0, or 1 with a message in err (NUL-terminated,
// at most err_len bytes): an unknown kernel, wrong arguments, or what a primitive reported.
extern "C" int emu_launch(const char* kernel, const unsigned* grid, const unsigned* block, unsigned shared_bytes,
                          const uint64_t* cells, const int* codes, int nargs, char* err, unsigned err_len) {
    dim3 g(grid[0], grid[1], grid[2]), b(block[0], block[1], block[2]);
    std::string e = std::string(kernel) + ": no such kernel";
    bool found = false;
#define FP_EMU_KERNEL(name)                                                     \
    if (!found && std::strcmp(kernel, #name) == 0) {                            \
        found = true;                                                           \
        e = invoke(#name, name, g, b, shared_bytes, cells, codes, nargs);       \
    }
#include "kernels.inc"
#undef FP_EMU_KERNEL
    if (e.empty()) {
        return 0;
    }
    std::snprintf(err, err_len, "%s", e.c_str());
    return 1;
}

// common.cuh's polynomial 2^x (the Hopper configurations' softmax on the FMA pipe), one value
// at a time, for its test against exp2 in double precision.
extern "C" float emu_exp2_poly(float x) { return fp_exp2_poly(x); }
