// Warpgroup tensor-core helpers (wgmma, sm_90a), shared by attention_prefill.cu and gdn.cu. Include after
// common.cuh. Shared-memory operands use the canonical 128-byte swizzle: a tile of rows x C bf16 is stored as C/64
// column blocks of [rows][128 bytes], 16-byte chunk c of row r at chunk c ^ (r & 7), atoms 1024-byte aligned.
// K-major operands (rows are the m or n index, k contiguous) take WgDesc(addr, 16, 1024) and step a k16 by
// 32 bytes within a column block; MN-major ones (rows are k) WgDesc(addr, 64 * 128, 1024), a k16 step being
// 16 rows (2048 bytes).

// Shared-memory matrix descriptor, 128-byte swizzle: start address, leading / stride byte offsets (>> 4).
// Kept as two halves: the matrix `off` bytes further is {lo + off / 16, hi} (the 14-bit address field never
// carries, shared addresses being < 2^18), so each wgmma's descriptor costs one add, not a rebuild.
struct WgDesc {
    unsigned lo, hi;
    __device__ __forceinline__ WgDesc(unsigned addr, unsigned lbo, unsigned sbo)
        : lo(((addr & 0x3FFFF) >> 4) | ((lbo >> 4) << 16)), hi((sbo >> 4) | (1u << 30)) {}
    __device__ __forceinline__ unsigned long long at(unsigned off) const {
        unsigned long long d;
        asm("mov.b64 %0, {%1, %2};" : "=l"(d) : "r"(lo + (off >> 4)), "r"(hi));
        return d;
    }
};
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// keeps the compiler from moving accumulator reads or writes across the asynchronous wgmma
__device__ __forceinline__ void wg_hold(float (&d)[32]) {
#pragma unroll
    for (int i = 0; i < 32; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

#define WG_D32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
               "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define WG_ACC32(d)                                                                                         \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),         \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]),          \
        "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),          \
        "+f"(d[30]), "+f"(d[31])

// d[64 x 64] (+)= A[64 x 16] B[16 x 64], A and B K-major in shared memory; acc = 0 overwrites d
__device__ __forceinline__ void wg_ss(float (&d)[32], unsigned long long da, unsigned long long db, int acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " WG_D32 ", %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : WG_ACC32(d)
                 : "l"(da), "l"(db), "r"(acc));
}
// d[64 x 64] += A[64 x 16] B[16 x 64], A in registers (mma.sync's m16n8k16 A fragment per warp), B MN-major
// (TB = 1: its rows are k) or K-major (TB = 0: its rows are n)
template <int TB = 1>
__device__ __forceinline__ void wg_rs(float (&d)[32], const unsigned (&a)[4], unsigned long long db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " WG_D32
                 ", {%32, %33, %34, %35}, %36, p, 1, 1, %37;\n}\n"
                 : WG_ACC32(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "n"(TB));
}

