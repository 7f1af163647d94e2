/* The INT8 generator's chains between convolutions, each in one or two passes over its channel.

   A chain is what the `snake` and `quantize` stages leave between two QLinearConvs: InstanceNormalization with
   the utterance's own statistics (AdaIN's gain and shift folded into its scale and bias), Snake's sin^2 as a
   degree-2 polynomial after rounding to the nearest half turn, and QuantizeLinear to the next convolution's
   uint8 input. ONNX Runtime runs it as ~12 passes over float activations; here it is one pass for the
   statistics and one for the output. A chain whose input is a convolution's uint8 output is a function of
   that level alone once the statistics are known: 256 evaluations per channel and a table lookup.

   Built without -ffast-math and with -ffp-contract=off: (y + c1) - c1 must round as ONNX Runtime's separate
   float ops do, and fused multiply-adds, which only some machines have, must not change a level. Only the
   moments' sums are reordered (into vector lanes, -fopenmp-simd): a difference of one part in 1e15. */
#include <math.h>
#include <stdint.h>

#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif

static inline uint8_t snake_level(float y, float c1, float a, float b, float qs, float qz) {
    float k = (y + c1) - c1; /* y rounded to a whole number: c1 is 1.5 * 2^23 */
    float r = y - k;
    float t = r * r;
    float u = y + (a * t + b) * t;
    float v = rintf(u / qs) + qz;
    v = v < 0.f ? 0.f : v;
    v = v > 255.f ? 255.f : v;
    return (uint8_t)v;
}

/* A chain's per-channel constants and the utterance's norm parameters (AdaIN folded into scale and bias). */
typedef struct {
    const float *scale, *bias, *gain, *shift, *qscale, *qzero;
    float eps, c1, a, b;
} Affine;

/* Sum and sum of squares of one channel, in double; the pragma lets this one loop add in vector lanes. */
static void float_moments(const float *row, int64_t T, double *sum, double *squares) {
    double s1 = 0, s2 = 0;
#pragma omp simd reduction(+ : s1, s2)
    for (int64_t t = 0; t < T; ++t) {
        double v = row[t];
        s1 += v;
        s2 += v * v;
    }
    *sum = s1;
    *squares = s2;
}

/* o[t] = table[row[t]]: four 64-byte permutes where the CPU has AVX-512 VBMI, one byte at a time elsewhere. */
static void look_up(const uint8_t *row, const uint8_t *table, uint8_t *o, int64_t T) {
    int64_t t = 0;
#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
    __m512i t0 = _mm512_loadu_si512(table), t1 = _mm512_loadu_si512(table + 64);
    __m512i t2 = _mm512_loadu_si512(table + 128), t3 = _mm512_loadu_si512(table + 192);
    for (; t + 64 <= T; t += 64) {
        __m512i idx = _mm512_loadu_si512(row + t);
        __m512i low = _mm512_permutex2var_epi8(t0, idx, t1);
        __m512i high = _mm512_permutex2var_epi8(t2, idx, t3);
        _mm512_storeu_si512(o + t, _mm512_mask_blend_epi8(_mm512_movepi8_mask(idx), low, high));
    }
#endif
    for (; t < T; ++t) o[t] = table[row[t]];
}

/* The norm as ONNX Runtime's InstanceNormalization computes it, (x - mean) * (scale / sqrt(var + eps)) + bias,
   then AdaIN's gain and shift where a norm is shared by three branches (1 and 0 elsewhere: exact). */
typedef struct {
    float mean, k, bias, gain, shift;
} Norm;

static inline Norm norm_of(double mean, double var, const Affine *af, int64_t c) {
    Norm n = {(float)mean, af->scale[c] / sqrtf((float)var + af->eps), af->bias[c], af->gain[c], af->shift[c]};
    return n;
}

static inline float normalized(float x, Norm n) { return ((x - n.mean) * n.k + n.bias) * n.gain + n.shift; }

/* x[c, t] = (q[c, t] - zero[c]) * scale[c] normalized, Snake, quantized: through a 256-entry table per channel. */
void level_chain(const uint8_t *q, int64_t T, int64_t c_lo, int64_t c_hi, const float *scale, const float *zero,
                 const Affine *af, uint8_t *out) {
    for (int64_t c = c_lo; c < c_hi; ++c) {
        const uint8_t *row = q + c * T;
        uint64_t s1 = 0, s2 = 0;
        for (int64_t t = 0; t < T; ++t) {
            uint32_t v = row[t];
            s1 += v;
            s2 += v * v;
        }
        double s = scale[c], z = zero[c];
        double level_mean = (double)s1 / T;
        Norm n = norm_of(s * (level_mean - z), s * s * ((double)s2 / T - level_mean * level_mean), af, c);
        float sf = scale[c], zf = zero[c];
        uint8_t table[256];
        for (int level = 0; level < 256; ++level)
            table[level] = snake_level(normalized(((float)level - zf) * sf, n), af->c1, af->a, af->b, af->qscale[c], af->qzero[c]);
        look_up(row, table, out + c * T, T);
    }
}

static void apply(const float *row, int64_t T, double sum, double squares, const Affine *af, int64_t c, uint8_t *o) {
    double mean = sum / T;
    Norm n = norm_of(mean, squares / T - mean * mean, af, c);
    float c1 = af->c1, a = af->a, b = af->b, qs = af->qscale[c], qz = af->qzero[c];
    for (int64_t t = 0; t < T; ++t) o[t] = snake_level(normalized(row[t], n), c1, a, b, qs, qz);
}

/* The chain over a float input (the residual stream). */
void float_chain(const float *x, int64_t T, int64_t c_lo, int64_t c_hi, const Affine *af, uint8_t *out) {
    for (int64_t c = c_lo; c < c_hi; ++c) {
        double s1, s2;
        float_moments(x + c * T, T, &s1, &s2);
        apply(x + c * T, T, s1, s2, af, c, out + c * T);
    }
}

/* The residual add before a chain, then the chain: x_new = prev + (q - zero) * scale is written out (the next
   residual add reads it) and its moments gathered in the same pass. */
void residual_chain(const float *prev, const uint8_t *q, int64_t T, int64_t c_lo, int64_t c_hi, const float *scale,
                    const float *zero, float *x_new, const Affine *af, uint8_t *out) {
    for (int64_t c = c_lo; c < c_hi; ++c) {
        const float *p = prev + c * T;
        const uint8_t *qr = q + c * T;
        float *row = x_new + c * T;
        float s = scale[c], z = zero[c];
        double s1 = 0, s2 = 0;
#pragma omp simd reduction(+ : s1, s2)
        for (int64_t t = 0; t < T; ++t) {
            float v = ((float)qr[t] - z) * s + p[t];
            row[t] = v;
            s1 += (double)v;
            s2 += (double)v * v;
        }
        apply(row, T, s1, s2, af, c, out + c * T);
    }
}

/* A stage's output: ((r0 + r1) + r2) / divisor with r = (q - zero) * scale + x, in ONNX Runtime's order. */
typedef struct {
    const uint8_t *q[3];
    const float *x[3];
    const float *scale[3], *zero[3];
    float divisor;
} Branches;

void branch_sum(const Branches *br, int64_t T, int64_t c_lo, int64_t c_hi, float *out) {
    for (int64_t c = c_lo; c < c_hi; ++c) {
        float s0 = br->scale[0][c], s1 = br->scale[1][c], s2 = br->scale[2][c];
        float z0 = br->zero[0][c], z1 = br->zero[1][c], z2 = br->zero[2][c];
        const uint8_t *q0 = br->q[0] + c * T, *q1 = br->q[1] + c * T, *q2 = br->q[2] + c * T;
        const float *x0 = br->x[0] + c * T, *x1 = br->x[1] + c * T, *x2 = br->x[2] + c * T;
        float *o = out + c * T, d = br->divisor;
        for (int64_t t = 0; t < T; ++t) {
            float r0 = ((float)q0[t] - z0) * s0 + x0[t];
            float r1 = ((float)q1[t] - z1) * s1 + x1[t];
            float r2 = ((float)q2[t] - z2) * s2 + x2[t];
            o[t] = ((r0 + r1) + r2) / d;
        }
    }
}

