/* A lookup's chunk keys in one call, for app/keychain.py.
 *
 * key_i = XXH3-128(key_{i-1} || bytes of chunk i, seed), key_{-1} = first, each
 * the canonical 16 bytes (high half, then low, big-endian) that
 * xxhash.xxh3_128_digest returns: the chain app/hashing.py computes in Python.
 * The hash is python-xxhash's own XXH3_128bits_withSeed, passed in by address, so
 * the keys come from the code the Python path calls; this file saves the
 * interpreter's work per chunk (a slice, a concatenation, a call, an append).
 *
 * Loaded with ctypes.PyDLL (the GIL is held): it reads data through the buffer
 * protocol and returns a new list of n bytes objects, or NULL with a Python error
 * set. Only exported C API functions are called, declared here (no Python
 * headers needed); Py_buffer is the documented, stable struct.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct _object PyObject;
typedef struct {
    void *buf;
    PyObject *obj;
    ptrdiff_t len;
    ptrdiff_t itemsize;
    int readonly;
    int ndim;
    char *format;
    ptrdiff_t *shape;
    ptrdiff_t *strides;
    ptrdiff_t *suboffsets;
    void *internal;
} Py_buffer;
extern int PyObject_GetBuffer(PyObject *, Py_buffer *, int);
extern void PyBuffer_Release(Py_buffer *);
extern PyObject *PyList_New(ptrdiff_t);
extern int PyList_SetItem(PyObject *, ptrdiff_t, PyObject *);
extern PyObject *PyBytes_FromStringAndSize(const char *, ptrdiff_t);
extern void Py_DecRef(PyObject *);
extern void PyErr_SetString(PyObject *, const char *);
extern PyObject *PyErr_NoMemory(void);
extern PyObject *PyExc_ValueError;

typedef struct {
    uint64_t low64;
    uint64_t high64;
} Hash128; /* XXH128_hash_t */

typedef Hash128 (*Xxh3With128Seed)(const void *data, size_t len, uint64_t seed);

static void put_be64(uint8_t *p, uint64_t v) {
    for (int i = 7; i >= 0; i--) {
        p[i] = (uint8_t)v;
        v >>= 8;
    }
}

/* Keys of chunks start .. start+n-1 of data (chunk_bytes each), the chain going on
 * from first (16 bytes). */
PyObject *mpcache_key_chain(void *xxh3_128_with_seed, uint64_t seed, const uint8_t *first,
                            PyObject *data, ptrdiff_t chunk_bytes, ptrdiff_t start,
                            ptrdiff_t n) {
    Xxh3With128Seed hash = (Xxh3With128Seed)xxh3_128_with_seed;
    Py_buffer view;
    if (chunk_bytes < 1 || start < 0 || n < 0) {
        PyErr_SetString(PyExc_ValueError, "chunk_bytes >= 1, start >= 0 and n >= 0");
        return NULL;
    }
    if (PyObject_GetBuffer(data, &view, 0) != 0) /* PyBUF_SIMPLE: contiguous bytes */
        return NULL;
    PyObject *keys = NULL;
    uint8_t *scratch = NULL;
    if ((start + n) * chunk_bytes > view.len) {
        PyErr_SetString(PyExc_ValueError, "the chunks run past the end of the data");
        goto done;
    }
    scratch = malloc(16 + (size_t)chunk_bytes);
    if (scratch == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    keys = PyList_New(n);
    if (keys == NULL)
        goto done;
    const uint8_t *src = (const uint8_t *)view.buf + start * chunk_bytes;
    uint8_t key[16];
    memcpy(key, first, 16);
    for (ptrdiff_t i = 0; i < n; i++) {
        memcpy(scratch, key, 16);
        memcpy(scratch + 16, src + i * chunk_bytes, (size_t)chunk_bytes);
        Hash128 h = hash(scratch, 16 + (size_t)chunk_bytes, seed);
        put_be64(key, h.high64);
        put_be64(key + 8, h.low64);
        PyObject *item = PyBytes_FromStringAndSize((const char *)key, 16);
        if (item == NULL) {
            Py_DecRef(keys);
            keys = NULL;
            goto done;
        }
        PyList_SetItem(keys, i, item); /* steals item */
    }
done:
    free(scratch);
    PyBuffer_Release(&view);
    return keys;
}
