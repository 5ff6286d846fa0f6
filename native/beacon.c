/*
 * The liveness beacon (docs/DESIGN.md §5.4): a small POSIX thread, not a Python thread, that
 * every period stores a growing count into words of shared memory that peers read (the shm
 * transport's rings, W_PALIVE). It never takes the GIL, so a handler that holds the event loop
 * (or the GIL) does not stop it; a process that dies or is stopped (SIGSTOP) stops it with the
 * rest of the process. The loop touches the beacon at every tick; once the loop has not touched
 * it for hold_s, the beacon stops counting, so a loop held for good is suspected all the same.
 *
 * Handles are capsules: beacon_start makes one; beacon_add pins a writable buffer (the Py_buffer
 * is held until the target is removed or the beacon stops, so its mmap cannot close under the
 * thread); the thread reads the target list under the beacon's mutex, and the functions that
 * change it take the mutex while holding the GIL (the thread never waits for the GIL, so this
 * cannot deadlock). Twin: derecho_async/_hotpath_pure/beacon.py.
 */
#include "native.h"

#include <errno.h>
#include <pthread.h>
#include <time.h>

#define CAPSULE_NAME "derecho_async.beacon"

typedef struct {
    long long key;
    Py_buffer view;
    unsigned char *word;
} beacon_target;

typedef struct {
    pthread_mutex_t lock;
    pthread_cond_t wake;
    pthread_t thread;
    int running;                /* the thread was started and not joined yet */
    int stop;                   /* under lock: the thread ends at its next wake-up */
    uint64_t period_ns;
    uint64_t hold_ns;           /* 0: count whatever the loop does */
    uint64_t touched_ns;        /* atomic: CLOCK_MONOTONIC of the loop's last touch */
    uint64_t count;             /* under lock: the count last stored */
    beacon_target *targets;     /* under lock */
    Py_ssize_t n, cap;
} beacon;

static uint64_t
mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void *
beacon_main(void *arg)
{
    beacon *b = (beacon *)arg;
    pthread_mutex_lock(&b->lock);
    uint64_t due = mono_ns();
    while (!b->stop) {
        uint64_t now = mono_ns();
        uint64_t touched = __atomic_load_n(&b->touched_ns, __ATOMIC_ACQUIRE);
        if (b->hold_ns == 0 || now - touched <= b->hold_ns) {
            b->count++;
            for (Py_ssize_t i = 0; i < b->n; i++)
                store_word(b->targets[i].word, b->count);
        }
        due += b->period_ns;
        if (due < now)          /* descheduled for more than a period: start again from now */
            due = now + b->period_ns;
        struct timespec ts = {(time_t)(due / 1000000000u), (long)(due % 1000000000u)};
        while (!b->stop && pthread_cond_timedwait(&b->wake, &b->lock, &ts) != ETIMEDOUT) {
        }
    }
    pthread_mutex_unlock(&b->lock);
    return NULL;
}

/* Ends the thread (if running) and releases every pinned buffer; the GIL is held. */
static void
beacon_halt(beacon *b)
{
    if (b->running) {
        pthread_mutex_lock(&b->lock);
        b->stop = 1;
        pthread_cond_signal(&b->wake);
        pthread_mutex_unlock(&b->lock);
        Py_BEGIN_ALLOW_THREADS
        pthread_join(b->thread, NULL);
        Py_END_ALLOW_THREADS
        b->running = 0;
    }
    for (Py_ssize_t i = 0; i < b->n; i++)
        PyBuffer_Release(&b->targets[i].view);
    b->n = 0;
}

static void
beacon_capsule_free(PyObject *capsule)
{
    beacon *b = (beacon *)PyCapsule_GetPointer(capsule, CAPSULE_NAME);
    if (b == NULL)
        return;
    beacon_halt(b);
    pthread_cond_destroy(&b->wake);
    pthread_mutex_destroy(&b->lock);
    PyMem_RawFree(b->targets);
    PyMem_RawFree(b);
}

static beacon *
get_beacon(PyObject *obj)
{
    if (!PyCapsule_IsValid(obj, CAPSULE_NAME)) {
        PyErr_SetString(PyExc_TypeError, "expected a beacon from beacon_start");
        return NULL;
    }
    return (beacon *)PyCapsule_GetPointer(obj, CAPSULE_NAME);
}

/* seconds argument: a finite number in [lo, 3600] (lo_text: lo as the pure twin's %g writes it) */
static int
arg_seconds(PyObject *obj, const char *name, double lo, const char *lo_text, uint64_t *out)
{
    double s = PyFloat_AsDouble(obj);
    if (s == -1.0 && PyErr_Occurred())
        return -1;
    if (!(s >= lo && s <= 3600.0)) {
        PyErr_Format(PyExc_ValueError, "%s must be a number of seconds in [%s, 3600]", name,
                     lo_text);
        return -1;
    }
    *out = (uint64_t)(s * 1e9);
    return 0;
}

PyObject *
native_beacon_start(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "beacon_start(period_s, hold_s) takes 2 arguments");
        return NULL;
    }
    uint64_t period_ns, hold_ns;
    if (arg_seconds(args[0], "period_s", 0.001, "0.001", &period_ns) < 0 ||
        arg_seconds(args[1], "hold_s", 0.0, "0", &hold_ns) < 0)
        return NULL;
    beacon *b = (beacon *)PyMem_RawCalloc(1, sizeof(beacon));
    if (b == NULL)
        return PyErr_NoMemory();
    b->period_ns = period_ns;
    b->hold_ns = hold_ns;
    b->touched_ns = mono_ns();
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&b->wake, &attr);
    pthread_condattr_destroy(&attr);
    pthread_mutex_init(&b->lock, NULL);
    PyObject *capsule = PyCapsule_New(b, CAPSULE_NAME, beacon_capsule_free);
    if (capsule == NULL) {
        pthread_cond_destroy(&b->wake);
        pthread_mutex_destroy(&b->lock);
        PyMem_RawFree(b);
        return NULL;
    }
    int err = pthread_create(&b->thread, NULL, beacon_main, b);
    if (err != 0) {
        Py_DECREF(capsule);
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    b->running = 1;
    return capsule;
}

PyObject *
native_beacon_add(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "beacon_add(beacon, key, (buf, offset)) takes 3 "
                                         "arguments");
        return NULL;
    }
    beacon *b = get_beacon(args[0]);
    if (b == NULL)
        return NULL;
    long long key = PyLong_AsLongLong(args[1]);
    if (key == -1 && PyErr_Occurred())
        return NULL;
    PyObject *buf, *offobj;
    if (!PyArg_ParseTuple(args[2], "OO:beacon_add", &buf, &offobj))
        return NULL;
    if (!b->running) {
        PyErr_SetString(PyExc_ValueError, "the beacon is stopped");
        return NULL;
    }
    beacon_target t = {key, {0}, NULL};
    if (PyObject_GetBuffer(buf, &t.view, PyBUF_WRITABLE) < 0)
        return NULL;
    Py_ssize_t off = PyLong_AsSsize_t(offobj);
    if (off == -1 && PyErr_Occurred()) {
        PyBuffer_Release(&t.view);
        return NULL;
    }
    if (off < 0 || t.view.len < WORD || off > t.view.len - WORD) {
        PyErr_Format(PyExc_IndexError, "word at offset %zd is outside a buffer of %zd bytes",
                     off, t.view.len);
        PyBuffer_Release(&t.view);
        return NULL;
    }
    t.word = (unsigned char *)t.view.buf + off;
    if (b->n == b->cap) {
        Py_ssize_t cap = b->cap ? b->cap * 2 : 8;
        beacon_target *more = (beacon_target *)PyMem_RawMalloc((size_t)cap * sizeof(*more));
        if (more == NULL) {
            PyBuffer_Release(&t.view);
            return PyErr_NoMemory();
        }
        pthread_mutex_lock(&b->lock);
        if (b->n)
            memcpy(more, b->targets, (size_t)b->n * sizeof(*more));
        beacon_target *old = b->targets;
        b->targets = more;
        b->cap = cap;
        pthread_mutex_unlock(&b->lock);
        PyMem_RawFree(old);
    }
    Py_buffer replaced;
    int had = 0;
    pthread_mutex_lock(&b->lock);
    store_word(t.word, b->count);
    for (Py_ssize_t i = 0; i < b->n; i++) {
        if (b->targets[i].key == key) {
            replaced = b->targets[i].view;
            b->targets[i] = t;
            had = 1;
            break;
        }
    }
    if (!had)
        b->targets[b->n++] = t;
    pthread_mutex_unlock(&b->lock);
    if (had)
        PyBuffer_Release(&replaced);
    Py_RETURN_NONE;
}

PyObject *
native_beacon_remove(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "beacon_remove(beacon, key) takes 2 arguments");
        return NULL;
    }
    beacon *b = get_beacon(args[0]);
    if (b == NULL)
        return NULL;
    long long key = PyLong_AsLongLong(args[1]);
    if (key == -1 && PyErr_Occurred())
        return NULL;
    Py_buffer gone;
    int found = 0;
    pthread_mutex_lock(&b->lock);
    for (Py_ssize_t i = 0; i < b->n; i++) {
        if (b->targets[i].key == key) {
            gone = b->targets[i].view;
            b->targets[i] = b->targets[--b->n];
            found = 1;
            break;
        }
    }
    pthread_mutex_unlock(&b->lock);
    if (!found)
        Py_RETURN_FALSE;
    PyBuffer_Release(&gone);
    Py_RETURN_TRUE;
}

PyObject *
native_beacon_touch(PyObject *self, PyObject *obj)
{
    beacon *b = get_beacon(obj);
    if (b == NULL)
        return NULL;
    __atomic_store_n(&b->touched_ns, mono_ns(), __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

PyObject *
native_beacon_count(PyObject *self, PyObject *obj)
{
    beacon *b = get_beacon(obj);
    if (b == NULL)
        return NULL;
    pthread_mutex_lock(&b->lock);
    uint64_t count = b->count;
    pthread_mutex_unlock(&b->lock);
    return PyLong_FromUnsignedLongLong(count);
}

PyObject *
native_beacon_stop(PyObject *self, PyObject *obj)
{
    beacon *b = get_beacon(obj);
    if (b == NULL)
        return NULL;
    beacon_halt(b);
    Py_RETURN_NONE;
}
