/* tapegrad.emit.c_grad: returns t22; p[0] = node 0; p[1] = node 1; p[2] = node 2; p[3] = node 3. */
/* Every + - * / is a round-to-nearest intrinsic, so no FMA contraction changes the result. */

__device__ double grad(const double *p, double *g, const double *v)
{
    double t0 = p[0];
    double t1 = p[1];
    double t2 = p[2];
    double t3 = p[3];
    double t4 = v[0];
    double t5 = v[1];
    double t6 = v[2];
    double t7 = v[3];
    double t8 = __dmul_rn(t0, t4);
    double t9 = __dmul_rn(t1, t5);
    double t10 = __dadd_rn(t8, t9);
    double t11 = __dmul_rn(t2, t6);
    double t12 = __dadd_rn(t10, t11);
    double t13 = __dadd_rn(t12, t3);
    double t14 = (t13 > 0.0 ? t13 : (t13 != t13 ? t13 : 0.0));
    double t15 = __dmul_rn(t13, t7);
    double t16 = __dsub_rn(t14, t15);
    double t17 = fabs(t13);
    double t18 = -t17;
    double t19 = exp(t18);
    double t20 = __dadd_rn(t19, 1.0);
    double t21 = log(t20);
    double t22 = __dadd_rn(t16, t21);

    double g22 = 1.0;
    double g16 = g22;
    double g21 = g22;
    double g20 = __ddiv_rn(g21, t20);
    double g19 = g20;
    double g18 = __dmul_rn(g19, t19);
    double g17 = -g18;
    double g13 = __dmul_rn(g17, (t13 > 0.0 ? 1.0 : (t13 < 0.0 ? -1.0 : (t13 == 0.0 ? 0.0 : t13))));
    double g14 = g16;
    double g15 = -g16;
    g13 = __dadd_rn(g13, __dmul_rn(g15, t7));
    g13 = __dadd_rn(g13, (t13 > 0.0 ? g14 : 0.0));
    double g12 = g13;
    double g3 = g13;
    double g10 = g12;
    double g11 = g12;
    double g2 = __dmul_rn(g11, t6);
    double g8 = g10;
    double g9 = g10;
    double g1 = __dmul_rn(g9, t5);
    double g0 = __dmul_rn(g8, t4);

    g[0] = __dadd_rn(g[0], g0);
    g[1] = __dadd_rn(g[1], g1);
    g[2] = __dadd_rn(g[2], g2);
    g[3] = __dadd_rn(g[3], g3);
    return t22;
}
