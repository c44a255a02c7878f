/* Loaded with LD_PRELOAD into a worker rank (runtime/transfer/bindshim.py): Mooncake's transfer
 * engine binds its handshake and TCP data ports to every interface and offers no setting for
 * the address. This wraps bind(): a wildcard address (0.0.0.0 or ::) bound by code inside the
 * Mooncake package becomes PDSIM_BIND_HOST (an IPv4 address; on an IPv6 socket its v4-mapped
 * form). Every other bind -- Python's, ZMQ's, any address that is not a wildcard -- is passed
 * through unchanged. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

static int from_mooncake(const void *caller) {
    Dl_info info;
    return dladdr(caller, &info) && info.dli_fname && strstr(info.dli_fname, "/mooncake");
}

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    static bind_fn real_bind;
    if (!real_bind) real_bind = (bind_fn)dlsym(RTLD_NEXT, "bind");
    const char *host = getenv("PDSIM_BIND_HOST");
    struct in_addr v4;
    if (!host || !addr || inet_pton(AF_INET, host, &v4) != 1 ||
        !from_mooncake(__builtin_return_address(0)))
        return real_bind(fd, addr, len);
    if (addr->sa_family == AF_INET && len >= sizeof(struct sockaddr_in)) {
        struct sockaddr_in a;
        memcpy(&a, addr, sizeof a);
        if (a.sin_addr.s_addr == htonl(INADDR_ANY)) {
            a.sin_addr = v4;
            return real_bind(fd, (const struct sockaddr *)&a, sizeof a);
        }
    } else if (addr->sa_family == AF_INET6 && len >= sizeof(struct sockaddr_in6)) {
        struct sockaddr_in6 a;
        memcpy(&a, addr, sizeof a);
        if (IN6_IS_ADDR_UNSPECIFIED(&a.sin6_addr)) {
            memset(&a.sin6_addr, 0, sizeof a.sin6_addr);
            a.sin6_addr.s6_addr[10] = 0xff;
            a.sin6_addr.s6_addr[11] = 0xff;
            memcpy(&a.sin6_addr.s6_addr[12], &v4, sizeof v4);
            return real_bind(fd, (const struct sockaddr *)&a, sizeof a);
        }
    }
    return real_bind(fd, addr, len);
}
