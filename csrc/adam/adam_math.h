/* The Adam / AdamW update of one element, shared by the CPU kernel (adam/cpu_adam.c) and the
 * CUDA kernel (adam/fused_adam.cu), and the per-step constants it uses.
 *
 * [Note: adam math]
 * Per element, with every operation rounded to fp32 (fma = one rounding for a*b + c):
 *
 *     g = g / grad_scale                   skipped when grad_scale == 1
 *     AdamW:  p = p * decay                decay = 1 - lr*wd         torch: param.mul_(1 - lr*wd)
 *     Adam:   g = fma(wd, p, g)                                      torch: grad.add(param, alpha=wd)
 *     m = fma(1-beta1, g - m, m)                                     torch: exp_avg.lerp_(grad, 1-beta1)
 *     v = fma((1-beta2) * g, g, v*beta2)   torch: exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1-beta2)
 *     d = fma(sqrt(v), 1/sqrt(bc2), eps)                             torch: v.sqrt() / sqrt(bc2) + eps
 *     p = p + (-lr/bc1 * m) / d                                      torch: param.addcdiv_(m, d, value=-lr/bc1)
 *
 * with bc1 = 1 - beta1^step and bc2 = 1 - beta2^step (both 1 without bias correction). The step
 * constants (1 - lr*wd, -lr/bc1, 1/sqrt(bc2), 1 - beta) are computed in double and rounded to
 * fp32 once, as torch rounds its Python-float scalars.
 *
 * This is torch's single-tensor / foreach order. The m update is torch's lerp, m + w*(g - m),
 * not beta1*m + (1-beta1)*g: in fp32 the two coefficients of the latter do not sum to 1, and m
 * drifts from torch's by a few ulp. The fmas are the ones nvcc forms in torch's CUDA kernels
 * (torch's CPU addcmul rounds (1-beta2)*g*g before adding it, so v may differ from torch's CPU
 * result in its last bit). One deliberate difference: sqrt(v) is multiplied by
 * 1/sqrt(bc2) rather than divided by sqrt(bc2), because a vector division costs as much as a
 * vector square root and the AVX-512 loop is otherwise too close to its memory-bandwidth limit;
 * the result differs from torch's by at most an ulp of the denominator.
 *
 * Every path computes exactly this, in this order: the portable C path and the CUDA kernel call
 * zero_adam_element below, and the AVX2 / AVX-512 paths write the same operations with
 * intrinsics. Square roots and divisions are IEEE (correctly rounded), so all of them give the
 * same bits for the same inputs; tests/test_cpu_adam.py checks this across the CPU paths, and
 * tests/test_fused_adam_gpu.py and csrc/dev/adam_check.cu between the CPU and the GPU. */
#ifndef ZERO_ADAM_ADAM_MATH_H
#define ZERO_ADAM_ADAM_MATH_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "common/dtypes.h" /* ZERO_HD */

/* Hyperparameters of one step, as given. Doubles, so the step constants are computed at full
 * precision before each is rounded to fp32 once. */
typedef struct {
    double lr;
    double beta1, beta2; /* each in [0, 1) */
    double eps;
    double weight_decay;
    double grad_scale;   /* the gradient is divided by this first; 1.0 = unscaled */
    int64_t step;        /* 1-based count of this step (already incremented) */
    int adamw_mode;      /* 1: decoupled weight decay (AdamW); 0: L2 added to the gradient (Adam) */
    int bias_correction; /* 1: divide by 1 - beta^step; 0: do not */
} zero_adam_config;

/* The per-step constants of [Note: adam math], rounded to fp32. */
typedef struct {
    int scale_grad; /* divide the gradient by grad_scale (skipped when it is exactly 1) */
    int adamw;      /* decoupled decay (multiply p by decay) or L2 (add l2 * p to g) */
    float grad_scale;
    float decay; /* 1 - lr*wd in AdamW mode, else 1 */
    float l2;    /* wd in Adam mode, else 0 */
    float beta2;
    float one_minus_beta1;
    float one_minus_beta2;
    float neg_step_size; /* -lr / bc1 */
    float inv_bc2_sqrt;  /* 1 / sqrt(bc2) */
    float eps;
} zero_adam_coeffs;

/* 1 when the config is one torch.optim.Adam accepts: finite lr, eps, weight_decay >= 0, betas in
 * [0, 1), a finite grad_scale > 0, and step >= 1 when bias correction is on. Also beta2 == 1
 * without bias correction: the second moment stays as it is (v * 1 + 0 * g^2), which is how 1-bit
 * Adam steps with its variance frozen (zero/onebit/optimizer.py). */
static inline int zero_adam_config_ok(const zero_adam_config *cfg) {
    if (cfg == NULL) return 0;
    const int finite = isfinite(cfg->lr) && isfinite(cfg->eps) && isfinite(cfg->weight_decay) &&
                       isfinite(cfg->grad_scale);
    return finite && cfg->lr >= 0 && cfg->beta1 >= 0 && cfg->beta1 < 1 && cfg->beta2 >= 0 &&
           (cfg->beta2 < 1 || (cfg->beta2 == 1 && !cfg->bias_correction)) &&
           cfg->eps >= 0 && cfg->weight_decay >= 0 && cfg->grad_scale > 0 && (!cfg->bias_correction || cfg->step >= 1);
}

/* Host side: the step constants of `cfg`, computed in double and rounded to fp32 once each. */
static inline zero_adam_coeffs zero_adam_coeffs_of(const zero_adam_config *cfg) {
    double bc1 = 1.0, bc2 = 1.0;
    if (cfg->bias_correction) {
        bc1 = 1.0 - pow(cfg->beta1, (double)cfg->step);
        bc2 = 1.0 - pow(cfg->beta2, (double)cfg->step);
    }
    zero_adam_coeffs c;
    c.scale_grad = cfg->grad_scale != 1.0;
    c.adamw = cfg->adamw_mode != 0;
    c.grad_scale = (float)cfg->grad_scale;
    c.decay = c.adamw ? (float)(1.0 - cfg->lr * cfg->weight_decay) : 1.0f;
    c.l2 = c.adamw ? 0.0f : (float)cfg->weight_decay;
    c.beta2 = (float)cfg->beta2;
    c.one_minus_beta1 = (float)(1.0 - cfg->beta1);
    c.one_minus_beta2 = (float)(1.0 - cfg->beta2);
    c.neg_step_size = (float)(-(cfg->lr / bc1));
    c.inv_bc2_sqrt = (float)(1.0 / sqrt(bc2));
    c.eps = (float)cfg->eps;
    return c;
}

/* IEEE division and square root whatever nvcc's flags (--use_fast_math would make `/` and sqrtf
 * approximate in device code); plain C operators elsewhere. */
static inline ZERO_HD float zero_div_rn(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fdiv_rn(a, b);
#else
    return a / b;
#endif
}

static inline ZERO_HD float zero_sqrt_rn(float x) {
#ifdef __CUDA_ARCH__
    return __fsqrt_rn(x);
#else
    return sqrtf(x);
#endif
}

/* One Adam step on one element, in place on *p, *m, *v; g is the raw gradient in fp32.
 * See [Note: adam math]. No product here is followed by a plain addition, so a compiler that
 * contracts a*b + c into an fma on its own (nvcc does by default) has nothing to change. */
static inline ZERO_HD void zero_adam_element(float *p, float *m, float *v, float g, const zero_adam_coeffs *c) {
    if (c->scale_grad) g = zero_div_rn(g, c->grad_scale);
    float param = *p;
    if (c->adamw)
        param = param * c->decay;
    else
        g = fmaf(c->l2, param, g);
    const float mi = fmaf(c->one_minus_beta1, g - *m, *m);
    const float vi = fmaf(c->one_minus_beta2 * g, g, *v * c->beta2);
    const float denom = fmaf(zero_sqrt_rn(vi), c->inv_bc2_sqrt, c->eps);
    *p = param + zero_div_rn(c->neg_step_size * mi, denom);
    *m = mi;
    *v = vi;
}

#endif
