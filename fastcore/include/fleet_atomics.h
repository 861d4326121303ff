/* The fleet's shared mapping (server/orchestrator/_fleet.pyx): sequentially consistent GCC atomics
 * on 64-bit words that several orchestrator processes map at once (--workers N). Every operation is
 * one word's load, store, exchange or compare-exchange: no lock is held across words, so a process
 * killed at any instruction leaves no lock behind (its slot count is cleared by the parent). */
#ifndef FASTCORE_FLEET_ATOMICS_H
#define FASTCORE_FLEET_ATOMICS_H

#include <stdint.h>

static inline int64_t fc_load(int64_t *p) { return __atomic_load_n(p, __ATOMIC_SEQ_CST); }

static inline int64_t fc_fetch_add(int64_t *p, int64_t v) {
    return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}

static inline int64_t fc_exchange(int64_t *p, int64_t v) {
    return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST);
}

/* 1 when *p was *expected and is now desired; else 0 and *expected is what *p holds */
static inline int fc_cas(int64_t *p, int64_t *expected, int64_t desired) {
    return __atomic_compare_exchange_n(p, expected, desired, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
}

#endif
