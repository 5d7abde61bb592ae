/* Token ids to little-endian int32, for connector/tokenpack.py.
 *
 * vLLM keeps a prompt as a Python list of ints (Request.all_token_ids, a
 * ConstantList over it). struct.pack(*tokens[a:b]) walks it three times (the
 * slice, the argument tuple, the packing); this walks it once. Loaded with
 * ctypes.PyDLL, so the GIL is held throughout. No Python headers are needed to
 * build it: the few C API functions it calls are declared here.
 *
 * mpcache_pack_tokens(seq, start, n, out, direct) writes ids start .. start+n-1
 * of seq into the bytearray out (at least 4*n bytes) and returns how many it
 * wrote: n, or fewer where seq ends early or an id is not an int in [0, 2**31)
 * (the caller then packs that range with struct, which packs or refuses it as it
 * always has). It leaves no Python error set. Two ways to read the ids:
 *
 * - direct (direct != 0; tokenpack.py sets it only on the CPython versions whose
 *   layouts are written below): when seq is a list, or iterates one (its iterator
 *   is a list iterator, as ConstantList's is), the list's item array is read in
 *   place and each exact int's digits are read as the int stores them: no call
 *   per id. Anything else (a bool, an int subclass, a number past int32) ends the
 *   direct walk where it is found.
 * - otherwise the iterator protocol, one id at a time through the C API: any
 *   sequence, any CPython.
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
/* Type objects, compared by address only. */
extern char PyLong_Type[], PyList_Type[], PyListIter_Type[];

/* CPython 3.10/3.11, 64-bit, release build: the heads of a list, a list iterator
 * and an int (30-bit digits in uint32, the sign in ob_size). */
typedef struct {
    ptrdiff_t ob_refcnt;
    void *ob_type;
} Head;
typedef struct {
    Head head;
    ptrdiff_t ob_size;
    PyObject **ob_item;
} ListHead;
typedef struct {
    Head head;
    ptrdiff_t it_index;
    ListHead *it_seq;
} ListIterHead;
typedef struct {
    Head head;
    ptrdiff_t ob_size;
    uint32_t ob_digit[2];
} IntHead;

static ptrdiff_t pack_list(const ListHead *list, ptrdiff_t start, ptrdiff_t n, int32_t *dst) {
    ptrdiff_t have = list->ob_size - start;
    if (have < n)
        n = have < 0 ? 0 : have;
    PyObject *const *items = list->ob_item + start;
    for (ptrdiff_t i = 0; i < n; i++) {
        const IntHead *v = (const IntHead *)items[i];
        if (v->head.ob_type != (void *)PyLong_Type)
            return i;
        if (v->ob_size == 1) {
            dst[i] = (int32_t)v->ob_digit[0];
        } else if (v->ob_size == 0) {
            dst[i] = 0;
        } else if (v->ob_size == 2 && v->ob_digit[1] < 2) { /* 2**30 .. 2**31-1 */
            dst[i] = (int32_t)(v->ob_digit[0] | (v->ob_digit[1] << 30));
        } else {
            return i;
        }
    }
    return n;
}

static ptrdiff_t pack_iterated(PyObject *it, ptrdiff_t start, ptrdiff_t n, int32_t *dst) {
    ptrdiff_t i = -start;
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
    return i < 0 ? 0 : i;
}

/* The list seq is, or iterates (a fresh list iterator, as ConstantList's is); NULL
 * for anything else. */
static const ListHead *list_behind(PyObject *seq, PyObject *it) {
    if (((Head *)seq)->ob_type == (void *)PyList_Type)
        return (const ListHead *)seq;
    const ListIterHead *li = (const ListIterHead *)it;
    if (li->head.ob_type == (void *)PyListIter_Type && li->it_index == 0)
        return li->it_seq; /* NULL once the iterator is exhausted */
    return NULL;
}

ptrdiff_t mpcache_pack_tokens(PyObject *seq, ptrdiff_t start, ptrdiff_t n, PyObject *out,
                              int direct) {
    int32_t *dst = (int32_t *)PyByteArray_AsString(out);
    PyObject *it = dst != NULL ? PyObject_GetIter(seq) : NULL;
    ptrdiff_t done = 0;
    if (it != NULL) {
        const ListHead *list = direct ? list_behind(seq, it) : NULL;
        done = list != NULL ? pack_list(list, start, n, dst) : pack_iterated(it, start, n, dst);
        Py_DecRef(it);
    }
    PyErr_Clear();
    return done;
}
