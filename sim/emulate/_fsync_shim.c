/* LD_PRELOAD shim for emulated devices: makes every fsync/fdatasync as slow as an SD card's
 * flush and counts them across a whole process tree.
 *
 *   MESH_FSYNC_DELAY_MS  added after each real fsync/fdatasync (float, ms; 0 or unset: none)
 *   MESH_FSYNC_COUNTER   a file holding two little-endian uint64 counters, [fsync, fdatasync],
 *                        mmapped shared and incremented atomically, so the agent and its
 *                        workers add to one total that a reader sees at once (even after a
 *                        SIGKILL: no exit handler is involved).
 *
 * The real call runs first: durability is unchanged, only slower. Built at run time by
 * sim/emulate/constrain.py with `gcc -shared -fPIC -O2 ... -ldl`.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static int (*real_fsync)(int);
static int (*real_fdatasync)(int);
static long long delay_ns;
static uint64_t *counters; /* [0] fsync, [1] fdatasync; NULL when not counting */

__attribute__((constructor)) static void shim_init(void) {
    real_fsync = (int (*)(int))dlsym(RTLD_NEXT, "fsync");
    real_fdatasync = (int (*)(int))dlsym(RTLD_NEXT, "fdatasync");
    const char *d = getenv("MESH_FSYNC_DELAY_MS");
    delay_ns = d ? (long long)(atof(d) * 1e6) : 0;
    if (delay_ns < 0) delay_ns = 0;
    const char *c = getenv("MESH_FSYNC_COUNTER");
    if (c && *c) {
        int fd = open(c, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
        if (fd >= 0) {
            struct stat st;
            if (fstat(fd, &st) == 0 && (st.st_size >= 16 || ftruncate(fd, 16) == 0)) {
                void *p = mmap(NULL, 16, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
                if (p != MAP_FAILED) counters = (uint64_t *)p;
            }
            close(fd);
        }
    }
}

static void shim_after(int which) {
    if (counters) __atomic_fetch_add(&counters[which], 1, __ATOMIC_RELAXED);
    if (delay_ns > 0) {
        int saved = errno;
        struct timespec ts = {(time_t)(delay_ns / 1000000000LL), (long)(delay_ns % 1000000000LL)};
        while (nanosleep(&ts, &ts) == -1 && errno == EINTR) {
        }
        errno = saved;
    }
}

int fsync(int fd) {
    if (!real_fsync) real_fsync = (int (*)(int))dlsym(RTLD_NEXT, "fsync");
    int rc = real_fsync(fd);
    shim_after(0);
    return rc;
}

int fdatasync(int fd) {
    if (!real_fdatasync) real_fdatasync = (int (*)(int))dlsym(RTLD_NEXT, "fdatasync");
    int rc = real_fdatasync(fd);
    shim_after(1);
    return rc;
}
