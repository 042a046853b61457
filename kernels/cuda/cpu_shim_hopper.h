// The CPU twins of hopper.cuh's PTX (included by cpu_shim.h). What each models:
//
//   shared addresses      offsets from the launch's dynamic shared memory, which the shim
//                         aligns to 1024 bytes (the swizzle is taken from these bits, as the
//                         hardware takes it from the shared address)
//   mbarrier              a table of barriers by address, reset before every block: init
//                         (count), arrive, arrive.expect_tx (bytes), try_wait.parity. A phase
//                         completes when its arrivals are all in and its announced bytes have
//                         landed. The bytes of a TMA copy land only when some thread waits on
//                         the phase they belong to (the latest the hardware may deliver them),
//                         so a wait on the wrong parity, which returns at once, reads the
//                         poison (0xff bytes: NaN) that the copy wrote at issue. A wait that
//                         never completes (parity off the other way, a missing arrive, bytes
//                         announced that no copy brings) is reported once no thread can change
//                         it any more (`fiber_deadlock`, cpu_shim.h) and released, never a hang; so are arrivals beyond the count, copies
//                         beyond the announced bytes, and copies left unwaited at block end
//   TMA (2-D tile load)   the tensor map is the backend's own 128 bytes in the emulation's
//                         encoding (gpu::tma::TensorMap2d::emulated): the box at the given
//                         coordinates, zeros outside the tensor, rows of the box's inner
//                         size, written through the swizzle mode's XOR of address bits. The
//                         destination must be aligned to the swizzle atom
//   wgmma.mma_async       m64nNk16 f32 += bf16 x bf16, A from registers (the fragment layout
//                         of hopper.cuh) or from a descriptor, B from a descriptor, K-major or
//                         transposed (MN-major), every swizzle mode. All 128 threads of the
//                         warpgroup must issue it with the same descriptors (checked). The
//                         product is computed when a wait_group retires its group, reading
//                         shared memory then (a tile overwritten before the wait gives a wrong
//                         answer); the accumulators read NaN in between (a missing wait).
//                         wait_group is .sync.aligned: every lane of the warp retires its part
//                         before any lane goes on, so one lane's arrival after it (a stage
//                         released to the producer) stands for its warp, as on the hardware
//   wgmma.fence           asked for before the first wgmma after the block starts and after
//                         every wait_group (stricter than the hardware, which asks only when
//                         registers were touched since): a missing fence is reported
//   bar.sync / bar.arrive with an id: counting barriers of the block by id (arrivals beyond a
//                         phase start the next one; a sync that can never complete is reported
//                         the same way)
//   waiting               a waiting thread's fiber yields to the others and looks again when
//                         its turn comes
//   fences of proxies, tensor-map acquire, register fences, setmaxnreg: nothing (the emulation has one
//                         proxy and no compiler reordering); what they order is not checked
//
// What it cannot see (docs/gpu.md lists it): real asynchrony and timing, the ordering between
// the generic and the asynchronous proxy on the hardware (a missing fence.proxy.async),
// register pressure and setmaxnreg, bank conflicts, and the hardware's summation order.

#pragma once

#include <map>

namespace fp_shim {

// The emulation's tensor-map encoding (flowprefill_kernels::gpu::tma writes it): u64 words.
constexpr uint32_t TMAP_MAGIC = 0x4d545046u;  // "FPTM"

struct TmaLanding {
    unsigned char* dst;
    std::vector<unsigned char> image;
};

struct MBar {
    uint32_t expected = 0;
    uint32_t pending = 0;
    long long tx = 0;
    uint32_t completed = 0;
    std::vector<TmaLanding> queued;
};

inline std::mutex mbar_lock;
inline std::map<uint32_t, MBar> mbars;

// Named barriers of the block (bar.sync / bar.arrive with an id and a thread count).
struct NamedBar {
    unsigned count = 0;
    unsigned arrived = 0;
    unsigned long long generation = 0;
};
inline std::mutex named_lock;
inline std::map<unsigned, NamedBar> named_bars;

// One thread's arrival at named barrier `id` of `count` threads; with `wait`, until the phase
// completes (a missing arrival is reported once no thread can make it: never a hang).
inline void named_barrier(unsigned id, unsigned count, bool wait) {
    std::unique_lock<std::mutex> g(named_lock);
    if (id == 0 || id > 15 || count == 0 || count % 32 != 0) {
        fail("bar.sync / bar.arrive: id 1-15 and a thread count that is a multiple of 32");
        return;
    }
    NamedBar& b = named_bars[id];
    if (b.arrived != 0 && b.count != count) {
        fail("named barrier " + std::to_string(id) + ": arrivals with different thread counts");
    }
    b.count = count;
    moved();
    const unsigned long long gen = b.generation;
    if (++b.arrived == count) {
        b.arrived = 0;
        b.generation++;
        return;
    }
    if (!wait) {
        return;
    }
    // Looked up again after every yield (a released block's next start clears the table), and
    // given up only after a yield: a deadlock found while this thread was waiting.
    for (bool waited = false;; waited = true) {
        NamedBar& now = named_bars[id];
        if (now.generation != gen) {
            moved();
            return;
        }
        if (waited && fiber_deadlock) {
            fail("named barrier " + std::to_string(id) + " never completed (" + std::to_string(now.arrived) +
                 " of " + std::to_string(count) + " threads): a missing bar.arrive");
            // Its other waiters leave too, and its next phase starts clean.
            now.arrived = 0;
            now.generation++;
            return;
        }
        g.unlock();
        fiber_yield();
        g.lock();
    }
}

struct WgmmaOp {
    float* d;
    int n;
    bool rs;
    float a[2][16];
    uint64_t da, db;
    bool trans_b;
    bool accumulate;
};

inline bool wgmma_fenced = false;
inline std::vector<WgmmaOp> wgmma_open;
inline std::deque<std::vector<WgmmaOp>> wgmma_committed;
// Accumulators with products in flight: their values before the first, and how many.
inline std::map<float*, std::pair<std::vector<float>, int>> wgmma_acc;

inline size_t dynamic_size() { return dynamic_bytes; }

inline uint32_t saddr(const unsigned char* p, const char* what) {
    const unsigned char* base = dynamic_smem();
    if (p < base || p >= base + dynamic_size()) {
        fail(std::string(what) + ": an address outside the dynamic shared memory");
        return 0;
    }
    return (uint32_t)(p - base);
}

inline WarpGroup& warpgroup() { return *block->groups[thread_linear / 128]; }

inline MBar* mbar_at(uint32_t addr, const char* what) {
    auto it = mbars.find(addr);
    if (it == mbars.end()) {
        fail(std::string(what) + ": an mbarrier that was never initialised");
        return nullptr;
    }
    return &it->second;
}

// Lands the queued copies of a barrier whose arrivals are all in, and completes its phase
// when its bytes are in too. Called with mbar_lock held.
inline void mbar_progress(MBar& m) {
    if (m.pending != 0) {
        return;
    }
    for (TmaLanding& l : m.queued) {
        moved();
        std::memcpy(l.dst, l.image.data(), l.image.size());
        m.tx -= (long long)l.image.size();
    }
    m.queued.clear();
    if (m.tx < 0) {
        fail("mbarrier: copies brought more bytes than arrive.expect_tx announced");
        m.tx = 0;
    }
    if (m.tx == 0) {
        m.completed++;
        m.pending = m.expected;
    }
}

inline void mbar_arrive(unsigned char* bar, long long bytes) {
    std::lock_guard<std::mutex> g(mbar_lock);
    MBar* m = mbar_at(saddr(bar, "mbarrier.arrive"), "mbarrier.arrive");
    if (!m) {
        return;
    }
    moved();
    m->tx += bytes;
    if (m->pending == 0) {
        fail("mbarrier.arrive: more arrivals than the barrier's count in one phase");
        return;
    }
    m->pending--;
    mbar_progress(*m);
}

inline uint32_t swizzle_mask(uint32_t swizzle_bytes) {
    return swizzle_bytes == 128 ? 7u : swizzle_bytes == 64 ? 3u : swizzle_bytes == 32 ? 1u : 0u;
}

// A byte offset in shared memory through a swizzle: the 16-byte chunk bits (4-6) XOR bits 7-9.
inline uint32_t swizzled(uint32_t addr, uint32_t swizzle_bytes) {
    return addr ^ (((addr >> 7) & swizzle_mask(swizzle_bytes)) << 4);
}

// A wgmma operand's shared-memory descriptor, read once per product: where its tile starts,
// its two strides and its swizzle width.
struct GmmaDesc {
    uint32_t start, lbo, sbo, w;
    explicit GmmaDesc(uint64_t desc)
        : start((uint32_t)(desc & 0x3fff) << 4),
          lbo((uint32_t)((desc >> 16) & 0x3fff) << 4),
          sbo((uint32_t)((desc >> 32) & 0x3fff) << 4) {
        const uint32_t base_offset = (uint32_t)((desc >> 49) & 7);
        const uint32_t mode = (uint32_t)(desc >> 62);
        if (base_offset != 0) {
            fail("wgmma: a descriptor with a base offset (the kernels align every tile to its swizzle atom)");
        }
        w = mode == 1 ? 128 : mode == 2 ? 64 : mode == 3 ? 32 : 16;
    }

    // One bf16 element of the tile: (mn, k) of a K-major (k contiguous) or MN-major tile, in
    // the launch's dynamic shared memory `smem` of `size` bytes.
    float at(const unsigned char* smem, size_t size, uint32_t mn, uint32_t k, bool mn_major) const {
        uint32_t off;
        if (!mn_major) {
            off = w == 16 ? (mn % 8) * 16 + (mn / 8) * sbo + (k % 8) * 2 + (k / 8) * lbo
                          : (mn % 8) * w + (mn / 8) * sbo + k * 2;
        } else {
            off = w == 16 ? (mn % 8) * 2 + (mn / 8) * sbo + (k % 8) * 16 + (k / 8) * lbo
                          : (mn % (w / 2)) * 2 + (mn / (w / 2)) * lbo + (k % 8) * w + (k / 8) * sbo;
        }
        const uint32_t addr = w == 16 ? start + off : swizzled(start + off, w);
        if ((size_t)addr + 2 > size) {
            fail("wgmma: a descriptor reaches past the dynamic shared memory");
            return 0.0f;
        }
        unsigned short bits;
        std::memcpy(&bits, smem + addr, 2);
        return bf16_lo(bits);
    }
};

inline void wgmma_retire(const WgmmaOp& op) {
    const unsigned tid = thread_linear % 128, w = tid / 32, g = (tid % 32) / 4, t = tid % 4;
    auto it = wgmma_acc.find(op.d);
    std::vector<float>& acc = it->second.first;
    // This thread's two rows of A and, per 8 columns, its two columns of B, each read once.
    const unsigned char* smem = dynamic_smem();
    const size_t size = dynamic_size();
    float a[2][16], b[2][16];
    if (op.rs) {
        std::memcpy(a, op.a, sizeof(a));
    } else {
        const GmmaDesc da(op.da);
        for (unsigned half = 0; half < 2; half++) {
            for (unsigned k = 0; k < 16; k++) {
                a[half][k] = da.at(smem, size, 16 * w + g + 8 * half, k, false);
            }
        }
    }
    const GmmaDesc db(op.db);
    for (int i = 0; i < op.n / 8; i++) {
        for (unsigned c = 0; c < 2; c++) {
            for (unsigned k = 0; k < 16; k++) {
                b[c][k] = db.at(smem, size, 8 * i + 2 * t + c, k, op.trans_b);
            }
        }
        for (int e = 0; e < 4; e++) {
            const unsigned half = e >= 2 ? 1 : 0, c = e & 1;
            float sum = 0.0f;
            for (unsigned k = 0; k < 16; k++) {
                sum += a[half][k] * b[c][k];
            }
            float& d = acc[4 * i + e];
            d = op.accumulate ? d + sum : sum;
        }
    }
    if (--it->second.second == 0) {
        std::memcpy(op.d, acc.data(), acc.size() * sizeof(float));
        wgmma_acc.erase(it);
    }
}

inline void wgmma_issue(float* d, int n, const uint32_t* a, uint64_t da, uint64_t db, bool trans_b, uint32_t scale_d) {
    WarpGroup& grp = warpgroup();
    if (grp.lanes != 128) {
        fail("wgmma.mma_async in a warpgroup of fewer than 128 threads");
        return;
    }
    const unsigned tid = thread_linear % 128, w = tid / 32, g = (tid % 32) / 4, t = tid % 4;
    if (!wgmma_fenced) {
        fail("wgmma.mma_async without a wgmma.fence before it (at the start, or since the last wait_group)");
    }
    WgmmaIssue mine{da, db, n, a != nullptr, trans_b, scale_d != 0};
    grp.issue[tid] = mine;
    if (a) {
        const unsigned r = 16 * w + g;
        grp.a_stage[r][2 * t] = bf16_lo(a[0]);
        grp.a_stage[r][2 * t + 1] = bf16_hi(a[0]);
        grp.a_stage[r + 8][2 * t] = bf16_lo(a[1]);
        grp.a_stage[r + 8][2 * t + 1] = bf16_hi(a[1]);
        grp.a_stage[r][2 * t + 8] = bf16_lo(a[2]);
        grp.a_stage[r][2 * t + 9] = bf16_hi(a[2]);
        grp.a_stage[r + 8][2 * t + 8] = bf16_lo(a[3]);
        grp.a_stage[r + 8][2 * t + 9] = bf16_hi(a[3]);
    }
    grp.bar.arrive_and_wait();
    if (grp.issue[0] != mine) {
        fail("wgmma.mma_async: the threads of a warpgroup issued it with different operands");
    }
    WgmmaOp op{d, n, a != nullptr, {}, da, db, trans_b, scale_d != 0};
    if (a) {
        std::memcpy(op.a[0], grp.a_stage[16 * w + g], sizeof(op.a[0]));
        std::memcpy(op.a[1], grp.a_stage[16 * w + g + 8], sizeof(op.a[1]));
    }
    grp.bar.arrive_and_wait();
    auto it = wgmma_acc.find(d);
    if (it == wgmma_acc.end()) {
        wgmma_acc.emplace(d, std::make_pair(std::vector<float>(d, d + n / 2), 1));
        std::fill(d, d + n / 2, std::nanf(""));
    } else {
        it->second.second++;
    }
    wgmma_open.push_back(op);
}

// Per block: every barrier forgotten (thread 0, before the block starts).
inline void hopper_block_start() {
    {
        std::lock_guard<std::mutex> g(mbar_lock);
        mbars.clear();
    }
    std::lock_guard<std::mutex> g(named_lock);
    named_bars.clear();
}

// Per thread, at the start of each block.
inline void hopper_thread_start() {
    wgmma_fenced = false;
    wgmma_open.clear();
    wgmma_committed.clear();
    wgmma_acc.clear();
}

// Per thread, when it returns from a block.
inline void hopper_thread_end() {
    if (!wgmma_open.empty() || !wgmma_committed.empty()) {
        fail("wgmma products still pending when a block ended (a missing wgmma.wait_group)");
    }
    hopper_thread_start();
}

// Per block, once every thread has returned from it (thread 0).
inline void hopper_block_end() {
    std::lock_guard<std::mutex> g(mbar_lock);
    for (auto& [addr, m] : mbars) {
        if (!m.queued.empty()) {
            fail("TMA copies that no thread waited for when a block ended");
        }
    }
}

}  // namespace fp_shim

inline uint32_t fp_saddr_bits(fp_sptr a) { return fp_shim::saddr(a, "a shared address"); }

inline fp_sptr fp_sptr_align(fp_sptr a, unsigned align) {
    const uint32_t off = fp_shim::saddr(a, "fp_sptr_align");
    return fp_shim::dynamic_smem() + ((off + align - 1) & ~(align - 1));
}

inline void fp_mbar_init(fp_sptr bar, unsigned count) {
    const uint32_t addr = fp_shim::saddr(bar, "mbarrier.init");
    if (addr % 8 != 0 || count == 0) {
        fp_shim::fail("mbarrier.init: a misaligned barrier or a count of 0");
    }
    std::lock_guard<std::mutex> g(fp_shim::mbar_lock);
    fp_shim::MBar m;
    m.expected = m.pending = count;
    fp_shim::mbars[addr] = m;
}

inline void fp_mbar_init_fence() {}

// Ordered by the mbarriers around them (their lock), as on the device by arrive and wait.
inline void fp_st_shared_u32(fp_sptr a, unsigned v) {
    if (fp_shim::saddr(a, "st.shared") % 4 != 0) {
        fp_shim::fail("st.shared.u32: a misaligned address");
    }
    std::memcpy(a, &v, 4);
}

inline unsigned fp_ld_shared_u32(fp_sptr a) {
    if (fp_shim::saddr(a, "ld.shared") % 4 != 0) {
        fp_shim::fail("ld.shared.u32: a misaligned address");
    }
    unsigned v;
    std::memcpy(&v, a, 4);
    return v;
}

inline void fp_mbar_arrive_expect_tx(fp_sptr bar, unsigned bytes) { fp_shim::mbar_arrive(bar, bytes); }

inline void fp_mbar_arrive(fp_sptr bar) { fp_shim::mbar_arrive(bar, 0); }

inline void fp_mbar_wait(fp_sptr bar, unsigned parity) {
    using namespace fp_shim;
    const uint32_t addr = saddr(bar, "mbarrier.try_wait");
    for (bool waited = false;; waited = true) {
        {
            std::lock_guard<std::mutex> g(mbar_lock);
            MBar* m = mbar_at(addr, "mbarrier.try_wait");
            if (!m) {
                return;
            }
            if ((m->completed & 1u) != (parity & 1u)) {
                moved();
                return;  // the phase of this parity has completed
            }
            mbar_progress(*m);
            if ((m->completed & 1u) != (parity & 1u)) {
                moved();
                return;
            }
            if (waited && fiber_deadlock) {
                fail("mbarrier.try_wait: the phase of parity " + std::to_string(parity & 1u) +
                     " never completed (" + std::to_string(m->pending) + " arrivals and " + std::to_string(m->tx) +
                     " bytes missing): a phase off by one, a missing arrive, or bytes announced that no copy brings");
                return;
            }
        }
        fiber_yield();
    }
}

inline void fp_tensormap_acquire(const void*) {}

inline void fp_tma_load_2d(fp_sptr dst, const void* map, fp_sptr bar, int c0, int c1) {
    using namespace fp_shim;
    uint64_t w[8];
    std::memcpy(w, map, sizeof(w));
    if ((uint32_t)w[0] != TMAP_MAGIC) {
        fail("TMA: the tensor map is not in the emulation's encoding (gpu::tma::TensorMap2d::emulated)");
        return;
    }
    const uint32_t elem = (uint32_t)(w[0] >> 32), swz = (uint32_t)w[1], box0 = (uint32_t)(w[1] >> 32);
    const uint32_t box1 = (uint32_t)w[2];
    const unsigned char* base = (const unsigned char*)(uintptr_t)w[3];
    const uint64_t dim0 = w[4], dim1 = w[5], stride1 = w[6];
    const uint32_t off = saddr(dst, "TMA destination");
    const uint32_t atom = swz == 0 ? 128 : 8 * swz;
    if (off % atom != 0) {
        fail("TMA: a destination not aligned to its swizzle atom (" + std::to_string(atom) + " bytes)");
    }
    const uint32_t pitch = box0 * elem, bytes = pitch * box1;
    if ((size_t)off + bytes > dynamic_size()) {
        fail("TMA: the box reaches past the dynamic shared memory");
        return;
    }
    TmaLanding l{dst, std::vector<unsigned char>(bytes, 0)};
    for (uint32_t y = 0; y < box1; y++) {
        for (uint32_t x = 0; x < box0; x++) {
            const long long gx = (long long)c0 + x, gy = (long long)c1 + y;
            const uint32_t at = swizzled(off + y * pitch + x * elem, swz) - off;
            if (gx >= 0 && gy >= 0 && (uint64_t)gx < dim0 && (uint64_t)gy < dim1) {
                std::memcpy(&l.image[at], base + (uint64_t)gy * stride1 + (uint64_t)gx * elem, elem);
            }
        }
    }
    std::memset(dst, 0xff, bytes);
    std::lock_guard<std::mutex> g(mbar_lock);
    MBar* m = mbar_at(saddr(bar, "TMA barrier"), "TMA completion barrier");
    if (m) {
        moved();
        m->queued.push_back(std::move(l));
    }
}

inline void fp_fence_proxy_async() {}

inline void fp_named_sync(unsigned id, unsigned count) { fp_shim::named_barrier(id, count, true); }
inline void fp_named_arrive(unsigned id, unsigned count) { fp_shim::named_barrier(id, count, false); }

template <int R>
inline void fp_setmaxnreg_inc() {}
template <int R>
inline void fp_setmaxnreg_dec() {}

inline void fp_wgmma_fence() { fp_shim::wgmma_fenced = true; }

inline void fp_wgmma_commit() {
    fp_shim::wgmma_committed.push_back(std::move(fp_shim::wgmma_open));
    fp_shim::wgmma_open.clear();
}

template <int N>
inline void fp_wgmma_wait() {
    while (fp_shim::wgmma_committed.size() > (size_t)N) {
        for (const fp_shim::WgmmaOp& op : fp_shim::wgmma_committed.front()) {
            fp_shim::wgmma_retire(op);
        }
        fp_shim::wgmma_committed.pop_front();
    }
    fp_shim::wgmma_fenced = false;
    // Each lane computed its part above; none goes on before all of the warp have (the
    // hardware's products are done for the whole warpgroup when the wait returns).
    fp_shim::warp().bar.arrive_and_wait();
}

template <int N>
inline void fp_acc_fence(float (&)[N]) {}
template <int N>
inline void fp_frag_fence(unsigned (&)[N][4]) {}

template <int TRANS_B>
inline void fp_wgmma_ss_n64(float (&d)[32], unsigned long long da, unsigned long long db, unsigned scale_d) {
    fp_shim::wgmma_issue(d, 64, nullptr, da, db, TRANS_B != 0, scale_d);
}
template <int TRANS_B>
inline void fp_wgmma_ss_n128(float (&d)[64], unsigned long long da, unsigned long long db, unsigned scale_d) {
    fp_shim::wgmma_issue(d, 128, nullptr, da, db, TRANS_B != 0, scale_d);
}
template <int TRANS_B>
inline void fp_wgmma_rs_n64(float (&d)[32], const unsigned (&a)[4], unsigned long long db, unsigned scale_d) {
    fp_shim::wgmma_issue(d, 64, a, 0, db, TRANS_B != 0, scale_d);
}
template <int TRANS_B>
inline void fp_wgmma_rs_n128(float (&d)[64], const unsigned (&a)[4], unsigned long long db, unsigned scale_d) {
    fp_shim::wgmma_issue(d, 128, a, 0, db, TRANS_B != 0, scale_d);
}
