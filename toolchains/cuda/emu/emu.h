// A CPU emulator for the CUDA subset of Colibri's kernels (backends/cuda/*.cu): every thread of a
// block is a fiber with its own stack, switched only at __syncthreads and warp shuffles, so the
// kernels run unmodified as C++ and can be checked against the NumPy reference on a machine with
// no GPU. Strict where the hardware is undefined: a barrier that some threads of the block (or
// of the warp) never reach, or reach after others exited, aborts with a message; a misaligned
// vector load aborts too. Blocks run one after another, threads interleave at sync points only.
//
// Pre-included (g++ -include emu.h) by toolchains/cuda/emu/cupy, the fake CuPy that runs the
// backend's RawModules on the CPU. Not a general CUDA emulator: only what the kernels use.
#pragma once
#include <math.h>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <functional>
#include <vector>

#ifndef EMU_KEEP_GLOBAL
#define __global__
#endif
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static

struct dim3 { unsigned x, y, z; };
struct uint3 { unsigned x, y, z; };
struct float2 { float x, y; };
struct float4 { float x, y, z, w; };
struct uint4 { unsigned x, y, z, w; };

static uint3 threadIdx, blockIdx;
static dim3 blockDim, gridDim;

static inline int min(int a, int b) { return a < b ? a : b; }
static inline int max(int a, int b) { return a > b ? a : b; }
static inline long long min(long long a, long long b) { return a < b ? a : b; }
static inline long long max(long long a, long long b) { return a > b ? a : b; }
static inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
static inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
static inline float h2f(unsigned short h) { _Float16 f; std::memcpy(&f, &h, 2); return (float)f; }
static inline unsigned short f2h(float x) { _Float16 f = (_Float16)x; unsigned short h; std::memcpy(&h, &f, 2); return h; }
static inline void sincosf_(float a, float* s, float* c) { *s = sinf(a); *c = cosf(a); }
#define sincosf(a, s, c) sincosf_(a, s, c)
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
static inline float __fdividef(float a, float b) { return a / b; }

namespace emu {

enum State { RUNNABLE, WAIT_BLOCK, WAIT_WARP, DONE };
struct Fiber { void* sp; State state; int warp; unsigned shuffles; };   // shuffles: its exchange() count

static std::vector<Fiber> fibers;
static std::vector<char*> stacks;
static void* sched_sp;
static int cur, nthreads, ndone, block_arrived;
static std::vector<int> warp_arrived, warp_done;   // per warp: lanes at its barrier, lanes exited
static std::vector<uint64_t> slots;                // [2][nthreads]: the shuffles' two alternating buffers
static const std::function<void()>* body;
static const size_t STACK = 256 * 1024;
static char where[256];

static bool in_fiber, failed;
static char errmsg[512];
extern "C" void emu_swap(void** save_sp, void* new_sp);

// A failure inside a thread: record it and leave the block for good (the scheduler returns the
// error; the abandoned fiber stacks are simply re-initialised by the next launch).
static void fail(const char* what) {
    std::snprintf(errmsg, sizeof errmsg, "%s (block %u,%u,%u thread %d of %d) in kernel %s", what, blockIdx.x,
                  blockIdx.y, blockIdx.z, cur, nthreads, where);
    failed = true;
    if (in_fiber) {
        in_fiber = false;
        emu_swap(&fibers[cur].sp, sched_sp);
    }
}

#if defined(__x86_64__)
asm(R"(
    .text
    .p2align 4
    .hidden emu_swap
    .globl emu_swap
    .type emu_swap,@function
emu_swap:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size emu_swap, .-emu_swap
)");
#else
#error "the CUDA emulator's fiber switch is written for x86-64"
#endif

static void set_thread(int i) {
    cur = i;
    threadIdx.x = i % blockDim.x;
    threadIdx.y = (i / blockDim.x) % blockDim.y;
    threadIdx.z = i / (blockDim.x * blockDim.y);
}

static void yield() {
    in_fiber = false;
    emu_swap(&fibers[cur].sp, sched_sp);
}

static void trampoline() {
    (*body)();
    fibers[cur].state = DONE;
    ++ndone;
    ++warp_done[fibers[cur].warp];
    in_fiber = false;
    emu_swap(&fibers[cur].sp, sched_sp);
    std::abort();                               // a finished thread is never resumed
}

static void arrive_block() {
    if (ndone) fail("__syncthreads after some threads of the block exited");
    if (++block_arrived == nthreads) {
        block_arrived = 0;
        for (auto& f : fibers) if (f.state == WAIT_BLOCK) f.state = RUNNABLE;
        return;
    }
    fibers[cur].state = WAIT_BLOCK;
    yield();
}

static int warp_size(int w) { int n = nthreads - 32 * w; return n < 32 ? n : 32; }

static void arrive_warp() {
    const int w = fibers[cur].warp;
    if (warp_done[w]) fail("warp shuffle after some lanes of the warp exited");
    if (++warp_arrived[w] == warp_size(w)) {
        warp_arrived[w] = 0;
        for (int i = 32 * w; i < 32 * w + warp_size(w); ++i)
            if (fibers[i].state == WAIT_WARP) fibers[i].state = RUNNABLE;
        return;
    }
    fibers[cur].state = WAIT_WARP;
    yield();
}

// One warp barrier per shuffle: shuffle n publishes into buffer n % 2, so a lane that runs ahead
// into shuffle n + 1 writes the other buffer, and it can reach shuffle n + 2 (this buffer again) only
// past shuffle n + 1's barrier, which every lane arrives at after reading shuffle n's value.
template <typename T> static T exchange(T v, int src_lane) {
    static_assert(sizeof(T) <= 8, "shuffle of a type wider than 8 bytes");
    uint64_t u = 0;
    std::memcpy(&u, &v, sizeof(T));
    const size_t buf = (size_t)(fibers[cur].shuffles++ & 1) * nthreads;
    slots[buf + cur] = u;
    arrive_warp();                              // every lane has published
    const int w = fibers[cur].warp;
    if (src_lane < 0 || src_lane >= warp_size(w)) fail("shuffle from a lane outside the warp");
    T r;
    std::memcpy(&r, &slots[buf + 32 * w + src_lane], sizeof(T));
    return r;
}

static int run_grid(unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                    const std::function<void()>& fn, const char* name) {
    std::snprintf(where, sizeof where, "%s", name);
    gridDim = {gx, gy, gz};
    blockDim = {bx, by, bz};
    nthreads = (int)(bx * by * bz);
    const int nwarps = (nthreads + 31) / 32;
    while ((int)stacks.size() < nthreads) stacks.push_back((char*)std::malloc(STACK));
    fibers.assign(nthreads, Fiber{});
    warp_arrived.assign(nwarps, 0);
    warp_done.assign(nwarps, 0);
    slots.assign(2 * (size_t)nthreads, 0);
    body = &fn;
    failed = false;
    errmsg[0] = 0;
    for (unsigned z = 0; z < gz; ++z)
        for (unsigned y = 0; y < gy; ++y)
            for (unsigned x = 0; x < gx; ++x) {
                blockIdx = {x, y, z};
                ndone = 0;
                block_arrived = 0;
                std::fill(warp_done.begin(), warp_done.end(), 0);
                for (int i = 0; i < nthreads; ++i) {
                    uintptr_t top = ((uintptr_t)(stacks[i] + STACK)) & ~(uintptr_t)15;
                    uintptr_t* sp = (uintptr_t*)top;
                    *--sp = 0;                                  // alignment slot (fake return address)
                    *--sp = (uintptr_t)&trampoline;             // where emu_swap's ret goes first
                    for (int r = 0; r < 6; ++r) *--sp = 0;      // rbp rbx r12 r13 r14 r15
                    fibers[i] = Fiber{(void*)sp, RUNNABLE, i / 32, 0};
                }
                while (ndone < nthreads) {
                    bool ran = false;
                    for (int i = 0; i < nthreads; ++i) {
                        if (fibers[i].state != RUNNABLE) continue;
                        set_thread(i);
                        ran = true;
                        in_fiber = true;
                        emu_swap(&sched_sp, fibers[i].sp);
                        in_fiber = false;
                        if (failed) return 1;
                    }
                    if (!ran) {
                        int wb = 0, ww = 0;
                        for (auto& f : fibers) { wb += f.state == WAIT_BLOCK; ww += f.state == WAIT_WARP; }
                        char m[160];
                        std::snprintf(m, sizeof m, "deadlock: %d threads wait at __syncthreads, %d at a warp "
                                      "shuffle, %d exited (a barrier not every thread reaches)", wb, ww, ndone);
                        fail(m);
                        return 1;
                    }
                }
            }
    return 0;
}

}  // namespace emu

extern "C" const char* emu_last_error() { return emu::errmsg; }

static inline void __syncthreads() { emu::arrive_block(); }

template <typename T> static inline T __shfl_xor_sync(unsigned mask, T v, int m) {
    if (mask != 0xffffffffu) emu::fail("partial shuffle masks are not emulated");
    return emu::exchange(v, (emu::cur % 32) ^ m);
}
template <typename T> static inline T __shfl_sync(unsigned mask, T v, int src) {
    if (mask != 0xffffffffu) emu::fail("partial shuffle masks are not emulated");
    return emu::exchange(v, src & 31);
}
template <typename T> static inline T __shfl_up_sync(unsigned mask, T v, unsigned d) {
    if (mask != 0xffffffffu) emu::fail("partial shuffle masks are not emulated");
    const int lane = emu::cur % 32;
    const T r = emu::exchange(v, lane >= (int)d ? lane - (int)d : lane);
    return r;
}
template <typename T> static inline T __shfl_down_sync(unsigned mask, T v, unsigned d) {
    if (mask != 0xffffffffu) emu::fail("partial shuffle masks are not emulated");
    const int lane = emu::cur % 32;
    const T r = emu::exchange(v, lane + (int)d < emu::warp_size(emu::cur / 32) ? lane + (int)d : lane);
    return r;
}

// alignment the hardware would fault on (cudaErrorMisalignedAddress)
#define CE_CHECK_ALIGNED(p, n) \
    do { if (((uintptr_t)(p)) % (n)) emu::fail("misaligned " #n "-byte load"); } while (0)
