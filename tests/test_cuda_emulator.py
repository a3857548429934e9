"""The CUDA emulator's own checks (toolchains/cuda/emu: fibers for threads, the fake CuPy): the
values a warp shuffle delivers, and the barrier bugs it must refuse. It is what stands for a GPU in
CI, so a scheduler shortcut that let a wrong kernel pass would hide bugs everywhere; it needs g++
only (no GPU, no CuPy)."""
import gc
import importlib.util
import os
import shutil

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

KERNELS = r"""
extern "C" __global__ void shuffles(float* out, const float* x, int rounds) {
    // per round: v += xor-1 neighbour; v = v * 0.5 + the value 2 lanes down; v += lane 31 - lane's
    const int lane = threadIdx.x % 32;
    float v = x[blockIdx.x * blockDim.x + threadIdx.x];
    for (int r = 0; r < rounds; ++r) {
        v += __shfl_xor_sync(0xffffffffu, v, 1);
        v = v * 0.5f + __shfl_down_sync(0xffffffffu, v, 2);
        v += __shfl_sync(0xffffffffu, v, 31 - lane);
    }
    out[blockIdx.x * blockDim.x + threadIdx.x] = v;
}

extern "C" __global__ void half_barrier(float* out) {
    if (threadIdx.x < 16) __syncthreads();
    out[threadIdx.x] = 1.0f;
}

extern "C" __global__ void shuffle_after_exit(float* out) {
    if (threadIdx.x < 16) return;   // (the other way round, lanes 0-15 wait first: a deadlock)
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, (float)threadIdx.x, 1);
}

extern "C" __global__ void write_at(float* out, int i) {   // one thread writes out[i], in bounds or not
    if (threadIdx.x == 0) out[i] = 2.0f;
}

extern "C" __global__ void sync_after_exit(float* out) {
    if (threadIdx.x == 0) return;
    __syncthreads();
    out[threadIdx.x] = 1.0f;
}
"""


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    if shutil.which("g++") is None:
        pytest.fail("g++ is needed by the CUDA emulator (CI's machines have it with gcc and nvcc)")
    os.environ.setdefault("COLIBRI_EMU_CACHE", str(tmp_path_factory.mktemp("emu")))
    spec = importlib.util.spec_from_file_location("colibri_emu_cupy",
                                                  os.path.join(ROOT, "toolchains", "cuda", "emu", "cupy", "__init__.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod, mod.RawModule(code=KERNELS)


def shuffles_numpy(x, rounds):
    """The shuffles kernel per warp in NumPy (lanes past the warp's end keep their own value for down)."""
    v = x.astype(np.float32).reshape(-1, 32).copy()
    lane = np.arange(32)
    for _ in range(rounds):
        v = v + v[:, lane ^ 1]
        down = np.where(lane + 2 < 32, lane + 2, lane)
        v = v * np.float32(0.5) + v[:, down]
        v = v + v[:, 31 - lane]
    return v.reshape(-1)


@pytest.mark.parametrize("blocks,threads,rounds", [(1, 32, 1), (3, 64, 5), (2, 256, 9)])
def test_shuffles_deliver_each_lanes_value(emu, blocks, threads, rounds):
    """Back-to-back shuffles (the lane that completes a warp barrier runs on into the next shuffle
    before the others have read this one) give every lane what the hardware would."""
    cp, mod = emu
    x = np.random.default_rng(7).standard_normal(blocks * threads).astype(np.float32)
    out = cp.empty(blocks * threads, dtype=np.float32)
    mod.get_function("shuffles")((blocks,), (threads,), (out, cp.asarray(x), np.int32(rounds)))
    np.testing.assert_allclose(cp.asnumpy(out), shuffles_numpy(x, rounds), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kernel,message", [
    ("half_barrier", "deadlock: 16 threads wait at __syncthreads"),
    ("shuffle_after_exit", "warp shuffle after some lanes of the warp exited"),
    ("sync_after_exit", "__syncthreads after some threads of the block exited"),
])
def test_barrier_bugs_fail_the_launch(emu, kernel, message):
    cp, mod = emu
    out = cp.zeros(64, dtype=np.float32)
    with pytest.raises(cp.CUDARuntimeError, match="cudaErrorLaunchFailure") as err:
        mod.get_function(kernel)((1,), (64,), (out,))
    assert message in str(err.value)
    # the emulator is usable again after a failed launch
    good = cp.empty(32, dtype=np.float32)
    mod.get_function("shuffles")((1,), (32,), (good, cp.asarray(np.ones(32, np.float32)), np.int32(1)))
    np.testing.assert_allclose(cp.asnumpy(good), shuffles_numpy(np.ones(32, np.float32), 1))


@pytest.mark.parametrize("index", [-1, 64, 127])
def test_a_write_outside_a_buffer_fails_the_launch(emu, index):
    """The guard bytes around every device buffer: a write just before or past it is cudaErrorIllegalAddress
    naming the kernel, whichever buffer's guard it lands in; a write inside passes."""
    cp, mod = emu
    out, other = cp.zeros(64, dtype=np.float32), cp.zeros(16, dtype=np.float32)
    mod.get_function("write_at")((1,), (32,), (out, np.int32(63)))
    assert float(cp.asnumpy(out)[63]) == 2.0
    with pytest.raises(cp.CUDARuntimeError, match="cudaErrorIllegalAddress: kernel write_at wrote outside"):
        mod.get_function("write_at")((1,), (32,), (out, np.int32(index)))
    assert float(cp.asnumpy(other).sum()) == 0.0
    del out                     # its guard is spoilt: gone before the next launch checks every live buffer
    gc.collect()
