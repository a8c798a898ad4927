/* Attention of short passes (decode and verification rows) over a slot cache, float32.
 *
 * One call covers a whole pass: every batch row b, every query row r and every query head h
 * attends over positions [0, lengths[b]) of its sequence's keys and values (offsets[b] into
 * the arena), the columns its mask row allows (no mask: all of them), grouped KV heads in
 * place (query head h reads KV head h / (heads / kv_heads)).
 *
 * Batch invariance: a row's result depends on that row's query, its keys, values and allowed
 * columns only. Every dot product sums its head_dim products in LANES fixed lanes (lane =
 * index mod LANES) reduced by one fixed tree; the softmax sum does the same over the keys
 * (lane = key index mod LANES, the score buffer padded with exact zeros); each output element
 * accumulates its keys one after another in key order. Masked columns contribute nothing (a
 * zero weight is skipped), so a row computes the same bits whatever else is in the pass, how
 * many rows the pass has, how long the sequence's extent is beyond what the row sees, and
 * how the work is split between threads.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16
/* Head dimensions up to this many lanes' worth keep a query's output in registers. */
#define MAX_CHUNKS 16
typedef float lanes_t __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t lane_index_t __attribute__((vector_size(LANES * sizeof(int32_t))));

#if defined(__clang__)
#define SHUFFLE(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#else
#define SHUFFLE(v, ...) __builtin_shuffle(v, (lane_index_t){__VA_ARGS__})
#endif

static inline lanes_t load_lanes(const float *p) {
    lanes_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* The sum of the lanes by one fixed tree: lane i + lane i + 8, then + 4, + 2, + 1. */
static inline float reduce_lanes(lanes_t v) {
    v += SHUFFLE(v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v += SHUFFLE(v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    v += SHUFFLE(v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    v += SHUFFLE(v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    return v[0];
}

/* q . k over dim elements: element d in lane d mod LANES, then the lanes' tree. Inlined
 * with a constant dim (the common head sizes) the chunk loop unrolls. */
static inline __attribute__((always_inline)) float dot(const float *q, const float *k,
                                                       int64_t dim) {
    lanes_t acc = {0};
    int64_t d = 0;
    for (; d + LANES <= dim; d += LANES)
        acc += load_lanes(q + d) * load_lanes(k + d);
    for (int lane = 0; d < dim; d++, lane++)
        acc[lane] += q[d] * k[d];
    return reduce_lanes(acc);
}

/* exp(x) for x <= 0 (Cody-Waite reduction, Cephes' polynomial), branch-free so that the
 * loop over a row's scores vectorises; below -87 it returns exp(-87) (callers zero what is
 * masked). */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* o = w * sum_j p[j] v_j, each element summing in key order, zero weights skipped. */
static inline __attribute__((always_inline)) void accumulate_chunks(
    const float *p, const float *values, int64_t position_stride, int64_t length,
    int64_t chunks, float w, float *o)
{
    lanes_t acc[MAX_CHUNKS] = {{0}};
    for (int64_t j = 0; j < length; j++) {
        if (p[j] == 0.0f)
            continue;
        const float *v = values + j * position_stride;
        for (int64_t c = 0; c < chunks; c++)
            acc[c] += p[j] * load_lanes(v + c * LANES);
    }
    for (int64_t c = 0; c < chunks; c++) {
        lanes_t scaled = acc[c] * w;
        memcpy(o + c * LANES, &scaled, sizeof scaled);
    }
}

static void accumulate(
    const float *p, const float *values, int64_t position_stride, int64_t length,
    int64_t dim, float w, float *o)
{
    memset(o, 0, (size_t)dim * sizeof(float));
    for (int64_t j = 0; j < length; j++) {
        if (p[j] == 0.0f)
            continue;
        const float *v = values + j * position_stride;
        for (int64_t d = 0; d < dim; d++)
            o[d] += p[j] * v[d];
    }
    for (int64_t d = 0; d < dim; d++)
        o[d] *= w;
}

/* scores[vector][j] = scale * q_vector . k_j for the rows x group query vectors. */
static inline __attribute__((always_inline)) void score_keys(
    const float *query, int64_t q_row_stride, int64_t q_head_stride,
    const float *keys, int64_t position_stride, int64_t rows, int64_t group, int64_t length,
    int64_t dim, float scale, float *scores, int64_t padded)
{
    for (int64_t j = 0; j < length; j++) {
        const float *k = keys + j * position_stride;
        for (int64_t r = 0; r < rows; r++)
            for (int64_t g = 0; g < group; g++)
                scores[(r * group + g) * padded + j] =
                    dot(query + r * q_row_stride + g * q_head_stride, k, dim) * scale;
    }
}

/* One (batch row, KV head): its rows x group query vectors. */
static void attend_group(
    const float *query, int64_t q_row_stride, int64_t q_head_stride,
    const float *keys, const float *values, int64_t position_stride,
    const uint8_t *mask, int64_t mask_row_stride,
    float *out, int64_t out_row_stride,
    int64_t rows, int64_t group, int64_t length, int64_t dim, float scale,
    float *scores /* [rows * group][padded] */, int64_t padded)
{
    const int64_t vectors = rows * group;
    /* Scores, every query vector against each key in turn (the key is read once). */
    if (dim == 4 * LANES)
        score_keys(query, q_row_stride, q_head_stride, keys, position_stride, rows, group,
                   length, 4 * LANES, scale, scores, padded);
    else
        score_keys(query, q_row_stride, q_head_stride, keys, position_stride, rows, group,
                   length, dim, scale, scores, padded);
    float *inverse = scores + vectors * padded; /* [vectors] */
    const float minus_infinity = -__builtin_inff();
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *allowed = mask ? mask + r * mask_row_stride : NULL;
        for (int64_t g = 0; g < group; g++) {
            float *s = scores + (r * group + g) * padded;
            /* Masked columns and the padding score -inf, then weigh exactly 0. */
            if (allowed)
                for (int64_t j = 0; j < length; j++)
                    s[j] = allowed[j] ? s[j] : minus_infinity;
            for (int64_t j = length; j < padded; j++)
                s[j] = minus_infinity;
            lanes_t tops = load_lanes(s);
            for (int64_t j = LANES; j < padded; j += LANES) {
                lanes_t next = load_lanes(s + j);
                lane_index_t larger = tops > next;  /* all ones where tops is larger */
                tops = (lanes_t)((larger & (lane_index_t)tops) | (~larger & (lane_index_t)next));
            }
            float top = tops[0];
            for (int lane = 1; lane < LANES; lane++)
                top = tops[lane] > top ? tops[lane] : top;
            for (int64_t j = 0; j < padded; j++) {
                float e = exp_nonpositive(s[j] - top);
                s[j] = s[j] > minus_infinity ? e : 0.0f;
            }
            lanes_t acc = {0};
            for (int64_t j = 0; j < padded; j += LANES)
                acc += load_lanes(s + j);
            float total = reduce_lanes(acc);
            inverse[r * group + g] = total > 0.0f ? 1.0f / total : 0.0f;
        }
    }
    /* Outputs: each element sums its keys in key order; zero weights are skipped. */
    for (int64_t r = 0; r < rows; r++)
        for (int64_t g = 0; g < group; g++) {
            const float *p = scores + (r * group + g) * padded;
            float *o = out + r * out_row_stride + g * dim;
            if (dim == 4 * LANES)  /* the common head size, unrolled */
                accumulate_chunks(p, values, position_stride, length, 4,
                                  inverse[r * group + g], o);
            else if (dim % LANES == 0 && dim / LANES <= MAX_CHUNKS)
                accumulate_chunks(p, values, position_stride, length, dim / LANES,
                                  inverse[r * group + g], o);
            else
                accumulate(p, values, position_stride, length, dim, inverse[r * group + g], o);
        }
}

/* query [batch, heads, rows, dim] (strides in elements; dim contiguous); keys and values
 * share one layout: element (b, kv head, position, d) at b * kv_batch_stride + kv head *
 * kv_head_stride + (offsets[b] + position) * position_stride + d; mask (NULL: none) row r
 * of batch row b at b * mask_batch_stride + r * mask_row_stride, one byte per column;
 * row_counts (NULL: rows for all): batch row b's own rows, the first row_counts[b], the
 * others padding, whose outputs are zeros; out [batch, rows, heads, dim] contiguous.
 * Returns 0, or -1 when scratch memory could not be had. */
int specgate_attend(
    const float *query, int64_t q_batch_stride, int64_t q_head_stride, int64_t q_row_stride,
    const float *keys, const float *values,
    int64_t kv_batch_stride, int64_t kv_head_stride, int64_t position_stride,
    const int64_t *offsets, const int64_t *lengths, const int64_t *row_counts,
    const uint8_t *mask, int64_t mask_batch_stride, int64_t mask_row_stride,
    float *out,
    int64_t batch, int64_t heads, int64_t kv_heads, int64_t rows, int64_t dim, float scale)
{
    const int64_t group = heads / kv_heads;
    int64_t longest = 0;
    for (int64_t b = 0; b < batch; b++)
        longest = lengths[b] > longest ? lengths[b] : longest;
    const int64_t padded = (longest + LANES - 1) / LANES * LANES;
    float *scores = malloc((size_t)(rows * group * (padded + 1)) * sizeof(float) + 64);
    if (!scores)
        return -1;
    const int64_t out_row_stride = heads * dim;
    for (int64_t b = 0; b < batch; b++) {
        const int64_t length = lengths[b];
        const int64_t base = b * kv_batch_stride + offsets[b] * position_stride;
        const int64_t own = row_counts ? row_counts[b] : rows;
        for (int64_t h = 0; h < kv_heads; h++) {
            const int64_t first = h * group;
            attend_group(
                query + b * q_batch_stride + first * q_head_stride, q_row_stride, q_head_stride,
                keys + base + h * kv_head_stride, values + base + h * kv_head_stride,
                position_stride,
                mask ? mask + b * mask_batch_stride : NULL, mask_row_stride,
                out + b * rows * out_row_stride + first * dim, out_row_stride,
                own, group, length, dim, scale, scores, padded);
        }
        /* Padding rows are not attended: zeros, never read. */
        if (own < rows)
            memset(out + (b * rows + own) * out_row_stride, 0,
                   (size_t)((rows - own) * out_row_stride) * sizeof(float));
    }
    free(scores);
    return 0;
}
