/* Faulting in a fresh output's pages before the kernels write it.
 *
 * glibc hands allocations above its mmap threshold (32 MiB at most) over as fresh mappings, so the kernels'
 * first write to each 4 KiB page of such an output traps into the OS: ~6 ms per 32 MiB on the 2-core Xeon of
 * docs/benchmarks.md, a quarter of the elu forward at N = 16k. One madvise(MADV_POPULATE_WRITE) per thread over
 * its share of the pages does the same work without a trap per page: 32 MiB populated and then written took
 * 3.5-6.5 ms there against 6.5-7 ms written page by page (the OS still zeroes every page), and the elu forward
 * gained 2-3%. It changes no byte of the memory; where the OS lacks it (before Linux 5.14, other systems)
 * nothing happens and the writes fault as before.
 */
#include <stdint.h>
#ifdef __linux__
#include <errno.h>
#include <sys/mman.h>
#include <unistd.h>
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

static int unsupported; /* set once the OS refuses the advice: later calls return at once */
#endif

/* Fault in the whole pages of [start, start + bytes) for writing, split over `threads` threads. Returns 1 if
 * the pages were populated, 0 if nothing was done (memory already in place, or no support). */
int lm_prefault(void *start, long bytes, int threads) {
#ifdef __linux__
    const long page = sysconf(_SC_PAGESIZE);
    const uintptr_t first = ((uintptr_t)start + page - 1) / page * page;
    const uintptr_t end = ((uintptr_t)start + bytes) / page * page;
    if (unsupported || page <= 0 || end <= first) return 0;
    /* Memory that was written before (a reused buffer, another allocator's cache) needs nothing: its last whole
     * page, which a fresh mapping has not touched yet, is already resident. */
    unsigned char resident = 0;
    if (mincore((void *)(end - page), page, &resident) == 0 && (resident & 1)) return 0;
    const long pages = (long)((end - first) / page);
    if (threads < 1) threads = 1;
    if (threads > pages) threads = (int)pages;
    int failed = 0, refused = 0;
#pragma omp parallel for num_threads(threads) reduction(|| : failed, refused)
    for (int t = 0; t < threads; t++) {
        const uintptr_t lo = first + (uintptr_t)(pages * t / threads) * page;
        const uintptr_t hi = first + (uintptr_t)(pages * (t + 1) / threads) * page;
        if (madvise((void *)lo, hi - lo, MADV_POPULATE_WRITE) != 0) {
            failed = 1;
            refused = refused || errno == EINVAL || errno == ENOSYS;
        }
    }
    if (refused) unsupported = 1;
    return !failed;
#else
    (void)start; (void)bytes; (void)threads;
    return 0;
#endif
}
