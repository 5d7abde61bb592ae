/* Block copies with streaming (non-temporal) stores, for dataplane/blockcopy.py.
 *
 * mpcache_copy_blocks copies n blocks of nbytes each, block i from src[i] to dst[i]
 * (addresses). A cached store reads every destination line before writing it
 * (read-for-ownership); a streaming store does not, so a copy moves two bytes of
 * memory traffic per byte instead of three. glibc streams only copies above its
 * non-temporal threshold, and a vLLM block is 32 KiB, so scattered blocks never
 * stream through memcpy. The next source lines are prefetched, across the end of a
 * block into the next one, since consecutive blocks are not adjacent.
 *
 * Blocks whose addresses are not 16-byte aligned, or whose size is not a multiple
 * of 64, go through memcpy. SSE2 only: every x86-64 CPU has it.
 */
#include <emmintrin.h>
#include <stdint.h>
#include <string.h>
#include <xmmintrin.h>

#define PREFETCH_AHEAD 1024

static void stream_block(char *dst, const char *src, int64_t nbytes, const char *next) {
    for (int64_t i = 0; i < nbytes; i += 64) {
        int64_t ahead = i + PREFETCH_AHEAD;
        if (ahead < nbytes)
            _mm_prefetch(src + ahead, _MM_HINT_NTA);
        else if (next != 0)
            _mm_prefetch(next + (ahead - nbytes), _MM_HINT_NTA);
        __m128i a = _mm_load_si128((const __m128i *)(src + i));
        __m128i b = _mm_load_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_load_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_load_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
}

void mpcache_copy_blocks(const int64_t *src, const int64_t *dst, int64_t n, int64_t nbytes) {
    for (int64_t i = 0; i < n; i++) {
        char *d = (char *)(intptr_t)dst[i];
        const char *s = (const char *)(intptr_t)src[i];
        if ((((uintptr_t)d | (uintptr_t)s) & 15) != 0 || (nbytes & 63) != 0) {
            memcpy(d, s, (size_t)nbytes);
            continue;
        }
        const char *next = i + 1 < n ? (const char *)(intptr_t)src[i + 1] : 0;
        stream_block(d, s, nbytes, next);
    }
    _mm_sfence(); /* streaming stores are weakly ordered: drain them before returning */
}
