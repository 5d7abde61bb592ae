/* Token ids to little-endian int32, for connector/tokenpack.py.
 *
 * vLLM keeps a prompt as a Python list of ints. struct.pack(*tokens[a:b]) walks it
 * three times (the slice, the argument tuple, the packing); this walks it once,
 * through the iterator protocol, so any sequence works (vLLM's ConstantList, a
 * list, a tuple) and nothing is assumed about how CPython lays out its objects:
 * only functions of its C API are called, declared here since no Python headers
 * are needed to build it. Loaded with ctypes.PyDLL, so the GIL is held.
 *
 * mpcache_pack_tokens writes ids start .. start+n-1 of seq into the bytearray out
 * (at least 4*n bytes) and returns how many it wrote: n, or fewer where seq ends
 * early or an id is not an int in [0, 2**31) (the caller then packs that range
 * with struct, which packs or refuses it as it always has). It leaves no Python
 * error set.
 */
#include <stddef.h>
#include <stdint.h>

typedef struct _object PyObject;
extern PyObject *PyObject_GetIter(PyObject *);
extern PyObject *PyIter_Next(PyObject *);
extern long PyLong_AsLong(PyObject *);
extern void Py_DecRef(PyObject *);
extern char *PyByteArray_AsString(PyObject *);
extern void PyErr_Clear(void);

ptrdiff_t mpcache_pack_tokens(PyObject *seq, ptrdiff_t start, ptrdiff_t n, PyObject *out) {
    int32_t *dst = (int32_t *)PyByteArray_AsString(out);
    PyObject *it = dst ? PyObject_GetIter(seq) : NULL;
    ptrdiff_t i = -start;
    if (it != NULL) {
        while (i < n) {
            PyObject *item = PyIter_Next(it);
            if (item == NULL)
                break;
            if (i >= 0) {
                long v = PyLong_AsLong(item);
                if (v < 0 || v > INT32_MAX) {
                    Py_DecRef(item);
                    break;
                }
                dst[i] = (int32_t)v;
            }
            Py_DecRef(item);
            i++;
        }
        Py_DecRef(it);
    }
    PyErr_Clear();
    return i < 0 ? 0 : i;
}
