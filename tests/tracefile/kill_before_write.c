/* Preloaded (LD_PRELOAD) into the helper of tests/tracefile/test_kill_before_writes.py: counts the process's writes
   to files (pwrite, write past stdio, ftruncate: HDF5's and the trace writer's own) and kills the process with SIGKILL
   right before the n-th one after ``kill_before_write_arm(n)``; ``kill_before_write_count()`` says how many ran. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/types.h>
#include <unistd.h>

static atomic_long counted;
static atomic_long kill_at;

void kill_before_write_arm(long n) { atomic_store(&counted, 0); atomic_store(&kill_at, n); }
long kill_before_write_count(void) { return atomic_load(&counted); }

static void before_write(void) {
    long n = atomic_fetch_add(&counted, 1) + 1;
    long at = atomic_load(&kill_at);
    if (at > 0 && n >= at) kill(getpid(), SIGKILL);
}

#define NEXT(name) static __typeof__(name) *next; if (!next) next = (__typeof__(name) *)dlsym(RTLD_NEXT, #name)

ssize_t pwrite(int fd, const void *buf, size_t n, off_t offset) { NEXT(pwrite); before_write(); return next(fd, buf, n, offset); }
ssize_t pwrite64(int fd, const void *buf, size_t n, off_t offset) { NEXT(pwrite64); before_write(); return next(fd, buf, n, offset); }
ssize_t write(int fd, const void *buf, size_t n) { NEXT(write); if (fd > 2) before_write(); return next(fd, buf, n); }
int ftruncate(int fd, off_t length) { NEXT(ftruncate); before_write(); return next(fd, length); }
int ftruncate64(int fd, off_t length) { NEXT(ftruncate64); before_write(); return next(fd, length); }
