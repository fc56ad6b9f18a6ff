__global__ void tg_f5(real *__restrict__ v1, real *__restrict__ v3, real *__restrict__ v4, real *__restrict__ v5, real *__restrict__ v6, real *__restrict__ v7, real *__restrict__ v8)
{
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= 20L)
        return;
    const long i0 = (i / 4L) % 5L;
    const long i1 = (i / 1L) % 4L;
    const real t5 = __dadd_rn(v4[i], v1[i1 * 1]);
    v5[i] = t5;
    const real t6 = ((t5 > 0.0) ? t5 : ((t5 != t5) ? t5 : 0.0));
    v6[i] = t6;
    const real t7 = __dsub_rn(t6, v3[i]);
    v7[i] = t7;
    const real t8 = __dmul_rn(t7, t7);
    v8[i] = t8;
}

__global__ void tg_b8(real *__restrict__ v5, real *__restrict__ v7, real *__restrict__ g4, real *__restrict__ g5, real *__restrict__ g6, real *__restrict__ g7, real *__restrict__ g8)
{
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= 20L)
        return;
    g7[i] = __dmul_rn(g8[i], __dmul_rn(2.0, v7[i]));
    g6[i] = g7[i];
    const real g_2 = g6[i];
    g5[i] = ((v5[i] > 0.0) ? g_2 : 0.0);
    g4[i] = g5[i];
}
