/* A native helper for the sandbox attacks (tests/security): compiled with gcc at test time,
 * shipped to the sandbox as bytes and executed there from a memfd (or its /tmp).
 *
 *   helper forkhold MAX HOLD_S   fork up to MAX children that pause(); print how many could be
 *                                made and the errno that stopped it; hold them HOLD_S seconds,
 *                                then kill and reap every one (each child by its pid: never kill(0)).
 *   helper int80 NR A B C        one system call through the i386 gate (int 0x80); prints the result
 *   helper x32 NR A B C          one x32 system call (NR | 0x40000000 through `syscall`); prints it
 *
 * A seccomp filter that kills foreign ABIs ends the process with SIGSYS before it prints. */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

static int forkhold(int max, int hold) {
    pid_t *kids = calloc((size_t)max, sizeof(pid_t));
    int n = 0, err = 0;
    pid_t me = getpid();
    while (n < max) {
        pid_t p = fork();
        if (p < 0) {
            err = errno;
            break;
        }
        if (p == 0) {
            prctl(PR_SET_PDEATHSIG, SIGKILL);
            if (getppid() != me)
                _exit(0);
            pause();
            _exit(0);
        }
        kids[n++] = p;
    }
    printf("{\"forked\": %d, \"errno\": %d}\n", n, err);
    fflush(stdout);
    sleep((unsigned)hold);
    for (int i = 0; i < n; i++)
        kill(kids[i], SIGKILL);
    for (int i = 0; i < n; i++)
        waitpid(kids[i], NULL, 0);
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 2)
        return 2;
    if (!strcmp(argv[1], "forkhold") && argc >= 4)
        return forkhold(atoi(argv[2]), atoi(argv[3]));
#if defined(__x86_64__)
    if ((!strcmp(argv[1], "int80") || !strcmp(argv[1], "x32")) && argc >= 6) {
        long nr = strtol(argv[2], NULL, 0), a = strtol(argv[3], NULL, 0), b = strtol(argv[4], NULL, 0),
             c = strtol(argv[5], NULL, 0), ret;
        if (!strcmp(argv[1], "int80")) {
            __asm__ volatile("int $0x80" : "=a"(ret) : "a"(nr), "b"(a), "c"(b), "d"(c) : "memory");
            ret = (long)(int)ret; /* the i386 ABI returns 32 bits */
        } else {
            __asm__ volatile("syscall" : "=a"(ret) : "a"(nr | 0x40000000L), "D"(a), "S"(b), "d"(c) : "rcx", "r11", "memory");
        }
        printf("%ld\n", ret);
        fflush(stdout);
        return 0;
    }
#endif
    return 2;
}
