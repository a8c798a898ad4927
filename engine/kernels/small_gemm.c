/* Products of a few rows (decode, verification chains and trees, small batches) with a
 * prepacked float32 weight: out[i, j] = bias[j] + sum_c x[i, c] * w[j, c].
 *
 * The weight is packed once at load into panels of PANEL output columns, each panel
 * [in_features][PANEL] (column j of the weight is lane j mod PANEL of panel j / PANEL, zero
 * lanes past the last column), so a pass streams every weight byte once, in order, with one
 * call per product whatever the row count: the rows of a panel are computed ROWS at a time
 * while its columns are in cache. Six rows give twelve accumulators, enough independent FMAs
 * to keep both FMA pipes busy through the instruction's latency (four rows, eight
 * accumulators, left them idle a fifth of the time: a 42-row prefill pass took 1.3x as long),
 * and with the two weight vectors and the broadcast they fit AVX2's sixteen registers.
 * While a panel is computed, the stream of weights PREFETCH_COLUMNS columns ahead (into the
 * next panel) is fetched, so memory and arithmetic overlap on a batch of rows.
 *
 * Batch invariance: out[i, j] is one accumulator, zero, then a fused multiply-add per input
 * column in column order (c = 0, 1, ...), then the bias added: the same operations in the
 * same order whichever rows share the call, how many there are, which row tile a row falls
 * in and how the panels are split between threads. So a row's result is bitwise the same
 * alone and in any batch.
 *
 * Threads: the calling thread and at most one helper split the panels (the helper takes the
 * second half). The helper is a persistent pthread woken by a condition variable (not
 * OpenMP: a second OpenMP runtime beside PyTorch's is unsafe); calls with little work run on
 * the calling thread alone.
 */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define PANEL 16
#define ROWS 6
/* Columns (cache lines of a panel) fetched ahead: 4 KiB. */
#define PREFETCH_COLUMNS 64
/* Below this many weight elements a product runs on the calling thread only. */
#define SPLIT_ELEMENTS (256 * 1024)

typedef float vec_t __attribute__((vector_size(8 * sizeof(float))));

static inline vec_t load8(const float *p) {
    vec_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline vec_t splat(float x) { return (vec_t){x, x, x, x, x, x, x, x}; }

/* a * b + c rounded once (the FMA instruction where the build has it, in every tile alike). */
#if defined(__FMA__)
#include <immintrin.h>
static inline vec_t fma8(vec_t a, vec_t b, vec_t c) {
    return (vec_t)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
}
#else
static inline vec_t fma8(vec_t a, vec_t b, vec_t c) { return a * b + c; }
#endif

/* `rows` (a constant where inlined) rows of x against one panel, into out's columns
 * [0, width). */
static inline __attribute__((always_inline)) void tile(
    const float *x, int64_t x_stride, int64_t rows, int64_t depth, const float *panel,
    const float *bias, float *out, int64_t out_stride, int64_t width) {
    vec_t low[ROWS], high[ROWS];
    for (int64_t r = 0; r < rows; r++)
        low[r] = high[r] = splat(0.0f);
    for (int64_t c = 0; c < depth; c++) {
        vec_t w_low = load8(panel + c * PANEL), w_high = load8(panel + c * PANEL + 8);
        __builtin_prefetch(panel + (c + PREFETCH_COLUMNS) * PANEL);
        for (int64_t r = 0; r < rows; r++) {
            vec_t xv = splat(x[r * x_stride + c]);
            low[r] = fma8(xv, w_low, low[r]);
            high[r] = fma8(xv, w_high, high[r]);
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        float lanes[PANEL];
        memcpy(lanes, &low[r], sizeof low[r]);
        memcpy(lanes + 8, &high[r], sizeof high[r]);
        for (int64_t j = 0; j < width; j++)
            out[r * out_stride + j] = bias ? lanes[j] + bias[j] : lanes[j];
    }
}

typedef struct {
    const float *x;
    int64_t x_stride, rows, depth;
    const float *weight;
    const float *bias;
    float *out;
    int64_t out_stride, columns;
} product_t;

static void panels(const product_t *p, int64_t first, int64_t last) {
    for (int64_t q = first; q < last; q++) {
        const float *panel = p->weight + q * p->depth * PANEL;
        const float *bias = p->bias ? p->bias + q * PANEL : 0;
        int64_t width = p->columns - q * PANEL < PANEL ? p->columns - q * PANEL : PANEL;
        float *out = p->out + q * PANEL;
        int64_t i = 0;
        for (; i + ROWS <= p->rows; i += ROWS)
            tile(p->x + i * p->x_stride, p->x_stride, ROWS, p->depth, panel, bias,
                 out + i * p->out_stride, p->out_stride, width);
        const float *x = p->x + i * p->x_stride;
        float *o = out + i * p->out_stride;
        switch (p->rows - i) {
        case 5: tile(x, p->x_stride, 5, p->depth, panel, bias, o, p->out_stride, width); break;
        case 4: tile(x, p->x_stride, 4, p->depth, panel, bias, o, p->out_stride, width); break;
        case 3: tile(x, p->x_stride, 3, p->depth, panel, bias, o, p->out_stride, width); break;
        case 2: tile(x, p->x_stride, 2, p->depth, panel, bias, o, p->out_stride, width); break;
        case 1: tile(x, p->x_stride, 1, p->depth, panel, bias, o, p->out_stride, width); break;
        default: break;
        }
    }
}

/* The helper thread: it runs panels [first, last) of `job` when `pending` is set. */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER, done = PTHREAD_COND_INITIALIZER;
static pthread_mutex_t caller = PTHREAD_MUTEX_INITIALIZER; /* one split product at a time */
static const product_t *job;
static int64_t job_first, job_last;
static int pending, started;

static void *helper(void *unused) {
    (void)unused;
    pthread_mutex_lock(&lock);
    for (;;) {
        while (!pending)
            pthread_cond_wait(&wake, &lock);
        pthread_mutex_unlock(&lock);
        panels(job, job_first, job_last);
        pthread_mutex_lock(&lock);
        pending = 0;
        pthread_cond_signal(&done);
    }
    return 0;
}

/* A child forked after the helper started has no helper (fork copies the calling thread
 * only): it starts its own at its first split product, with the locks as new. */
static void forget_helper(void) {
    pthread_mutex_init(&lock, 0);
    pthread_mutex_init(&caller, 0);
    pthread_cond_init(&wake, 0);
    pthread_cond_init(&done, 0);
    pending = started = 0;
}

/* Where the helper cannot be started, the calling thread runs the whole product. */
void specgate_small_gemm(const float *x, int64_t x_stride, int64_t rows, int64_t depth,
                        const float *weight, const float *bias, float *out,
                        int64_t out_stride, int64_t columns, int64_t threads) {
    product_t p = {x, x_stride, rows, depth, weight, bias, out, out_stride, columns};
    int64_t count = (columns + PANEL - 1) / PANEL;
    if (threads < 2 || count < 2 || columns * depth < SPLIT_ELEMENTS) {
        panels(&p, 0, count);
        return;
    }
    pthread_mutex_lock(&caller);
    pthread_mutex_lock(&lock);
    if (!started) {
        static int registered;
        if (!registered && pthread_atfork(0, 0, forget_helper) == 0)
            registered = 1;
        pthread_t thread;
        if (!registered || pthread_create(&thread, 0, helper, 0) != 0) {
            pthread_mutex_unlock(&lock);
            pthread_mutex_unlock(&caller);
            panels(&p, 0, count);
            return;
        }
        pthread_detach(thread);
        started = 1;
    }
    int64_t half = count / 2;
    job = &p;
    job_first = half;
    job_last = count;
    pending = 1;
    pthread_cond_signal(&wake);
    pthread_mutex_unlock(&lock);
    panels(&p, 0, half);
    pthread_mutex_lock(&lock);
    while (pending)
        pthread_cond_wait(&done, &lock);
    pthread_mutex_unlock(&lock);
    pthread_mutex_unlock(&caller);
}
