/* A cache of the compiled code's large outputs, kept between calls.
 *
 * glibc maps every block of 32 MiB or more afresh and unmaps it when it is freed, so each call's output and input
 * gradients at N = 16k (B 1 x 8 heads of 64: 32 MiB each) have every page faulted in and zeroed by the OS again:
 * a quarter of the elu forward + backward on the 2-core Xeon of docs/benchmarks.md, even with prefault.c's help.
 * Telling the whole process's allocator to keep freed memory (docs/cpu_allocator.md) is the user's choice, not
 * ours; these blocks are only the ones the kernels write. Each is handed to torch as a DLPack tensor whose deleter
 * brings it back here when torch lets the last view go, so a block is reused only once nothing can see it.
 *
 * Free blocks are kept up to a limit of bytes (lm_cache_set_limit); past it the longest unused are given back to
 * the system. A request takes the smallest free block of at least its size and at most 1/8 more, so a shape that
 * varies a little still reuses one. The DLPack structs are the stable layout torch reads from a "dltensor" capsule
 * (DLPack 0.x): only their fields' order and types matter here.
 */
#include <stdint.h>
#include <stdlib.h>

#if defined(__unix__) || defined(__APPLE__)
#include <pthread.h>
#define CACHE_SUPPORTED 1
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t fork_handler_once = PTHREAD_ONCE_INIT;
#define LOCK() pthread_mutex_lock(&lock)
#define UNLOCK() pthread_mutex_unlock(&lock)
/* A child forked while another thread held the lock (freeing a tensor) would wait on it forever. The child's
 * blocks are its own copies, so it keeps them under a fresh lock. */
static void fresh_lock_in_child(void) { pthread_mutex_init(&lock, NULL); }
static void register_fork_handler(void) { pthread_atfork(NULL, NULL, fresh_lock_in_child); }
#else
#define CACHE_SUPPORTED 0
#define LOCK()
#define UNLOCK()
#endif

typedef struct { int32_t device_type, device_id; } DLDevice;
typedef struct { uint8_t code, bits; uint16_t lanes; } DLDataType;
typedef struct {
    void *data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape, *strides;
    uint64_t byte_offset;
} DLTensor;
typedef struct DLManagedTensor {
    DLTensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;

enum { DL_CPU = 1, DL_UINT = 1, ALIGNMENT = 64 }; /* torch aligns CPU memory to 64 bytes too */

typedef struct block {
    DLManagedTensor managed; /* what torch holds while the block is in use; first, so a block is its own handle */
    int64_t shape;           /* the bytes asked for, the tensor's one dimension */
    long bytes;              /* the block's size */
    unsigned long returned;  /* when it came back, for giving back the longest unused first */
    struct block *next;      /* the free list */
} block;

static block *free_list;
static long kept, limit, hits, misses;
static unsigned long returns;

static void release(block *b) {
    free(b->managed.dl_tensor.data);
    free(b);
}

/* Give back the longest unused free blocks until at most `most` bytes are kept. Called with the lock held. */
static void trim_to(long most) {
    while (kept > most && free_list) {
        block **oldest = &free_list;
        for (block **at = &free_list; *at; at = &(*at)->next)
            if ((*at)->returned < (*oldest)->returned) oldest = at;
        block *b = *oldest;
        *oldest = b->next;
        kept -= b->bytes;
        release(b);
    }
}

static void bring_back(DLManagedTensor *managed) {
    block *b = (block *)managed;
    LOCK();
    if (b->bytes > limit) {
        release(b);
    } else {
        trim_to(limit - b->bytes);
        b->returned = ++returns;
        b->next = free_list;
        free_list = b;
        kept += b->bytes;
    }
    UNLOCK();
}

/* A DLManagedTensor of `bytes` uint8 on the CPU, from a free block or freshly allocated; NULL if memory ran out or
 * the platform has no cache (the caller then allocates as usual). */
void *lm_cache_take(long bytes) {
#if CACHE_SUPPORTED
    if (bytes <= 0) return NULL;
    pthread_once(&fork_handler_once, register_fork_handler);
    block *found = NULL;
    LOCK();
    block **best = NULL;
    for (block **at = &free_list; *at; at = &(*at)->next) {
        const long size = (*at)->bytes;
        if (size >= bytes && size - bytes <= bytes / 8 && (!best || size < (*best)->bytes)) best = at;
    }
    if (best) {
        found = *best;
        *best = found->next;
        kept -= found->bytes;
        hits++;
    } else {
        misses++;
    }
    UNLOCK();
    if (!found) {
        found = calloc(1, sizeof(block));
        void *data = NULL;
        if (!found || posix_memalign(&data, ALIGNMENT, (size_t)bytes) != 0) {
            free(found);
            return NULL;
        }
        found->managed.dl_tensor.data = data;
        found->bytes = bytes;
    }
    found->shape = bytes;
    found->next = NULL;
    DLTensor *t = &found->managed.dl_tensor;
    t->device = (DLDevice){DL_CPU, 0};
    t->ndim = 1;
    t->dtype = (DLDataType){DL_UINT, 8, 1};
    t->shape = &found->shape;
    t->strides = NULL;
    t->byte_offset = 0;
    found->managed.manager_ctx = found;
    found->managed.deleter = bring_back;
    return &found->managed;
#else
    (void)bytes;
    return NULL;
#endif
}

/* Return a block that torch never took over (the caller failed between lm_cache_take and from_dlpack). */
void lm_cache_give_back(void *handle) {
    if (handle) bring_back((DLManagedTensor *)handle);
}

/* Keep at most `bytes` of free blocks from now on (0: keep none), giving back what is over. */
void lm_cache_set_limit(long bytes) {
    LOCK();
    limit = bytes < 0 ? 0 : bytes;
    trim_to(limit);
    UNLOCK();
}

/* stats[0..3] = bytes kept free, the limit, requests served from the cache, requests that allocated. */
void lm_cache_stats(long *stats) {
    LOCK();
    stats[0] = kept;
    stats[1] = limit;
    stats[2] = hits;
    stats[3] = misses;
    UNLOCK();
}

