/* The statistics of a tensor in one read of its elements: min, max, sum and sum of squares of a C-contiguous float32
 * or float64 buffer (``moments``: layerdiff.tracefile.tensors.summarize), or of float32, float64 or bfloat16
 * elements at an address a framework adapter hands over for a dense tensor it holds (``moments_at``:
 * layerdiff.tracefile.tensors.stats_at, read where they lie, with no numpy view and no widened copy), or for a slice of
 * one with its sizes and strides (``moments_strided``: tensors.stats_strided).
 *
 * Why C: numpy needs four passes and four calls for these (two reductions, two dot products), and their per-call
 * overhead dominates small tensors. Here one pass: a 64K-element float32 tensor in 7.4 us instead of 22.8, a
 * 256-element one in 0.2 us instead of 4.4; in a traced Llama step, statistics cost about 40% less (measured,
 * docs/limits.md). Optional: built at install where a C compiler is present; numpy takes the statistics otherwise.
 *
 * Precision: sums are taken in the input's type over blocks of 256 elements (SIMD lanes), the blocks added in
 * double. Float32 sums of random values come within ~5e-8 of float64 (relative to the sum of magnitudes) and squares
 * within ~7e-8, from 1 to 1M elements, in GCC's build and Clang's; values all alike, whose roundings add up rather
 * than cancel, within ~3e-7. Blocks of 1024 were 3% faster and left Clang's squares of random values 2.7e-7 off.
 *
 * Threads: a large tensor (``moments_at`` asked to share threads) is read by the threads of the OpenMP runtime the
 * process has already loaded (the framework's: torch's ATen runs on it), never by threads of layerdiff's own and never
 * by a runtime it loads. Why: the framework's threads wrote the tensor a moment ago, each its own share of it, which
 * is still in that core's cache; read by one thread, a 64K-element float32 output took 18 us in a traced step, against
 * 8 us when read again at once (measured). Each thread reads a contiguous share, as the framework's split it. The
 * tensor is cut into CHUNKS pieces whatever the number of threads, their moments added in order: the results do not
 * depend on how many threads there are, or on which one read what.
 *
 * NaN and infinity are not counted here: they make the sums non-finite, and the caller then takes numpy's path,
 * which counts them. So the file is built as if no value were NaN, infinite or a negative zero (setup.py): min and
 * max are then free to be vectorized (Clang vectorizes those reductions only so: 9x slower without), and where a
 * value is not finite they are not used. Finite float32 or bfloat16 values too large for float32's sums (squares
 * beyond 3.4e38) are read again summed in double (``widened``): only a NaN or an infinity leaves the sums
 * non-finite. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#if defined(__linux__)
#define SHARES_THREADS 1
#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <stddef.h>
#endif
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__linux__) && (!defined(__clang__) || __clang_major__ >= 14)
#define MULTIVERSIONED __attribute__((target_clones("avx2", "default"))) /* picked at load time by the CPU */
#else
#define MULTIVERSIONED
#endif

#define BLOCK 256
#define RELEASE_GIL_FROM 65536 /* elements: below, taking and releasing the GIL costs more than it frees */
#define SHARE_FROM 32768       /* elements: below, handing work to other threads costs more than it frees */
#define CHUNKS 8               /* pieces of a tensor read by threads (at most CHUNKS threads take part) */

#define MOMENTS(NAME, STORED, TYPE, LOAD)                                                                           \
    MULTIVERSIONED static void NAME(const STORED *x, Py_ssize_t n, double *out) {                                  \
        TYPE lo = LOAD(x[0]), hi = LOAD(x[0]);                                                                     \
        double total = 0.0, square = 0.0;                                                                          \
        for (Py_ssize_t start = 0; start < n; start += BLOCK) {                                                    \
            Py_ssize_t end = start + BLOCK < n ? start + BLOCK : n;                                                \
            TYPE low = lo, high = hi, sum = 0, squares = 0;                                                        \
            _Pragma("omp simd reduction(min : low) reduction(max : high) reduction(+ : sum, squares)")            \
            for (Py_ssize_t i = start; i < end; i++) {                                                             \
                TYPE v = LOAD(x[i]);                                                                               \
                low = v < low ? v : low;                                                                           \
                high = v > high ? v : high;                                                                        \
                sum += v;                                                                                          \
                squares += v * v;                                                                                  \
            }                                                                                                      \
            lo = low;                                                                                              \
            hi = high;                                                                                             \
            total += sum;                                                                                          \
            square += squares;                                                                                     \
        }                                                                                                          \
        out[0] = lo;                                                                                               \
        out[1] = hi;                                                                                               \
        out[2] = total;                                                                                            \
        out[3] = square;                                                                                           \
    }

#define AS_IS(v) (v)

/* bfloat16 is the upper half of a float32: its bits shifted up are that float, exactly */
static inline float bfloat16_value(uint16_t bits) {
    uint32_t wide = (uint32_t)bits << 16;
    float v;
    memcpy(&v, &wide, sizeof v);
    return v;
}

static inline double bfloat16_wide(uint16_t bits) { return (double)bfloat16_value(bits); }

MOMENTS(moments_float32, float, float, AS_IS)
MOMENTS(moments_float64, double, double, AS_IS)
MOMENTS(moments_bfloat16, uint16_t, float, bfloat16_value)
/* The same summed in double: for a tensor whose float32 sums overflowed though every value is finite. Why: an
 * attention score masked with the dtype's lowest value (-3.4e38, what transformers' eager attention adds) makes a
 * block's float32 sum and every square overflow; numpy's path then took 0.5 ms for a 256K-element tensor (2 to 4 ms
 * in a traced step), where this pass takes a kernel's time. */
MOMENTS(moments_float32_wide, float, double, AS_IS)
MOMENTS(moments_bfloat16_wide, uint16_t, double, bfloat16_wide)

/* The kinds a caller names (0 to 2), then the wide ones the kernel takes itself (``widened``). */
enum { AT_FLOAT32, AT_FLOAT64, AT_BFLOAT16, AT_FLOAT32_WIDE, AT_BFLOAT16_WIDE };

/* The kind to read again where a read of ``kind`` gave a sum of squares that is not finite, or -1: float32 and
 * bfloat16 summed in double. A NaN or an infinity leaves the wide sums non-finite too (the caller's numpy path then
 * counts them); values that are only large give their statistics. */
static int widened(int kind, double squares) {
    uint64_t bits; /* read from the bits: the file is built as if no value were infinite, so isfinite() may fold */
    memcpy(&bits, &squares, sizeof bits);
    if (((bits >> 52) & 0x7ff) != 0x7ff)
        return -1;
    return kind == AT_FLOAT32 ? AT_FLOAT32_WIDE : kind == AT_BFLOAT16 ? AT_BFLOAT16_WIDE : -1;
}

static size_t itemsize_of(int kind) {
    return kind == AT_FLOAT64 ? 8 : kind == AT_FLOAT32 || kind == AT_FLOAT32_WIDE ? 4 : 2;
}

static void moments_of(int kind, const char *address, Py_ssize_t start, Py_ssize_t n, double *out) {
    if (kind == AT_FLOAT32) moments_float32((const float *)address + start, n, out);
    else if (kind == AT_FLOAT64) moments_float64((const double *)address + start, n, out);
    else if (kind == AT_BFLOAT16) moments_bfloat16((const uint16_t *)address + start, n, out);
    else if (kind == AT_FLOAT32_WIDE) moments_float32_wide((const float *)address + start, n, out);
    else moments_bfloat16_wide((const uint16_t *)address + start, n, out);
}

#ifdef SHARES_THREADS
/* The OpenMP runtime already loaded in the process: GNU's (libgomp), or Intel's or LLVM's, which export the same
 * entry point. Looked up once, on the first call that asks to share threads (the framework is loaded by then). */
typedef void (*parallel_fn)(void (*)(void *), void *, unsigned, unsigned);
typedef int (*omp_int_fn)(void);
static struct {
    int looked;
    parallel_fn parallel;
    omp_int_fn thread_num, team_size, max_threads;
} runtime;

static int is_openmp_runtime(struct dl_phdr_info *info, size_t size, void *found) {
    (void)size;
    const char *name = info->dlpi_name ? strrchr(info->dlpi_name, '/') : NULL;
    name = name ? name + 1 : info->dlpi_name;
    if (name == NULL || !(strncmp(name, "libgomp", 7) == 0 || strncmp(name, "libiomp5", 8) == 0 ||
                          strncmp(name, "libomp.", 7) == 0 || strncmp(name, "libomp-", 7) == 0))
        return 0;
    void *handle = dlopen(info->dlpi_name, RTLD_NOLOAD | RTLD_LAZY); /* loaded already: never loads one */
    if (handle == NULL)
        return 0;
    parallel_fn parallel = (parallel_fn)dlsym(handle, "GOMP_parallel");
    omp_int_fn thread_num = (omp_int_fn)dlsym(handle, "omp_get_thread_num");
    omp_int_fn team_size = (omp_int_fn)dlsym(handle, "omp_get_num_threads");
    omp_int_fn max_threads = (omp_int_fn)dlsym(handle, "omp_get_max_threads");
    dlclose(handle); /* it stays loaded: whoever loaded it holds it */
    if (!(parallel && thread_num && team_size && max_threads))
        return 0;
    runtime.parallel = parallel;
    runtime.thread_num = thread_num;
    runtime.team_size = team_size;
    runtime.max_threads = max_threads;
    *(int *)found = 1;
    return 1;
}

/* Whether objects were loaded since the last look (glibc counts them): a runtime looked for and not found is
 * looked for again only then (torch may be imported after layerdiff). */
static int loads_changed(struct dl_phdr_info *info, size_t size, void *changed) {
    static unsigned long long loads_seen;
    if (size >= offsetof(struct dl_phdr_info, dlpi_adds) + sizeof info->dlpi_adds) {
        *(int *)changed = info->dlpi_adds != loads_seen;
        loads_seen = info->dlpi_adds;
    } else {
        *(int *)changed = !runtime.looked;
    }
    return 1; /* the first object says it: no walk over the rest */
}

/* Set in a child forked from this process: GNU's runtime is not fork-safe (a team the parent used waits forever for
 * its threads, which the child does not have), so a forked child reads alone. */
static int forked;

static void in_forked_child(void) { forked = 1; }

/* Threads the runtime would lend a tensor now (its own setting: torch.set_num_threads sets it); 1 without one. */
static int shared_threads(void) {
    if (forked)
        return 1;
    if (runtime.parallel == NULL) {
        int changed = 0, found = 0;
        dl_iterate_phdr(loads_changed, &changed);
        if (changed)
            dl_iterate_phdr(is_openmp_runtime, &found);
        runtime.looked = 1;
        if (runtime.parallel == NULL)
            return 1;
    }
    int threads = runtime.max_threads();
    return threads < 1 ? 1 : threads > CHUNKS ? CHUNKS : threads;
}
#endif

/* The moments of two pieces of a tensor as one: ``part``'s added to ``out``'s, in that order. */
static void add_moments(double *out, const double *part) {
    out[0] = part[0] < out[0] ? part[0] : out[0];
    out[1] = part[1] > out[1] ? part[1] : out[1];
    out[2] += part[2];
    out[3] += part[3];
}

/* A large tensor (SHARE_FROM elements on) is read in CHUNKS pieces whose moments are added in order, whoever reads
 * them: shared or not, with any number of threads, its statistics are the same to the last bit. */
typedef struct {
    int kind;
    const char *address;
    Py_ssize_t n;
    double out[CHUNKS][4];
} Chunked;

/* Chunk c: whole blocks from a fixed cut of the tensor. */
static void read_chunk(Chunked *chunked, int c) {
    Py_ssize_t blocks = (chunked->n + BLOCK - 1) / BLOCK;
    Py_ssize_t start = blocks * c / CHUNKS * BLOCK;
    Py_ssize_t end = c + 1 == CHUNKS ? chunked->n : blocks * (c + 1) / CHUNKS * BLOCK;
    moments_of(chunked->kind, chunked->address, start, end - start, chunked->out[c]);
}

#ifdef SHARES_THREADS
/* Run by each thread of the team: a contiguous run of chunks (thread t of T: chunks t*CHUNKS/T on), whatever T the
 * runtime gave (a nested region gets one thread, which then reads them all). */
static void read_share(void *data) {
    int t = runtime.thread_num(), team = runtime.team_size();
    for (int c = t * CHUNKS / team; c < (t + 1) * CHUNKS / team; c++)
        read_chunk(data, c);
}
#endif

static void moments_chunked(int kind, const char *address, Py_ssize_t n, int threads, double *out) {
    Chunked chunked = {.kind = kind, .address = address, .n = n};
#ifdef SHARES_THREADS
    if (threads > 1)
        runtime.parallel(read_share, &chunked, (unsigned)threads, 0);
    else
#endif
        for (int c = 0; c < CHUNKS; c++)
            read_chunk(&chunked, c);
    memcpy(out, chunked.out[0], 4 * sizeof(double));
    for (int c = 1; c < CHUNKS; c++)
        add_moments(out, chunked.out[c]);
}

/* ``chunked`` or not, by size alone, so that every path gives a tensor the same statistics. */
static void read_sized(int kind, const char *address, Py_ssize_t n, int threads, double *out) {
    if (n >= SHARE_FROM)
        moments_chunked(kind, address, n, threads, out);
    else
        moments_of(kind, address, 0, n, out);
}

/* The moments of n elements of ``kind`` at address (with the GIL released for large ones), ``threads`` reading a
 * large one; read again summed in double where float32's sums overflowed (``widened``). */
static void read_moments(int kind, const char *address, Py_ssize_t n, int threads, double *out) {
    int release = n >= RELEASE_GIL_FROM;
    PyThreadState *saved = release ? PyEval_SaveThread() : NULL;
    read_sized(kind, address, n, threads, out);
    int wide = widened(kind, out[3]);
    if (wide >= 0)
        read_sized(wide, address, n, threads, out);
    if (release)
        PyEval_RestoreThread(saved);
}

static PyObject *moments(PyObject *module, PyObject *array) {
    (void)module;
    Py_buffer view;
    if (PyObject_GetBuffer(array, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return NULL;
    Py_ssize_t n = view.itemsize > 0 ? view.len / view.itemsize : 0;
    const char *format = view.format ? view.format : "B";
    if (format[0] == '=' || format[0] == '<' || format[0] == '@')
        format++; /* numpy names a native-order float "f" or "<f" */
    int single = strcmp(format, "f") == 0 && view.itemsize == 4, wide = strcmp(format, "d") == 0 && view.itemsize == 8;
    if (n == 0 || !(single || wide)) {
        PyBuffer_Release(&view);
        Py_RETURN_NONE; /* not ours to summarize: the caller's numpy path takes it */
    }
    double out[4];
    read_moments(single ? AT_FLOAT32 : AT_FLOAT64, view.buf, n, 1, out);
    PyBuffer_Release(&view);
    return Py_BuildValue("(dddd)", out[0], out[1], out[2], out[3]);
}

/* The same statistics of ``count`` elements lying back to back at ``address``: a framework's CPU tensor read where
 * it lies, without a numpy view of it (making one through DLPack cost 2.7 us a tensor, most of a small tensor's
 * summary). The caller vouches that the memory holds that many elements of that kind and stays alive meanwhile.
 * ``share_threads`` (optional, false by default): a large tensor is read by the threads of the OpenMP runtime the
 * process has loaded, where there is one; the caller says so where the framework that wrote it runs on that runtime. */
static PyObject *moments_at(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 3 && nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "moments_at(address, count, kind[, share_threads]) takes 3 or 4 arguments");
        return NULL;
    }
    void *address = PyLong_AsVoidPtr(args[0]);
    Py_ssize_t n = PyLong_AsSsize_t(args[1]);
    long kind = PyLong_AsLong(args[2]);
    int share = nargs == 4 ? PyObject_IsTrue(args[3]) : 0;
    if (PyErr_Occurred())
        return NULL;
    if (address == NULL || n <= 0 || kind < AT_FLOAT32 || kind > AT_BFLOAT16)
        Py_RETURN_NONE;
    double out[4];
    int threads = 1;
#ifdef SHARES_THREADS
    if (share && n >= SHARE_FROM)
        threads = shared_threads();
#else
    (void)share;
#endif
    read_moments((int)kind, address, n, threads, out);
    return Py_BuildValue("(dddd)", out[0], out[1], out[2], out[3]);
}

/* A tensor that is not dense (a slice: the halves ``rotate_half`` takes of each head, every other column) read where it
 * lies: its runs of elements are gathered, in memory order, into blocks of BLOCK elements, each block read as a dense
 * one is (``moments_of``), the blocks' moments added in order. Why: numpy took 70 us for a 32K-element float32 slice
 * (a copy to make it contiguous, then four passes), 32 of them a traced Llama step. Dims of size 1 are dropped and
 * dims that continue one another merged, so a run is as long as the layout allows. */
#define MAX_DIMS 25

typedef struct {
    int kind;
    size_t itemsize;
    double block[BLOCK]; /* BLOCK elements of ``kind`` gathered back to back (doubles: aligned for every kind) */
    Py_ssize_t filled;   /* elements in block */
    Py_ssize_t blocks; /* blocks read so far */
    double out[4];
} Gathered;

static void read_block(Gathered *g) {
    double part[4];
    moments_of(g->kind, (const char *)g->block, 0, g->filled, part);
    if (g->blocks++ == 0)
        memcpy(g->out, part, sizeof part);
    else
        add_moments(g->out, part);
    g->filled = 0;
}

/* ``count`` elements ``stride`` elements apart from ``at`` into the blocks. */
static void gather_run(Gathered *g, const char *at, Py_ssize_t count, Py_ssize_t stride) {
    while (count > 0) {
        Py_ssize_t take = BLOCK - g->filled < count ? BLOCK - g->filled : count;
        unsigned char *to = (unsigned char *)g->block + g->filled * g->itemsize;
        if (stride == 1) {
            memcpy(to, at, (size_t)take * g->itemsize);
        } else {
            for (Py_ssize_t i = 0; i < take; i++)
                memcpy(to + i * g->itemsize, at + i * stride * (Py_ssize_t)g->itemsize, g->itemsize);
        }
        g->filled += take;
        at += take * stride * (Py_ssize_t)g->itemsize;
        count -= take;
        if (g->filled == BLOCK)
            read_block(g);
    }
}

static void gather_all(Gathered *g, const char *address, int ndim, const Py_ssize_t *sizes, const Py_ssize_t *strides) {
    /* the runs' addresses kept by an odometer over the outer dims (one add a run, not a sum over the dims: the
     * halves ``rotate_half`` takes are 2,048 runs of 16 elements a 32K-element slice) */
    Py_ssize_t index[MAX_DIMS] = {0}, step[MAX_DIMS];
    int inner = ndim - 1;
    for (int d = 0; d < inner; d++)
        step[d] = strides[d] * (Py_ssize_t)g->itemsize;
    const char *at = address;
    for (;;) {
        gather_run(g, at, sizes[inner], strides[inner]);
        int d = inner - 1;
        while (d >= 0 && ++index[d] == sizes[d]) {
            at -= (sizes[d] - 1) * step[d];
            index[d--] = 0;
        }
        if (d < 0)
            break;
        at += step[d];
    }
    if (g->filled)
        read_block(g);
}

static int as_sizes(PyObject *sequence, Py_ssize_t *into, int *ndim) {
    PyObject *items = PySequence_Fast(sequence, "sizes and strides must be sequences of integers");
    if (items == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(items);
    if (n > MAX_DIMS) {
        Py_DECREF(items);
        *ndim = -1;
        return 0;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        into[i] = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(items, i));
        if (into[i] == -1 && PyErr_Occurred()) {
            Py_DECREF(items);
            return -1;
        }
    }
    Py_DECREF(items);
    *ndim = (int)n;
    return 0;
}

static PyObject *moments_strided(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "moments_strided(address, kind, sizes, strides) takes 4 arguments");
        return NULL;
    }
    void *address = PyLong_AsVoidPtr(args[0]);
    long kind = PyLong_AsLong(args[1]);
    Py_ssize_t sizes[MAX_DIMS], strides[MAX_DIMS];
    int ndim = 0, nstrides = 0;
    if (PyErr_Occurred() || as_sizes(args[2], sizes, &ndim) < 0 || as_sizes(args[3], strides, &nstrides) < 0)
        return NULL;
    if (address == NULL || kind < AT_FLOAT32 || kind > AT_BFLOAT16 || ndim < 0 || ndim != nstrides)
        Py_RETURN_NONE;
    /* dims of size 1 dropped; the rest ordered by stride, largest first (statistics do not depend on the order); a
     * dim merged into the one before it where it continues it; a stride of 0 (an expanded tensor) or below is not
     * read here */
    Py_ssize_t n = 1;
    int kept = 0;
    for (int d = 0; d < ndim; d++) {
        if (sizes[d] <= 0)
            Py_RETURN_NONE;
        n *= sizes[d];
        if (sizes[d] == 1)
            continue;
        Py_ssize_t size = sizes[d], stride = strides[d];
        if (stride <= 0)
            Py_RETURN_NONE;
        int at = kept++;
        while (at > 0 && strides[at - 1] < stride) {
            sizes[at] = sizes[at - 1];
            strides[at] = strides[at - 1];
            at--;
        }
        sizes[at] = size;
        strides[at] = stride;
    }
    int merged = 0;
    for (int d = 0; d < kept; d++) {
        if (merged > 0 && strides[merged - 1] == strides[d] * sizes[d]) {
            sizes[merged - 1] *= sizes[d];
            strides[merged - 1] = strides[d];
        } else {
            sizes[merged] = sizes[d];
            strides[merged] = strides[d];
            merged++;
        }
    }
    if (merged == 0) { /* one element */
        sizes[0] = 1;
        strides[0] = 1;
        merged = 1;
    }
    Gathered g = {.kind = (int)kind, .itemsize = itemsize_of((int)kind)};
    int release = n >= RELEASE_GIL_FROM;
    PyThreadState *saved = release ? PyEval_SaveThread() : NULL;
    gather_all(&g, address, merged, sizes, strides);
    int wide = widened((int)kind, g.out[3]);
    if (wide >= 0) {
        g.kind = wide;
        g.filled = g.blocks = 0;
        gather_all(&g, address, merged, sizes, strides);
    }
    if (release)
        PyEval_RestoreThread(saved);
    return Py_BuildValue("(dddd)", g.out[0], g.out[1], g.out[2], g.out[3]);
}

/* How many threads ``moments_at`` would share now: 1 where no OpenMP runtime is loaded (or none can be shared). */
static PyObject *threads_shared(PyObject *module, PyObject *unused) {
    (void)module;
    (void)unused;
#ifdef SHARES_THREADS
    return PyLong_FromLong(shared_threads());
#else
    return PyLong_FromLong(1);
#endif
}

static PyMethodDef methods[] = {
    {"moments", moments, METH_O,
     "moments(array) -> (min, max, sum, sum of squares) of a C-contiguous float32 or float64 buffer, or None for "
     "another type or no elements. A NaN or infinity makes the sums non-finite (min and max are then not to be used)."},
    {"moments_at", (PyCFunction)(void (*)(void))moments_at, METH_FASTCALL,
     "moments_at(address, count, kind, share_threads=False) -> the same of count elements at address: kind 0 float32, "
     "1 float64, 2 bfloat16; None for no elements or another kind. The caller vouches for the memory. share_threads: "
     "a large tensor is read by the threads of the OpenMP runtime already loaded in the process, if any."},
    {"moments_strided", (PyCFunction)(void (*)(void))moments_strided, METH_FASTCALL,
     "moments_strided(address, kind, sizes, strides) -> the same of a tensor laid out with those sizes and strides (in "
     "elements) from address; None where a stride is 0 or negative, or there are more than 25 dims. The caller "
     "vouches for the memory."},
    {"threads_shared", threads_shared, METH_NOARGS,
     "threads_shared() -> how many threads moments_at(..., share_threads=True) reads a large tensor with now (1: none "
     "shared)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef definition = {
    PyModuleDef_HEAD_INIT,
    .m_name = "fastmoments",
    .m_doc = "One-pass statistics of float buffers (optional; see layerdiff.tracefile.tensors.summarize).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit_fastmoments(void) {
#ifdef SHARES_THREADS
    pthread_atfork(NULL, NULL, in_forked_child);
#endif
    return PyModule_Create(&definition);
}
