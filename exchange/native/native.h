/* exchange._native: the compiled core of tensor-exchange.
 *
 * One extension module built from a few files, one concept each:
 *   module.c   the module, its setup from Python, the registry's counters
 *   capsule.c  DLPack capsules: our deleters and capsule destructor, making, reading
 *              and consuming capsules
 *   registry.c Record: the registry's records, their holders, the live list and the
 *              release of a record no stream used
 *   tensor.c   Tensor storage, the import and export hot paths (from_dlpack,
 *              __dlpack__) and the DLPack C exchange API, consumed and published
 *   copy.c     host copies that stream past the cache (a set's versions)
 *   hostqueue.c a host stream's work queue and its worker's loop
 *   stagetask.c a pipelined chain's task for one plain stage
 *
 * Everything here has a pure-Python twin behind the same API (exchange/_core/_pure/:
 * capsules.py for capsules and counters, records.py, tensors.py); the core seam
 * (exchange/_core/) picks one at import, and its _compiled.py is this module's Python
 * face. Its setup() hooks are given in one place, exchange._core.wire().
 *
 * Threads: every function here runs with the GIL held, so each is one atomic step for
 * other Python threads. Our deleters may be called from any thread, with or without the
 * GIL: they take it themselves, and after interpreter shutdown only free their block.
 */
#ifndef EXCHANGE_NATIVE_H
#define EXCHANGE_NATIVE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* -- DLPack 1.3 (dlpack.h) ---------------------------------------------------------------- */
typedef struct { uint32_t major, minor; } DLPackVersion;
typedef struct { int32_t device_type, device_id; } DLDevice;
typedef struct { uint8_t code, bits; uint16_t lanes; } DLDataType;
typedef struct {
    void *data; DLDevice device; int32_t ndim; DLDataType dtype;
    int64_t *shape; int64_t *strides; uint64_t byte_offset;
} DLTensor;
typedef struct DLManagedTensor {
    DLTensor dl_tensor; void *manager_ctx; void (*deleter)(struct DLManagedTensor *);
} DLManagedTensor;
typedef struct DLManagedTensorVersioned {
    DLPackVersion version; void *manager_ctx;
    void (*deleter)(struct DLManagedTensorVersioned *); uint64_t flags; DLTensor dl_tensor;
} DLManagedTensorVersioned;

#define DLPACK_FLAG_BITMASK_READ_ONLY (1ULL << 0)
#define DLPACK_FLAG_BITMASK_IS_COPIED (1ULL << 1)
#define kDLCPU 1
#define kDLComplex 5 /* DLDataTypeCode */
#define MAX_NDIM 1024 /* exchange/layout.py's MAX_NDIM: beyond it a DLTensor is refused, not read */

typedef struct DLPackExchangeAPIHeader {
    DLPackVersion version;
    struct DLPackExchangeAPIHeader *prev_api;
} DLPackExchangeAPIHeader;
typedef struct {
    DLPackExchangeAPIHeader header;
    int (*managed_tensor_allocator)(DLTensor *, DLManagedTensorVersioned **, void *,
                                    void (*)(void *, const char *, const char *));
    int (*managed_tensor_from_py_object_no_sync)(void *, DLManagedTensorVersioned **);
    int (*managed_tensor_to_py_object_no_sync)(DLManagedTensorVersioned *, void **);
    int (*dltensor_from_py_object_no_sync)(void *, DLTensor *);
    int (*current_work_stream)(int32_t, int32_t, void **);
} DLPackExchangeAPI;

/* -- records (registry.c) ------------------------------------------------------------------ */
enum { LIVE = 0, RELEASING = 1, RELEASED = 2 };
enum { KIND_ALLOCATED = 0, KIND_IMPORTED = 1, KIND_BORROWED = 2 };

/* A holder: our Tensor ("tx.Tensor": desc NULL), an export of ours (its flag bit set:
 * ctx, "DLPack export #ctx"), or anything else the Python side adds (desc, a str).
 * token 0: the slot is free. Further holders go to the record's __dict__["_more"]. */
typedef struct { long long token; union { PyObject *desc; long long ctx; } u; } Holder;
#define INLINE_HOLDERS 2
enum { F_VERSIONED = 1, F_NATIVE = 2, F_EXPORT0 = 4 /* holder i is an export: F_EXPORT0 << i */ };

/* 176 bytes with the GC header: every field earns its place (the bench's record_bytes
 * figure measures it). */
typedef struct RecordObject {
    PyObject_HEAD
    long long id;
    PyObject *device;      /* tx.Device */
    uintptr_t address;     /* lowest byte */
    long long nbytes;
    PyObject *origin;      /* "allocated", "borrowed", or the producer's type name */
    uint8_t kind, state, flags, dev_type;
    int32_t nholders;
    int32_t slot, dev_id;  /* the device's counter slot; the DLPack device id */
    Holder holders[INLINE_HOLDERS];
    union { PyObject *release; void *managed; } rel; /* F_NATIVE: call managed->deleter once */
    PyObject *owner;       /* kept alive until the release (a producer's object, a backend's block) */
    PyObject *dict;        /* label, where, _views, immutable, _streams {id: stream}, _more {token: holder} */
    PyObject *weaklist;
    struct RecordObject *prev, *next; /* the live list (it holds a reference) */
} RecordObject;

extern PyTypeObject RecordBase_Type;
#define Record_Check(op) PyObject_TypeCheck(op, &RecordBase_Type)

RecordObject *record_new(PyObject *device, Py_ssize_t slot, int32_t dev_type, int32_t dev_id, uintptr_t address,
                         long long nbytes, PyObject *origin, int kind, PyObject *release, void *managed, int versioned,
                         PyObject *owner, long long *token_out);
long long record_add_holder(RecordObject *r, long long ctx, PyObject *desc); /* -1 with an error set */
int record_remove_holder(RecordObject *r, long long token);                /* never fails; 0 */
void record_gone(RecordObject *r);
int registry_types_ready(PyObject *module);
PyObject *record_heap_type(void); /* the public Record class (see module.c's make_type) */
extern PyMethodDef registry_methods[];

/* -- tensors (tensor.c) -------------------------------------------------------------------- */
typedef struct {
    PyObject_VAR_HEAD      /* ob_size: ndim */
    RecordObject *record;
    uintptr_t data_ptr;    /* address of element 0 */
    PyObject *dtype;       /* tx.DType */
    PyObject *stream;      /* the stream the data is ordered on, or NULL (the default) */
    long long token;       /* our holder of the record; 0 once released or closed */
    uint8_t readonly;      /* 0 writable, 1 READ_ONLY, 2 came in through a legacy capsule */
    uint8_t closed;        /* a borrowed view whose scope ended */
    uint8_t code, bits;    /* the DLPack dtype, for exports */
    PyObject *weaklist;
    int64_t dims[1];       /* shape[ndim], then strides[ndim] (in elements) */
} TensorObject;

extern PyTypeObject TensorBase_Type;
PyObject *tensor_new(RecordObject *record, long long token, uintptr_t data_ptr, int ndim, const int64_t *shape,
                     const int64_t *strides, PyObject *dtype, int code, int bits, int readonly, PyObject *stream);
int tensor_add_stream(RecordObject *record, PyObject *stream);
PyObject *record_streams(RecordObject *r); /* borrowed: the {id: stream} dict, or NULL */
int tensor_types_ready(PyObject *module);
PyObject *tensor_heap_type(void); /* the public Tensor class */
PyObject *stage_hop(PyObject *template, TensorObject *t);       /* (template, t's nbytes) */
PyObject *stage_call(PyObject *const *args, Py_ssize_t index); /* call_stage's work, checked */
extern PyMethodDef tensor_methods[];

/* -- capsules (capsule.c) ------------------------------------------------------------------ */
/* Our export block: the managed struct, then this trailer, then shape and strides. */
typedef struct { RecordObject *record; long long token; } ExportTrailer;
PyObject *export_capsule(RecordObject *record, uintptr_t data, int32_t device_type, int32_t device_id,
                         int code, int bits, int ndim, const int64_t *shape, const int64_t *strides,
                         int versioned, unsigned long long flags);
int fill_i64s(PyObject *seq, int64_t *out, Py_ssize_t n, const char *what);
DLManagedTensorVersioned *export_managed(RecordObject *record, uintptr_t data, int32_t device_type,
                                         int32_t device_id, int code, int bits, int ndim, const int64_t *shape,
                                         const int64_t *strides, unsigned long long flags);
PyObject *consume_managed(void *managed, int versioned, PyObject *capsule, PyObject *producer, PyObject *owner,
                          PyObject *stream);
PyObject *consume_capsule(PyObject *capsule, PyObject *producer, PyObject *owner, PyObject *stream);
void call_managed_deleter(void *managed, int versioned);
extern PyMethodDef capsule_methods[];
extern PyMethodDef copy_methods[]; /* copy.c */
int hostqueue_type_ready(PyObject *module); /* hostqueue.c: exchange._native.HostQueue */
extern PyMethodDef stagetask_methods[];    /* stagetask.c: a pipelined chain's plain stage task */
int stagetask_type_ready(void);

/* -- module state (module.c) --------------------------------------------------------------- */
typedef struct {
    /* set by setup() from Python */
    PyObject *tensor_type;      /* exchange.tensor.Tensor (a subclass of TensorBase) */
    PyObject *record_type;      /* exchange.registry.Record (a subclass of RecordBase) */
    PyObject *begin_release;    /* registry._begin_release(record, [streams]) */
    PyObject *warn;             /* registry._warn(message) */
    PyObject *note_tracked;     /* registry._note_tracked_record(record) */
    PyObject *note_gone;        /* while tx.trace records: its note of a record leaving the live set */
    PyObject *where;            /* registry._where(): the creation stack, EXCHANGE_DEBUG=1 */
    PyObject *slow_from_dlpack; /* tensor._from_dlpack(x, *, device, copy, stream) */
    PyObject *validate_device;  /* capsule._device(device_type, device_id) -> Device, BufferError */
    PyObject *str_slot;         /* "_slot" */
    PyObject *str_streams;      /* "_streams" */
    PyObject *str_more;         /* "_more" */
    PyObject *validate_dtype;   /* dtypes.from_dlpack_code(code, bits, 1) -> DType, BufferError */
    PyObject *lifetime_error;   /* tx.LifetimeError */
    PyObject *cpu;              /* tx.Device("cpu") */
    PyObject *cpu_dlpack_device; /* (DeviceType.kDLCPU, 0): the CPU's __dlpack_device__, made once */
    PyObject *allocate;         /* tensor._allocate_for_api(device_type, device_id, code, bits, shape) */
    PyObject *adopt_device;     /* tensor._adopt_device(tensor, producer's current stream handle) */
    Py_ssize_t cpu_slot;        /* the CPU's counter slot */
    PyObject *call_deleter;     /* this module's call_deleter (for Record._release) */
    PyObject *str_tensor;       /* "tx.Tensor" */
    PyObject *str_dlpack;       /* "__dlpack__" */
    PyObject *str_exchange_api; /* "__dlpack_c_exchange_api__" */
    PyObject *kw_max_version;   /* ("max_version",) */
    PyObject *max_version;      /* (1, 3) */
    PyObject *ndarray_type;     /* numpy.ndarray, once seen (CPU-only by type) */
    PyObject *ndarray_name;     /* "numpy.ndarray" */
    PyObject *api_cache;        /* {type: capsule or None}: each type's exchange API, looked up once */
    int debug, tracking, finalizing;
    /* counters */
    long long next_id, next_token, next_export;
    long long released, imports, imports_gone, exports;
    Py_ssize_t live;
    RecordObject *head, *tail;  /* the live list, oldest first */
} NativeState;

extern NativeState S;
void bytes_add(Py_ssize_t slot, long long delta);
Py_ssize_t device_slot(PyObject *device);   /* -1 with an error set */
void warn_message(const char *message);     /* through registry._warn; never raises */

#endif
