// cellc: compile generated CUDA C++ kernels as host C++, to run them on a
// machine without a GPU (tests compare them with the interpreter).
//
//   g++ -std=c++20 -O1 -pthread -shared -fPIC -include cuda_host_emu.h -x c++ kernels.cu
//
// Two launch modes, both exported for every kernel by CELLC_EMU_EXPORT as
// functions taking cuLaunchKernel-style argument pointers:
//
//   cellc_launch_<name>(grid, block, args)         threaded: one OS thread per
//       CUDA thread of a block, blocks one after another; __syncthreads() is a
//       std::barrier, __shared__ memory one static copy per kernel (right
//       because blocks never overlap). Right for every kernel.
//   cellc_launch_grid_<name>(grid, block, shared, args)  cooperative: every
//       block at once, one OS thread per CUDA thread of the grid; a block's
//       `shared` bytes of dynamic shared memory (CELLC_DYNAMIC_SHARED) its own,
//       cellc_grid_sync() a std::barrier over the grid. For the step-loop
//       kernels, which keep state in dynamic shared memory only.
//   cellc_launch_serial_<name>(grid, block, args)  serial: every (block,
//       thread) in turn on the calling thread, __syncthreads() a no-op. Right
//       only where a block's threads never communicate: lane-form kernels, or
//       any kernel launched with one thread per block.
//
// Warp-level tensor-core products (cellc_mma_bf16, _f16, _tf32: PTX's
// mma.sync fragments) are emulated by an exchange among a warp's threads:
// each publishes its fragments, a barrier, each computes its sums from the
// whole tile, a barrier. Not emulated: other warp intrinsics (the kernels
// use none), the GPU memory model.
#pragma once
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

struct cellc_dim3 {
    unsigned x = 1, y = 1, z = 1;
};
#define CELLC_HOST_EMULATION 1
namespace cellc_emu {
inline thread_local cellc_dim3 tid, bid, bdim, gdim;
inline thread_local std::barrier<>* block_barrier = nullptr;
inline thread_local std::barrier<>* grid_barrier = nullptr;
inline thread_local float* dynamic_shared = nullptr;
// A warp's fragment exchange for the emulated mma.sync.
struct Warp {
    explicit Warp(std::ptrdiff_t lanes) : arrived(lanes) {}
    std::barrier<> arrived;
    unsigned a[32][4] = {};
    unsigned b[32][2] = {};
};
inline thread_local Warp* warp = nullptr;
// The warps of a block of `threads` threads (the last may be partial).
inline std::vector<std::unique_ptr<Warp>> warps_of(unsigned threads) {
    std::vector<std::unique_ptr<Warp>> warps;
    for (unsigned w = 0; w * 32 < threads; ++w) warps.push_back(std::make_unique<Warp>(std::min(32u, threads - 32 * w)));
    return warps;
}
}  // namespace cellc_emu
#define CELLC_DYNAMIC_SHARED(name) float* const name = ::cellc_emu::dynamic_shared
#define threadIdx (::cellc_emu::tid)
#define blockIdx (::cellc_emu::bid)
#define blockDim (::cellc_emu::bdim)
#define gridDim (::cellc_emu::gdim)
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
// Blocks run one at a time, so one static copy per kernel is what the
// threads of the running block share.
#define __shared__ static

inline void __syncthreads() {
    if (::cellc_emu::block_barrier) ::cellc_emu::block_barrier->arrive_and_wait();
}
// Every thread of a cooperative launch waits for all (cellc_launch_grid_).
inline void cellc_grid_sync(unsigned*) {
    if (::cellc_emu::grid_barrier) ::cellc_emu::grid_barrier->arrive_and_wait();
}
inline float __uint_as_float(unsigned x) {
    float f;
    std::memcpy(&f, &x, sizeof f);
    return f;
}
inline unsigned __float_as_uint(float x) {
    unsigned u;
    std::memcpy(&u, &x, sizeof u);
    return u;
}
inline unsigned __umulhi(unsigned a, unsigned b) {
    return static_cast<unsigned>((static_cast<unsigned long long>(a) * b) >> 32);
}
inline float __int_as_float(unsigned x) {
    float f;
    std::memcpy(&f, &x, sizeof f);
    return f;
}
#include <math.h>  // expf, tanhf, ... in the global namespace, as CUDA has them

// cvt.rn.f16.f32's bits of x, which cellc_round(x, 2) has already rounded.
inline unsigned cellc_half_bits(float x) {
    const unsigned u = __float_as_uint(x), sign = (u >> 16) & 0x8000u;
    const float a = fabsf(x);
    if (std::isnan(x)) return sign | 0x7e00u;
    if (a >= 65536.0f) return sign | 0x7c00u;
    if (a < 6.103515625e-05f) return sign | static_cast<unsigned>(a * 16777216.0f);  // subnormal: 2^-24 steps
    return sign | ((((u >> 23) & 0xffu) - 112u) << 10) | ((u >> 13) & 0x3ffu);
}
inline float cellc_half_value(unsigned h) {
    const float magnitude = (h & 0x7c00u) == 0x7c00u ? ((h & 0x3ffu) ? NAN : INFINITY)
                            : (h & 0x7c00u) == 0u   ? static_cast<float>(h & 0x3ffu) * 5.9604644775390625e-08f
                                                    : __uint_as_float(((((h >> 10) & 0x1fu) + 112u) << 23) | ((h & 0x3ffu) << 13));
    return (h & 0x8000u) ? -magnitude : magnitude;
}
namespace cellc_emu {
// One mma.sync: d (this lane's four sums) += A B over the warp's fragments.
// `kind` 1 bf16 and 2 fp16 (m16n8k16), 3 TF32 (m16n8k8, the low 13 bits of
// each operand ignored, as the tensor cores do).
inline void mma(int kind, float d[4], const unsigned a[4], const unsigned b[2]) {
    Warp& w = *warp;
    const unsigned lane = tid.x & 31u, g = lane >> 2, t = lane & 3u;
    std::memcpy(w.a[lane], a, sizeof w.a[lane]);
    std::memcpy(w.b[lane], b, sizeof w.b[lane]);
    w.arrived.arrive_and_wait();
    const auto value = [kind](unsigned word, unsigned k) {
        if (kind == 3) return __uint_as_float(word & ~0x1fffu);
        const unsigned h = (k & 1u) ? word >> 16 : word & 0xffffu;
        return kind == 1 ? __uint_as_float(h << 16) : cellc_half_value(h);
    };
    const auto A = [&](unsigned row, unsigned k) {
        if (kind == 3) return value(w.a[(row & 7u) * 4 + (k & 3u)][(row >> 3) + 2 * (k >> 2)], k);
        return value(w.a[(row & 7u) * 4 + ((k & 7u) >> 1)][(row >> 3) + 2 * (k >> 3)], k);
    };
    const auto B = [&](unsigned k, unsigned col) {
        if (kind == 3) return value(w.b[col * 4 + (k & 3u)][k >> 2], k);
        return value(w.b[col * 4 + ((k & 7u) >> 1)][k >> 3], k);
    };
    const unsigned depth = kind == 3 ? 8 : 16;
    float sums[4];
    for (unsigned i = 0; i < 4; ++i) {
        const unsigned row = g + 8 * (i >> 1), col = 2 * t + (i & 1u);
        float acc = d[i];
        for (unsigned k = 0; k < depth; ++k) acc = fmaf(A(row, k), B(k, col), acc);
        sums[i] = acc;
    }
    w.arrived.arrive_and_wait();
    std::memcpy(d, sums, sizeof sums);
}
}  // namespace cellc_emu
inline void cellc_mma_bf16(float d[4], const unsigned a[4], const unsigned b[2]) { ::cellc_emu::mma(1, d, a, b); }
inline void cellc_mma_f16(float d[4], const unsigned a[4], const unsigned b[2]) { ::cellc_emu::mma(2, d, a, b); }
inline void cellc_mma_tf32(float d[4], const unsigned a[4], const unsigned b[2]) { ::cellc_emu::mma(3, d, a, b); }

namespace cellc_emu {
template <class... P, std::size_t... I>
void run_block(void (*k)(P...), cellc_dim3 g, cellc_dim3 b, cellc_dim3 block, void** args, std::index_sequence<I...>) {
    const unsigned n = b.x * b.y * b.z;
    std::barrier<> bar(n);
    const auto warps = warps_of(n);
    std::vector<std::thread> threads;
    threads.reserve(n);
    for (unsigned t = 0; t < n; ++t) {
        threads.emplace_back([&, t] {
            gdim = g;
            bdim = b;
            bid = block;
            tid = {t % b.x, (t / b.x) % b.y, t / (b.x * b.y)};
            block_barrier = &bar;
            warp = warps[t / 32].get();
            k(*static_cast<std::remove_reference_t<P>*>(args[I])...);
        });
    }
    for (auto& th : threads) th.join();
}
template <class... P>
void launch(void (*k)(P...), unsigned grid, unsigned block, void** args) {
    const cellc_dim3 g{grid, 1, 1}, b{block, 1, 1};
    for (unsigned bx = 0; bx < grid; ++bx) run_block(k, g, b, cellc_dim3{bx, 0, 0}, args, std::index_sequence_for<P...>{});
}
template <class... P, std::size_t... I>
void launch_grid_impl(void (*k)(P...), unsigned grid, unsigned block, unsigned shared, void** args,
                      std::index_sequence<I...>) {
    const cellc_dim3 g{grid, 1, 1}, b{block, 1, 1};
    std::barrier<> all(static_cast<std::ptrdiff_t>(grid) * block);
    std::vector<std::unique_ptr<std::barrier<>>> blocks;
    std::vector<std::vector<std::unique_ptr<Warp>>> warps;
    for (unsigned bx = 0; bx < grid; ++bx) {
        blocks.push_back(std::make_unique<std::barrier<>>(block));
        warps.push_back(warps_of(block));
    }
    std::vector<std::vector<float>> memory(grid, std::vector<float>((shared + 3) / 4));
    std::vector<std::thread> threads;
    threads.reserve(static_cast<std::size_t>(grid) * block);
    for (unsigned bx = 0; bx < grid; ++bx) {
        for (unsigned t = 0; t < block; ++t) {
            threads.emplace_back([&, bx, t] {
                gdim = g;
                bdim = b;
                bid = {bx, 0, 0};
                tid = {t, 0, 0};
                block_barrier = blocks[bx].get();
                warp = warps[bx][t / 32].get();
                grid_barrier = &all;
                dynamic_shared = memory[bx].data();
                k(*static_cast<std::remove_reference_t<P>*>(args[I])...);
            });
        }
    }
    for (auto& th : threads) th.join();
}
template <class... P>
void launch_grid(void (*k)(P...), unsigned grid, unsigned block, unsigned shared, void** args) {
    launch_grid_impl(k, grid, block, shared, args, std::index_sequence_for<P...>{});
}
template <class... P, std::size_t... I>
void launch_serial_impl(void (*k)(P...), unsigned grid, unsigned block, void** args, std::index_sequence<I...>) {
    gdim = {grid, 1, 1};
    bdim = {block, 1, 1};
    block_barrier = nullptr;
    for (unsigned bx = 0; bx < grid; ++bx) {
        for (unsigned t = 0; t < block; ++t) {
            bid = {bx, 0, 0};
            tid = {t, 0, 0};
            k(*static_cast<std::remove_reference_t<P>*>(args[I])...);
        }
    }
}
template <class... P>
void launch_serial(void (*k)(P...), unsigned grid, unsigned block, void** args) {
    launch_serial_impl(k, grid, block, args, std::index_sequence_for<P...>{});
}
}  // namespace cellc_emu

#define CELLC_EMU_EXPORT(name)                                                                 \
    extern "C" void cellc_launch_##name(unsigned grid, unsigned block, void** args) {         \
        ::cellc_emu::launch(&name, grid, block, args);                                         \
    }                                                                                          \
    extern "C" void cellc_launch_serial_##name(unsigned grid, unsigned block, void** args) {  \
        ::cellc_emu::launch_serial(&name, grid, block, args);                                  \
    }

// A cooperative (step-loop) kernel: launched with every block at once.
#define CELLC_EMU_EXPORT_GRID(name)                                                                            \
    extern "C" void cellc_launch_grid_##name(unsigned grid, unsigned block, unsigned shared, void** args) { \
        ::cellc_emu::launch_grid(&name, grid, block, shared, args);                                         \
    }
