/* exchange._native.plain_task: a pipelined chain's task for a stream that runs one plain
 * stage (exchange/chain_pipeline.py's plain_task, which makes it and whose task it runs
 * wherever a batch leaves the path below; the pure twin gives that task back as it is).
 *
 * Why in C: the task runs per stage and batch on the stage's own worker thread, where
 * each Python frame, attribute lookup and call costs about twice what it does inline, and
 * in a GIL-bound pipeline every microsecond the worker holds the GIL is one the next
 * stage's worker may wait for.
 *
 * The path taken here is the Python task's own, step for step: for a batch of the chain's
 * slot type that is one tensor with no producer's pointers to compare (kind "one", ptrs
 * None), take(tensor), the hop and the stage's call and time (call_stage), give(raw) (a
 * tuple, list or dict goes to regroup(slot, raw)), the output in the batch's list (with
 * the shared hop out of the last stage), then post(context, then, slot) (False:
 * refuse(slot) raises why) or, at the last stage, done.release(). An error at any step
 * goes to fail(slot, step, exc, raw), which wraps it as the Python task does and ends the
 * batch. Anything else (another kind of batch, a subclass, a missing field) runs the
 * Python task itself. The slot's fields are read at the offsets of its type's __slots__
 * descriptors, checked once when the task is made. */
#include "native.h"

#include <structmember.h>

enum { STEP_TAKE, STEP_CALL, STEP_GIVE, STEP_AS_IS }; /* chain_pipeline.py's _TAKE.._AS_IS */
enum { F_KIND, F_VALUES, F_PTRS, F_HOPS, F_DONE, N_FIELDS };
static const char *field_names[N_FIELDS] = {"kind", "values", "ptrs", "hops", "done"};

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyTypeObject *slot_type;
    Py_ssize_t offsets[N_FIELDS];
    PyObject *take, *fn, *give, *shared_in, *shared_out; /* shared_out: None but at the last stage */
    PyObject *acc;                                        /* the stream's list of milliseconds per stage */
    Py_ssize_t index;
    PyObject *then, *post, *context; /* then None: the last stage */
    PyObject *slow, *fail, *regroup, *refuse;
} PlainTaskObject;

static PyTypeObject PlainTask_Type; /* below */
static PyObject *str_one, *str_release, *str_class;
static PyObject *groups, *object_class; /* (dict, tuple, list), as chain_pipeline.py's _GROUPS; object.__class__ */

/* isinstance(raw, (dict, tuple, list)), as the Python task asks it. isinstance also
 * believes an object's __class__ (a proxy's, which names the class of what it wraps):
 * where its type could answer with a __class__ of its own (its own attribute lookup, or
 * a __class__ other than object's) the whole isinstance is asked; else the type check
 * is the answer. -1 with the error set where isinstance raised. */
static int is_group(PyObject *raw) {
    if (PyTuple_Check(raw) || PyList_Check(raw) || PyDict_Check(raw)) return 1;
    PyTypeObject *tp = Py_TYPE(raw);
    if (tp->tp_getattro == PyObject_GenericGetAttr && _PyType_Lookup(tp, str_class) == object_class) return 0;
    return PyObject_IsInstance(raw, groups);
}

static PyObject *field(PlainTaskObject *task, PyObject *slot, int f) {
    return *(PyObject **)((char *)slot + task->offsets[f]); /* borrowed; NULL: unset */
}

/* fail(slot, step, exc, raw) for the error set now; NULL only where fail itself raised. */
static PyObject *failed(PlainTaskObject *task, PyObject *slot, int step, PyObject *raw) {
    PyObject *type, *exc, *tb;
    PyErr_Fetch(&type, &exc, &tb);
    PyErr_NormalizeException(&type, &exc, &tb);
    if (exc == NULL) { /* only with no error set: say so rather than end the batch with None */
        PyErr_SetString(PyExc_SystemError, "plain_task: a step failed with no exception set");
        PyErr_Fetch(&type, &exc, &tb);
    }
    if (tb != NULL) PyException_SetTraceback(exc, tb);
    PyObject *stepobj = PyLong_FromLong(step);
    PyObject *r = stepobj ? PyObject_CallFunctionObjArgs(task->fail, slot, stepobj, exc, raw ? raw : Py_None, NULL)
                          : NULL;
    Py_XDECREF(stepobj);
    Py_XDECREF(type);
    Py_XDECREF(exc);
    Py_XDECREF(tb);
    return r;
}

/* take, call (hop and time noted), give: the stage's output in values[0], or the group
 * regrouped. 0, or -1 with *step saying where it failed and *raw what the stage returned
 * (a new reference, or NULL). */
static int run_stage(PlainTaskObject *task, PyObject *slot, PyObject *values, PyObject *hops, int *step,
                     PyObject **raw) {
    PyObject *t = Py_NewRef(PyList_GET_ITEM(values, 0));
    *step = STEP_TAKE;
    PyObject *a = PyObject_CallOneArg(task->take, t);
    if (a == NULL) {
        Py_DECREF(t);
        return -1;
    }
    *step = STEP_CALL;
    PyObject *args[7] = {task->fn, a, t, hops, task->shared_in, task->acc, NULL};
    *raw = stage_call(args, task->index);
    Py_DECREF(a);
    Py_DECREF(t);
    if (*raw == NULL) return -1;
    *step = STEP_AS_IS; /* is_group's error is not the stage's call failing (as in the Python task) */
    int group = is_group(*raw);
    if (group < 0) return -1;
    if (group) {
        PyObject *r = PyObject_CallFunctionObjArgs(task->regroup, slot, *raw, NULL);
        Py_XDECREF(r);
        return r == NULL ? -1 : 0;
    }
    *step = STEP_GIVE;
    PyObject *out = PyObject_CallOneArg(task->give, *raw);
    if (out == NULL) return -1;
    *step = STEP_AS_IS;
    if (task->shared_out != Py_None) { /* the last stage: the shared hop out of it */
        if (!PyObject_TypeCheck(out, &TensorBase_Type)) {
            Py_DECREF(out);
            PyErr_SetString(PyExc_TypeError, "plain_task: give() must return a tx.Tensor");
            return -1;
        }
        PyObject *hop = stage_hop(task->shared_out, (TensorObject *)out);
        int appended = hop ? PyList_Append(hops, hop) : -1;
        Py_XDECREF(hop);
        if (appended < 0) {
            Py_DECREF(out);
            return -1;
        }
    }
    /* values is the slot's own list, still of one item: the take and give ran no Python of
     * the batch's, but fn did (it may have changed the list: then the output goes where
     * the Python task's slot.values[0] = out would put it, or raises as it would) */
    if (PyList_GET_SIZE(values) < 1) {
        Py_DECREF(out);
        PyErr_SetString(PyExc_IndexError, "list assignment index out of range");
        return -1;
    }
    PyList_SetItem(values, 0, out); /* steals out */
    return 0;
}

static PyObject *PlainTask_vectorcall(PlainTaskObject *task, PyObject *const *args, size_t nargsf, PyObject *kw) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs != 1 || kw != NULL) {
        PyErr_SetString(PyExc_TypeError, "a chain's task takes one batch");
        return NULL;
    }
    PyObject *slot = args[0];
    if (Py_TYPE(slot) != task->slot_type) return PyObject_CallOneArg(task->slow, slot);
    PyObject *kind = field(task, slot, F_KIND), *values = field(task, slot, F_VALUES);
    PyObject *ptrs = field(task, slot, F_PTRS), *hops = field(task, slot, F_HOPS);
    if (kind != str_one || ptrs != Py_None || values == NULL || !PyList_CheckExact(values) ||
        PyList_GET_SIZE(values) < 1 || !PyObject_TypeCheck(PyList_GET_ITEM(values, 0), &TensorBase_Type) ||
        hops == NULL || !PyList_CheckExact(hops) || field(task, slot, F_DONE) == NULL)
        return PyObject_CallOneArg(task->slow, slot); /* the Python task: it says what is wrong */
    Py_INCREF(slot); /* the batch stays ours until it is handed on or done */
    Py_INCREF(values);
    Py_INCREF(hops);
    int step = STEP_AS_IS;
    PyObject *raw = NULL, *result = NULL;
    int ok = run_stage(task, slot, values, hops, &step, &raw) == 0;
    Py_DECREF(values);
    Py_DECREF(hops);
    if (ok) {
        Py_CLEAR(raw); /* nothing of the batch stays here once it is handed on */
        if (task->then != Py_None) {
            PyObject *pargs[3] = {task->context, task->then, slot};
            PyObject *posted = PyObject_Vectorcall(task->post, pargs, 3, NULL);
            int taken = posted == NULL ? -1 : PyObject_IsTrue(posted);
            Py_XDECREF(posted);
            if (taken == 0) {
                PyObject *r = PyObject_CallOneArg(task->refuse, slot); /* raises why */
                Py_XDECREF(r);
                if (r != NULL) PyErr_SetString(PyExc_RuntimeError, "a host stream of this chain refused a batch");
                taken = -1;
            }
            if (taken > 0) {
                Py_DECREF(slot);
                Py_RETURN_NONE;
            }
            step = STEP_AS_IS;
        } else {
            PyObject *done = field(task, slot, F_DONE); /* read now, as the Python task reads slot.done */
            if (done == NULL) {
                Py_DECREF(slot);
                PyErr_SetString(PyExc_AttributeError, "done");
                return NULL;
            }
            Py_INCREF(done);
            result = PyObject_CallMethodNoArgs(done, str_release); /* as the Python task: not an error of the batch's */
            Py_DECREF(done);
            Py_DECREF(slot);
            if (result == NULL) return NULL;
            Py_DECREF(result);
            Py_RETURN_NONE;
        }
    }
    result = failed(task, slot, step, raw);
    Py_XDECREF(raw);
    Py_DECREF(slot);
    return result;
}

static int offset_of(PyTypeObject *type, const char *name, Py_ssize_t *offset) {
    PyObject *d = PyObject_GetAttrString((PyObject *)type, name);
    if (d == NULL) PyErr_Clear();
    int ok = d != NULL && Py_IS_TYPE(d, &PyMemberDescr_Type) &&
             ((PyMemberDescrObject *)d)->d_member->type == T_OBJECT_EX;
    if (ok) *offset = ((PyMemberDescrObject *)d)->d_member->offset;
    Py_XDECREF(d);
    if (!ok) PyErr_Format(PyExc_TypeError, "plain_task: %s.%s must be a __slots__ field", type->tp_name, name);
    return ok ? 0 : -1;
}

/* plain_task(slot_type, take, fn, give, shared_in, shared_out, acc, index, then, post,
 * context, slow, fail, regroup, refuse) -> the task */
static PyObject *py_plain_task(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 15) {
        PyErr_SetString(PyExc_TypeError, "plain_task takes 15 arguments (see exchange/chain_pipeline.py)");
        return NULL;
    }
    if (!PyType_Check(args[0]) || !PyList_CheckExact(args[6]) || !PyContext_CheckExact(args[10])) {
        PyErr_SetString(PyExc_TypeError, "plain_task: a slot type, an acc list and a contextvars.Context");
        return NULL;
    }
    if (!PyLong_Check(args[7])) {
        PyErr_Format(PyExc_TypeError, "plain_task: index must be an int, not %s", Py_TYPE(args[7])->tp_name);
        return NULL;
    }
    Py_ssize_t index = PyLong_AsSsize_t(args[7]);
    if (index == -1 && PyErr_Occurred()) return NULL;
    if (index < 0 || index >= PyList_GET_SIZE(args[6])) {
        PyErr_SetString(PyExc_IndexError, "plain_task: index out of range of acc");
        return NULL;
    }
    for (int i = 1; i < 15; i++) {
        int callable_needed = i == 1 || i == 2 || i == 3 || (i >= 11);
        if (callable_needed && !PyCallable_Check(args[i])) {
            PyErr_Format(PyExc_TypeError, "plain_task: argument %d must be callable", i);
            return NULL;
        }
    }
    if (args[8] != Py_None && !PyCallable_Check(args[9])) {
        PyErr_SetString(PyExc_TypeError, "plain_task: a task handed on needs a callable post");
        return NULL;
    }
    PlainTaskObject *task = PyObject_GC_New(PlainTaskObject, &PlainTask_Type);
    if (task == NULL) return NULL;
    task->vectorcall = (vectorcallfunc)PlainTask_vectorcall;
    task->slot_type = (PyTypeObject *)Py_NewRef(args[0]);
    PyObject **refs[] = {&task->take, &task->fn, &task->give, &task->shared_in, &task->shared_out, &task->acc};
    for (int i = 0; i < 6; i++) *refs[i] = Py_NewRef(args[1 + i]);
    task->index = index;
    PyObject **rest[] = {&task->then, &task->post, &task->context, &task->slow, &task->fail, &task->regroup,
                         &task->refuse};
    for (int i = 0; i < 7; i++) *rest[i] = Py_NewRef(args[8 + i]);
    PyObject_GC_Track(task);
    for (int f = 0; f < N_FIELDS; f++) {
        if (offset_of(task->slot_type, field_names[f], &task->offsets[f]) < 0) {
            Py_DECREF(task);
            return NULL;
        }
    }
    return (PyObject *)task;
}

static int PlainTask_traverse(PlainTaskObject *task, visitproc visit, void *arg) {
    Py_VISIT(task->slot_type);
    Py_VISIT(task->take);
    Py_VISIT(task->fn);
    Py_VISIT(task->give);
    Py_VISIT(task->shared_in);
    Py_VISIT(task->shared_out);
    Py_VISIT(task->acc);
    Py_VISIT(task->then);
    Py_VISIT(task->post);
    Py_VISIT(task->context);
    Py_VISIT(task->slow);
    Py_VISIT(task->fail);
    Py_VISIT(task->regroup);
    Py_VISIT(task->refuse);
    return 0;
}

static int PlainTask_clear(PlainTaskObject *task) {
    Py_CLEAR(task->slot_type);
    Py_CLEAR(task->take);
    Py_CLEAR(task->fn);
    Py_CLEAR(task->give);
    Py_CLEAR(task->shared_in);
    Py_CLEAR(task->shared_out);
    Py_CLEAR(task->acc);
    Py_CLEAR(task->then);
    Py_CLEAR(task->post);
    Py_CLEAR(task->context);
    Py_CLEAR(task->slow);
    Py_CLEAR(task->fail);
    Py_CLEAR(task->regroup);
    Py_CLEAR(task->refuse);
    return 0;
}

static void PlainTask_dealloc(PlainTaskObject *task) {
    PyObject_GC_UnTrack(task);
    PlainTask_clear(task);
    PyObject_GC_Del(task);
}

static PyTypeObject PlainTask_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "exchange._native.PlainTask",
    .tp_basicsize = sizeof(PlainTaskObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "A pipelined chain's task for one plain stage (exchange/chain_pipeline.py's plain_task).",
    .tp_vectorcall_offset = offsetof(PlainTaskObject, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_dealloc = (destructor)PlainTask_dealloc,
    .tp_traverse = (traverseproc)PlainTask_traverse,
    .tp_clear = (inquiry)PlainTask_clear,
};

PyMethodDef stagetask_methods[] = {
    {"plain_task", (PyCFunction)(void (*)(void))py_plain_task, METH_FASTCALL,
     "A pipelined chain's task for one plain stage, its taken path with no Python frame."},
    {NULL, NULL, 0, NULL},
};

int stagetask_type_ready(void) {
    str_one = PyUnicode_InternFromString("one");
    str_release = PyUnicode_InternFromString("release");
    str_class = PyUnicode_InternFromString("__class__");
    if (str_one == NULL || str_release == NULL || str_class == NULL) return -1;
    groups = PyTuple_Pack(3, (PyObject *)&PyDict_Type, (PyObject *)&PyTuple_Type, (PyObject *)&PyList_Type);
    object_class = _PyType_Lookup(&PyBaseObject_Type, str_class); /* borrowed: object's, for the interpreter's life */
    if (groups == NULL || object_class == NULL) return -1;
    return PyType_Ready(&PlainTask_Type);
}
