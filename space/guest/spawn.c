/* space-spawn: the guest daemon's exec wrapper.
 *
 * Switching users or taking a controlling terminal inside Python's subprocess forces a full fork of
 * the daemon (~35 ms under gVisor) instead of vfork (~2 ms); util-linux's setpriv costs a dynamically
 * linked exec (~24 ms). This static helper does those steps between two execs for ~10 ms.
 *
 *   space-spawn [-u UID] [-g GID] [-G GID,GID,...] [-t] -- PROGRAM ARGS...
 *
 * -t makes fd 0 (a pty slave) the controlling terminal; the caller has already called setsid().
 * CAP_SYS_RESOURCE, which the guest daemon holds (see guest_caps.py), is always dropped from the
 * bounding set first, so a program run as root never gets it; a program that would run as root
 * with it still there is not run.
 * The program is searched in $PATH. Any failure prints a line to stderr and exits 127.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <grp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/capability.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <unistd.h>

static void die(const char *what, const char *arg) {
    fprintf(stderr, "space-spawn: %s %s: %s\n", what, arg ? arg : "", strerror(errno));
    _exit(127);
}

int main(int argc, char **argv) {
    long uid = -1, gid = -1;
    gid_t groups[256];
    int ngroups = -1, ctty = 0, i = 1;
    for (; i < argc; i++) {
        if (strcmp(argv[i], "--") == 0) { i++; break; }
        if (strcmp(argv[i], "-t") == 0) { ctty = 1; continue; }
        if (i + 1 >= argc) { errno = EINVAL; die("missing value for", argv[i]); }
        if (strcmp(argv[i], "-u") == 0) uid = strtol(argv[++i], NULL, 10);
        else if (strcmp(argv[i], "-g") == 0) gid = strtol(argv[++i], NULL, 10);
        else if (strcmp(argv[i], "-G") == 0) {
            char *s = argv[++i], *tok;
            ngroups = 0;
            while ((tok = strsep(&s, ",")) != NULL && ngroups < 256)
                if (*tok) groups[ngroups++] = (gid_t)strtol(tok, NULL, 10);
        } else { errno = EINVAL; die("unknown option", argv[i]); }
    }
    if (i >= argc) { errno = EINVAL; die("no program", NULL); }
    /* Before setuid, while CAP_SETPCAP is still there; leaving uid 0 clears every capability. */
    if (prctl(PR_CAPBSET_DROP, CAP_SYS_RESOURCE, 0, 0, 0) != 0 && uid <= 0 && geteuid() == 0
        && prctl(PR_CAPBSET_READ, CAP_SYS_RESOURCE, 0, 0, 0) != 0)
        die("cannot drop CAP_SYS_RESOURCE from the bounding set", NULL);
    if (ctty && ioctl(0, TIOCSCTTY, 0) != 0) die("cannot take the controlling terminal", NULL);
    if (ngroups >= 0 && setgroups((size_t)ngroups, groups) != 0) die("setgroups", NULL);
    if (gid >= 0 && setgid((gid_t)gid) != 0) die("setgid", NULL);
    if (uid >= 0 && setuid((uid_t)uid) != 0) die("setuid", NULL);
    execvp(argv[i], argv + i);
    die("cannot execute", argv[i]);
    return 127;
}
