/* exchange._native: host copies that stream past the cache (copy_streaming).
 *
 * A version of a tensor set is written once here and read by other processes. A copy
 * with ordinary stores first reads each destination line into this core's cache
 * (write-allocate), then evicts it again: half again the memory traffic of the copy.
 * glibc's memcpy switches to non-temporal stores only above a threshold near the size
 * of the shared cache (24 MiB on a 32 MiB L3), which a state dict's tensors of a few
 * MiB each stay under: 256 copies of 4 MiB took 1.6 times one copy of 1 GiB here. From
 * STREAM_FROM bytes on, this copy stores around the cache (SSE2, every x86-64 has it);
 * below that, and on other machines, it is memcpy. The bytes written are the same. */
#include "native.h"

#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define HAVE_STREAMING_STORES 1
#endif

/* Bytes from which a copy streams: below, the destination fits in the caches and an
 * ordinary copy is as fast (and leaves the bytes cached for whoever reads them here). */
#define STREAM_FROM ((size_t)1 << 20)

static void copy_bytes(char *dst, const char *src, size_t n) {
#ifdef HAVE_STREAMING_STORES
    if (n >= STREAM_FROM) {
        size_t head = (size_t)(-(uintptr_t)dst & 15); /* streaming stores need 16-byte aligned addresses */
        memcpy(dst, src, head);
        dst += head;
        src += head;
        n -= head;
        for (; n >= 64; n -= 64, dst += 64, src += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)src);
            __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
            _mm_stream_si128((__m128i *)dst, a);
            _mm_stream_si128((__m128i *)(dst + 16), b);
            _mm_stream_si128((__m128i *)(dst + 32), c);
            _mm_stream_si128((__m128i *)(dst + 48), d);
        }
        _mm_sfence(); /* the streamed stores are visible before anyone is told of them */
    }
#endif
    memcpy(dst, src, n);
}

/* copy_streaming(dst, src, nbytes): copy nbytes bytes from address src to address dst
 * (the ranges must not overlap), without the GIL. */
static PyObject *py_copy_streaming(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "copy_streaming(dst, src, nbytes) takes 3 arguments");
        return NULL;
    }
    char *dst = (char *)PyLong_AsVoidPtr(args[0]);
    if (dst == NULL && PyErr_Occurred()) return NULL;
    const char *src = (const char *)PyLong_AsVoidPtr(args[1]);
    if (src == NULL && PyErr_Occurred()) return NULL;
    Py_ssize_t n = PyLong_AsSsize_t(args[2]);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < 0) {
        PyErr_Format(PyExc_ValueError, "copy_streaming: nbytes must be >= 0, got %zd", n);
        return NULL;
    }
    if (n > 0 && (dst == NULL || src == NULL)) {
        PyErr_SetString(PyExc_ValueError, "copy_streaming: a null address");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    copy_bytes(dst, src, (size_t)n);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyMethodDef copy_methods[] = {
    {"copy_streaming", (PyCFunction)(void (*)(void))py_copy_streaming, METH_FASTCALL,
     "Copy nbytes bytes from src to dst (addresses; not overlapping), large copies past the cache."},
    {NULL, NULL, 0, NULL},
};
