// A layer's int8 batch-1 products in one persistent CUDA kernel (bench/persistent_layers.py
// times it beside the Triton one and the launched chain). The same chain per layer: QKV (RMSNorm
// in front), O (residual behind), gate/up (RMSNorm in front, SiLU·up behind), down (residual
// behind), O reading the first DIM outputs of QKV (no attention).
//
// Why CUDA: a Triton kernel holds the registers of its largest product and keeps one tile in
// flight a program. Here every block owns a contiguous share of each product's rows, its warps
// stream 4-row x 512-input units of weights with the next unit requested before the current one
// is used, and each warp's first units of the next product are requested between the block's
// arrival at the grid-wide barrier and its wait there, so the memory stays busy while the blocks
// wait for each other. Blocks must all be resident (the host launches PER_SM an SM, which
// __launch_bounds__ makes fit).
//
// Weights: int8 rows of K inputs (gate/up: FFN gate rows, then FFN up rows), one fp32 scale a row.
// Activations bf16 (as raw 16-bit words: no header needed under NVRTC). A byte q of a weight
// becomes the float 1 + (q + 128) / 2**15 through one byte permute, as the engine's row kernels
// do; Σ q·a = 32768 (Σ (1 + u / 2**15) a − Σ a) − 128 Σ a, the first difference taken in each
// lane over its 16 inputs.
//
// Compile-time constants come from the host: LAYERS, DIM, QKV, FFN, THREADS, PER_SM, AHEAD
// (units a warp requests while each barrier waits: 0, 1 or 2), NAP (ns between a barrier's polls),
// FLAG (poll a flag the last arrival sets rather than the counter), DEEP (units a warp copies
// into shared memory past its AHEAD while each barrier waits),
// SPINS, and SKIP: for timing only, 1 skips the grid barriers' waits, 2 the inputs' loads (wrong
// results either way).

#define WARPS (THREADS / 32)
#define HELD (AHEAD > 0 ? AHEAD : 1)  // units a warp holds in registers across a barrier
#define CHUNK 512           // inputs a warp's unit spans: 16 bytes a lane
#define SLOTS 4             // weight rows a unit (gate/up: two gate/up pairs)
#define MAX_ROWS 256        // weight rows a block may own in one product
#define PLAIN 0
#define RESIDUAL 1
#define SWIGLU 2

typedef unsigned short bf16;
typedef signed char int8;

__device__ __forceinline__ float from_bf16(bf16 v) { return __uint_as_float((unsigned)v << 16); }

__device__ __forceinline__ bf16 to_bf16(float f) {  // round to nearest even (no NaNs here)
    unsigned u = __float_as_uint(f);
    return (bf16)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

__device__ __forceinline__ float bf16_round(float f) { return from_bf16(to_bf16(f)); }

__device__ __forceinline__ uint4 stream_load(const void* p) {  // read once: skip L1
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

__device__ __forceinline__ float one_plus(unsigned flipped, int byte) {
    return __uint_as_float(__byte_perm(flipped, 0x3F800000u, 0x7604u + 16u * byte));
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// The block's sum of v (every thread gets it); `scratch` holds WARPS floats.
__device__ float block_sum(float v, float* scratch) {
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float total = lane < WARPS ? scratch[lane] : 0.0f;
    return warp_sum(total);
}

// The grid-wide barrier, in two halves so that a block can request the next product's weights
// between them: `arrive` publishes the block's stores (the CTA barrier orders them before thread
// 0's release add, which is cumulative), `wait` polls until `target` arrivals in all (acquire),
// bounded: a grid that is not all resident sets *failed instead of hanging. Nothing the block
// requested before arriving is waited for by the release (a fence would wait for its loads).
// With FLAG the blocks poll a line of their own instead of the arrivals' counter: the last to
// arrive (its add returns target - 1, acquiring every other arrival) releases `target` there.
#define FLAG_OFFSET 32  // words past the counter: another 128-byte line
__device__ __forceinline__ void arrive(unsigned* count, unsigned target) {
    __syncthreads();
    if (threadIdx.x == 0 && !(SKIP & 1)) {
        if (FLAG) {
            unsigned old;
            asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;"
                         : "=r"(old) : "l"(count) : "memory");
            if (old == target - 1)
                asm volatile("st.release.gpu.global.u32 [%0], %1;"
                             ::"l"(count + FLAG_OFFSET), "r"(target) : "memory");
        } else {
            asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(count) : "memory");
        }
    }
}

__device__ __forceinline__ void wait(unsigned* count, unsigned target, int* failed) {
    if (threadIdx.x == 0 && !(SKIP & 1)) {
        const unsigned* line = FLAG ? count + FLAG_OFFSET : count;
        unsigned seen = target, spins = 0;
        if (!*(volatile int*)failed) do {  // once one barrier gave up, the rest do not wait
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(line) : "memory");
            if (NAP && seen < target) __nanosleep(NAP);  // fewer polls on the line
        } while (seen < target && ++spins < SPINS);
        if (seen < target) *failed = 1;
    }
    __syncthreads();
}

// A product's shape and this block's share of its rows (gate/up: of its gate/up pairs).
template <int N, int K, int MODE>
struct Share {
    static constexpr int PER = MODE == SWIGLU ? 2 : 4;  // output rows a unit
    static constexpr int CHUNKS = K / CHUNK;
    int first, rows, units;
    __device__ Share() {
        first = (int)((long long)blockIdx.x * N / gridDim.x);
        rows = (int)((long long)(blockIdx.x + 1) * N / gridDim.x) - first;
        units = (rows + PER - 1) / PER * CHUNKS;
    }
    // Weight row of a unit's slot, or -1 past the block's rows.
    __device__ int row(int group, int slot) const {
        int out = group * PER + (MODE == SWIGLU ? slot / 2 : slot);
        if (out >= rows) return -1;
        return MODE == SWIGLU ? first + out + (slot % 2) * N : first + out;
    }
};

template <int N, int K, int MODE>
__device__ __forceinline__ void load_unit(const int8* w, const Share<N, K, MODE>& s, int unit,
                                          uint4 (&dst)[SLOTS]) {
    int lane = threadIdx.x % 32;
    int group = unit / s.CHUNKS, chunk = unit % s.CHUNKS;
#pragma unroll
    for (int slot = 0; slot < SLOTS; ++slot) {
        int row = unit < s.units ? s.row(group, slot) : -1;
        dst[slot] = row >= 0 ? stream_load(w + (long long)row * K + chunk * CHUNK + lane * 16)
                             : make_uint4(0, 0, 0, 0);
    }
}

// The DEEP units after a warp's first AHEAD, copied into shared memory (cp.async, no registers
// held): this warp's slots of `deep`, [WARPS][DEEP][SLOTS][32 lanes] of 16 bytes. Each lane later
// reads only the 16 bytes it copied, so waiting for its own copies suffices.
template <int N, int K, int MODE>
__device__ __forceinline__ void copy_units(const int8* w, const Share<N, K, MODE>& s, uint4* deep) {
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    asm volatile("cp.async.wait_all;" ::: "memory");  // the last product's copies, if unread
#pragma unroll 1
    for (int i = 0; i < DEEP; ++i) {
        int unit = warp + (AHEAD + i) * WARPS;
        int group = unit / s.CHUNKS, chunk = unit % s.CHUNKS;
#pragma unroll
        for (int slot = 0; slot < SLOTS; ++slot) {
            int row = unit < s.units ? s.row(group, slot) : -1;
            const int8* from = w + (row >= 0 ? (long long)row * K + chunk * CHUNK + lane * 16 : 0);
            unsigned to = (unsigned)__cvta_generic_to_shared(
                deep + ((warp * DEEP + i) * SLOTS + slot) * 32 + lane);
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                         ::"r"(to), "l"(from), "r"(row >= 0 ? 16 : 0) : "memory");  // 0: zeros
        }
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
}

// A warp's first AHEAD units of a product in registers (and DEEP more into shared memory),
// requested while the barrier in front of it waits.
template <int N, int K, int MODE>
__device__ __forceinline__ void request(const int8* w, uint4 (&ahead)[HELD][SLOTS], uint4* deep) {
    const Share<N, K, MODE> s;
    int warp = threadIdx.x / 32;
#pragma unroll
    for (int i = 0; i < AHEAD; ++i) load_unit(w, s, warp + i * WARPS, ahead[i]);
    if (DEEP) copy_units(w, s, deep);
}

// One product: this block's rows of out = epilogue(W · prologue(x)). `ahead` holds this warp's
// first units, requested while the barrier in front of the call waited.
template <int N, int K, int MODE, bool NORM>
__device__ void product(const bf16* x, const float* sq_in, const bf16* g, const int8* w,
                        const float* scale, const bf16* res, bf16* out, float* sq_out, float eps,
                        uint4 (&ahead)[HELD][SLOTS], uint4* deep, float* act, float* acc,
                        float* scratch) {
    const Share<N, K, MODE> s;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    // The partial sums of squares the blocks wrote (at most two a thread: the host keeps
    // blocks <= 2 * THREADS), requested with the first inputs, summed once those are asked for.
    float sq0 = 0.0f, sq1 = 0.0f;
    if (NORM) {
        unsigned i = threadIdx.x;
        if (i < gridDim.x) sq0 = __ldcg(sq_in + i);
        if (i + THREADS < gridDim.x) sq1 = __ldcg(sq_in + i + THREADS);
    }
    float rstd = 1.0f;
    // The inputs in shared memory, each 512-input chunk laid out so that step m of a unit reads
    // 16 consecutive bytes a lane (no bank conflicts): input c*512 + 16 l + 4 m + j sits at
    // c*512 + 128 m + 4 l + j. Eight inputs a load, up to four loads a thread in flight.
    constexpr int VECTORS = K / 8, EACH = (VECTORS + THREADS - 1) / THREADS;
    constexpr int BATCH = EACH < 4 ? EACH : 4;  // loads in flight a thread (registers)
    float part = 0.0f;
    for (int first = 0; first < EACH; first += BATCH) {
        uint4 xs[BATCH], gs[NORM ? BATCH : 1];
#pragma unroll
        for (int i = 0; i < BATCH; ++i) {
            int v = threadIdx.x + (first + i) * THREADS;
            if (v < VECTORS) {
                xs[i] = SKIP & 2 ? make_uint4(0, 0, 0, 0) : __ldcg((const uint4*)x + v);
                if (NORM) gs[NORM ? i : 0] = ((const uint4*)g)[v];
            }
        }
        if (NORM && first == 0) rstd = rsqrtf(block_sum(sq0 + sq1, scratch) / K + eps);
#pragma unroll
        for (int i = 0; i < BATCH; ++i) {
            int v = threadIdx.x + (first + i) * THREADS;
            if (v >= VECTORS) break;
            const uint4 gi = gs[NORM ? i : 0];
            unsigned xw[4] = {xs[i].x, xs[i].y, xs[i].z, xs[i].w};
            unsigned gw[4] = {gi.x, gi.y, gi.z, gi.w};
            float a[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                a[e] = from_bf16((bf16)(xw[e / 2] >> (16 * (e % 2))));
                if (NORM) {
                    float gain = from_bf16((bf16)(gw[e / 2] >> (16 * (e % 2))));
                    a[e] = bf16_round(bf16_round(a[e] * rstd) * gain);
                }
                part += a[e];
            }
            int k = 8 * v, in = k % CHUNK;
            float* at = act + (k - in) + 128 * ((in / 4) % 4) + 4 * (in / 16);
            *(float4*)at = make_float4(a[0], a[1], a[2], a[3]);
            *(float4*)(at + 128) = make_float4(a[4], a[5], a[6], a[7]);  // inputs in + 4 .. + 7
        }
    }
    for (int i = threadIdx.x; i < MAX_ROWS; i += THREADS) acc[i] = 0.0f;
    const float total = block_sum(part, scratch);  // Σ a (its syncthreads publish `act`)

    uint4(&cur)[SLOTS] = ahead[0];
    if (AHEAD == 0) load_unit(w, s, warp, cur);  // nothing requested before the barrier
    for (int unit = warp, later = 1; unit < s.units; unit += WARPS, ++later) {
        uint4 next[SLOTS];  // the unit `later` units after the warp's first
        if (AHEAD > 1 && later < AHEAD) {
#pragma unroll
            for (int slot = 0; slot < SLOTS; ++slot) next[slot] = ahead[AHEAD - 1][slot];
        } else if (DEEP && later < AHEAD + DEEP) {
            if (later == AHEAD) asm volatile("cp.async.wait_all;" ::: "memory");
            const uint4* slots = deep + (warp * DEEP + later - AHEAD) * SLOTS * 32 + lane;
#pragma unroll
            for (int slot = 0; slot < SLOTS; ++slot) next[slot] = slots[slot * 32];
        } else {
            load_unit(w, s, unit + WARPS, next);
        }
        const float4* a4 = (const float4*)(act + (unit % s.CHUNKS) * CHUNK) + lane;
        float4 a[4];
#pragma unroll
        for (int m = 0; m < 4; ++m) a[m] = a4[32 * m];
        float lane_sum = 0.0f;  // subtracted from each row's lane partial: no cancellation later
#pragma unroll
        for (int m = 0; m < 4; ++m) lane_sum += (a[m].x + a[m].y) + (a[m].z + a[m].w);
        float dot[SLOTS];
#pragma unroll
        for (int slot = 0; slot < SLOTS; ++slot) {
            unsigned words[4] = {cur[slot].x, cur[slot].y, cur[slot].z, cur[slot].w};
            float d = 0.0f;
#pragma unroll
            for (int m = 0; m < 4; ++m) {
                unsigned f = words[m] ^ 0x80808080u;  // each byte u = q + 128
                d = fmaf(one_plus(f, 0), a[m].x, d);
                d = fmaf(one_plus(f, 1), a[m].y, d);
                d = fmaf(one_plus(f, 2), a[m].z, d);
                d = fmaf(one_plus(f, 3), a[m].w, d);
            }
            dot[slot] = warp_sum(d - lane_sum);  // Σ (u / 2**15) a over the unit
        }
        int group = unit / s.CHUNKS;
        if (lane < SLOTS) {
            float mine = lane == 0 ? dot[0] : lane == 1 ? dot[1] : lane == 2 ? dot[2] : dot[3];
            int out_row = group * SLOTS + lane;  // gate/up: pair p's gate at 2p, up at 2p + 1
            if (s.row(group, lane) >= 0) atomicAdd(acc + out_row, mine);
        }
#pragma unroll
        for (int slot = 0; slot < SLOTS; ++slot) cur[slot] = next[slot];
    }
    __syncthreads();

    float squares = 0.0f;
    for (int t = threadIdx.x; t < s.rows; t += THREADS) {
        int row = s.first + t;
        if (MODE == SWIGLU) {
            float gate = bf16_round((32768.0f * acc[2 * t] - 128.0f * total) * scale[row]);
            float up = bf16_round((32768.0f * acc[2 * t + 1] - 128.0f * total) *
                                  scale[row + N]);
            out[row] = to_bf16(gate / (1.0f + __expf(-gate)) * up);
        } else {
            float y = (32768.0f * acc[t] - 128.0f * total) * scale[row];
            if (MODE == RESIDUAL) {
                float stream = bf16_round(bf16_round(y) + from_bf16(__ldcg(res + row)));
                out[row] = to_bf16(stream);
                squares += stream * stream;
            } else {
                out[row] = to_bf16(y);
            }
        }
    }
    if (MODE == RESIDUAL) {
        float sum = block_sum(squares, scratch);
        if (threadIdx.x == 0) sq_out[blockIdx.x] = sum;
    }
}

extern "C" __global__ void __launch_bounds__(THREADS, PER_SM)
layers(bf16* x, float* sq, bf16* qkv, bf16* h, float* hsq, bf16* hidden, const int8* wqkv,
       const float* sqkv, const int8* wo, const float* so, const int8* wgu, const float* sgu,
       const int8* wd, const float* sd, const bf16* gattn, const bf16* gffn, unsigned* count,
       int* failed, double eps_in) {
    extern __shared__ float4 shared[];
    float* act = (float*)shared;           // FFN inputs at most
    uint4* deep = (uint4*)(act + (DIM > FFN ? DIM : FFN));  // DEEP units a warp, past them
    __shared__ float acc[MAX_ROWS];        // the block's rows' dot products
    __shared__ float scratch[WARPS];
    const float eps = (float)eps_in;
    const unsigned blocks = gridDim.x;
    uint4 ahead[HELD][SLOTS];
    unsigned arrived = 0;

    request<QKV, DIM, PLAIN>(wqkv, ahead, deep);
    for (int layer = 0; layer < LAYERS; ++layer) {
        const long long l = layer;
        bf16 *xl = x + l * DIM, *ql = qkv + l * QKV, *hl = h + l * DIM, *fl = hidden + l * FFN;
        float *sql = sq + l * blocks, *hsql = hsq + l * blocks;
        const int8 *wq = wqkv + l * QKV * DIM, *wol = wo + l * DIM * DIM;
        const int8 *wg = wgu + l * 2 * FFN * DIM, *wdl = wd + l * DIM * FFN;
        product<QKV, DIM, PLAIN, true>(xl, sql, gattn + l * DIM, wq, sqkv + l * QKV, nullptr, ql,
                                       nullptr, eps, ahead, deep, act, acc, scratch);
        arrive(count, arrived += blocks);
        request<DIM, DIM, RESIDUAL>(wol, ahead, deep);
        wait(count, arrived, failed);
        product<DIM, DIM, RESIDUAL, false>(ql, nullptr, nullptr, wol, so + l * DIM, xl, hl, hsql,
                                           eps, ahead, deep, act, acc, scratch);
        arrive(count, arrived += blocks);
        request<FFN, DIM, SWIGLU>(wg, ahead, deep);
        wait(count, arrived, failed);
        product<FFN, DIM, SWIGLU, true>(hl, hsql, gffn + l * DIM, wg, sgu + l * 2 * FFN, nullptr,
                                        fl, nullptr, eps, ahead, deep, act, acc, scratch);
        arrive(count, arrived += blocks);
        request<DIM, FFN, RESIDUAL>(wdl, ahead, deep);
        wait(count, arrived, failed);
        product<DIM, FFN, RESIDUAL, false>(fl, nullptr, nullptr, wdl, sd + l * DIM, hl,
                                           xl + DIM, sql + blocks, eps, ahead, deep, act, acc, scratch);
        if (layer + 1 == LAYERS) break;
        arrive(count, arrived += blocks);
        request<QKV, DIM, PLAIN>(wq + QKV * DIM, ahead, deep);
        wait(count, arrived, failed);
    }
}
