/* The one run-time CPU dispatch of fastcore's C: which vector extensions
 * this CPU (and OS) supports, asked once.
 *
 * Every kernel is compiled for any x86-64 with a GCC/Clang target attribute,
 * so one wheel serves old and new CPUs; the choice between them is made at
 * run time from fc_cpu_features(). SSE2 is the x86-64 baseline and needs no
 * check. __builtin_cpu_supports also checks (via XGETBV) that the OS saves
 * the AVX / AVX-512 register state.
 */
#ifndef FASTCORE_CPU_H
#define FASTCORE_CPU_H

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define FC_X86 1
#else
#define FC_X86 0
#endif

enum {
    FC_CPU_SSSE3 = 1,
    FC_CPU_AVX2 = 2,
    FC_CPU_AVX512VBMI = 4 /* avx512f + avx512bw + avx512vbmi */
};

/* The FC_CPU_* bits this CPU supports. */
static inline unsigned fc_cpu_features(void) {
    unsigned features = 0;
#if FC_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("ssse3")) features |= FC_CPU_SSSE3;
    if (__builtin_cpu_supports("avx2")) features |= FC_CPU_AVX2;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vbmi"))
        features |= FC_CPU_AVX512VBMI;
#endif
    return features;
}

#endif
