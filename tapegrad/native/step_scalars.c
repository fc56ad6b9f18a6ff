/* Adam's per-step host scalars in C: optim.Adam.step_scalars(count), operation for operation with the
 * same libm pow (Python's float ** int calls it too), so every backend that computes them here -- the
 * native runtime's optimizer step and the GPU custom call (interop/xla/tg_gpu.c) -- gets the very bits the
 * tape uses. s = [-lr, 1 - b1^t, 1 - b2^t] (eps_mode "optax"), or [lr * sqrt(1 - b2^t) / (1 - b1^t)]
 * (eps_mode "hat"). */
#include <math.h>

static void tg_adam_scalars(double lr, double b1, double b2, int hat, double count, double *s)
{
    double bc1 = 1.0 - pow(b1, count), bc2 = 1.0 - pow(b2, count);
    if (!hat) {
        s[0] = -lr;
        s[1] = bc1;
        s[2] = bc2;
    } else {
        s[0] = lr * sqrt(bc2) / bc1;
    }
}
