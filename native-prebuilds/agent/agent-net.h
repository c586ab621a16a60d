/*
 * The guest's network configuration, included by agent.c (one translation unit, as the agent is
 * built). No DHCP and no `ip` tool: the host (src/network/) chose the addresses and writes them on
 * the kernel command line as
 *
 *   pvisor.net=ADDRESS/PREFIX,GATEWAY[,DNS]      e.g. pvisor.net=10.200.0.2/30,10.200.0.1,10.0.0.53
 *
 * and PID 1 applies them with the classic ioctls (SIOCSIFADDR, SIOCSIFNETMASK, SIOCSIFFLAGS,
 * SIOCADDRT), so a rootfs without network tools still gets a network. The loopback interface is
 * brought up whether or not there is a pvisor.net (local servers and tools expect 127.0.0.1).
 * A configuration that cannot be applied is logged, never fatal: commands still run, offline.
 *
 * NET_CONFIGURE (agent.c) applies the same text again in a VM restored from a snapshot: the
 * clone has a /30 of its own on the host, so eth0 is taken down (which drops its routes and
 * neighbours, all of the snapshot's network), given the new address and brought up with the new
 * default route and resolver.
 *
 * resolv.conf: written to /etc/resolv.conf; when / is read-only (a read-only rootfs), written to
 * /run/pvisor/resolv.conf and bind-mounted over /etc/resolv.conf if the image has that file.
 */
#include <arpa/inet.h>
#include <net/if.h>
#include <net/route.h>
#include <netinet/in.h>
#include <sys/socket.h>

#define NET_IFACE "eth0"

static int net_ifflags_up(int s, const char *ifname) {
  struct ifreq ifr = {0};
  snprintf(ifr.ifr_name, sizeof ifr.ifr_name, "%s", ifname);
  if (ioctl(s, SIOCGIFFLAGS, &ifr)) return -1;
  ifr.ifr_flags |= IFF_UP | IFF_RUNNING;
  return ioctl(s, SIOCSIFFLAGS, &ifr);
}

static int net_set_addr(int s, const char *ifname, unsigned long req, in_addr_t addr) {
  struct ifreq ifr = {0};
  snprintf(ifr.ifr_name, sizeof ifr.ifr_name, "%s", ifname);
  struct sockaddr_in *sin = (struct sockaddr_in *)&ifr.ifr_addr;
  sin->sin_family = AF_INET;
  sin->sin_addr.s_addr = addr;
  return ioctl(s, req, &ifr);
}

/* Writes resolv.conf for DNS (see the header comment). */
static void net_write_resolv(const char *dns) {
  char text[96];
  int n = snprintf(text, sizeof text, "nameserver %s\n", dns);
  const char *path = "/etc/resolv.conf";
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0 && (errno == EROFS || errno == EACCES)) {
    mkdir("/run/pvisor", 0755);
    path = "/run/pvisor/resolv.conf";
    fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd >= 0 && mount(path, "/etc/resolv.conf", NULL, MS_BIND, NULL)) logmsg("net: bind-mount %s on /etc/resolv.conf: %s", path, strerror(errno));
  }
  if (fd < 0) {
    logmsg("net: write %s: %s", path, strerror(errno));
    return;
  }
  if (write(fd, text, (size_t)n) != n) logmsg("net: write %s: %s", path, strerror(errno));
  close(fd);
}

/*
 * Applies SPEC (ADDRESS/PREFIX,GATEWAY[,DNS], see the header comment) to eth0, first taking it
 * down when RECONFIGURE. Returns 0, or an errno with WHY set to what failed (EINVAL: SPEC).
 */
static int net_apply(const char *spec, int reconfigure, const char **why) {
  char addr[32] = "", gw[32] = "", dns[32] = "";
  int prefix = -1;
  const char *slash = strchr(spec, '/'), *c1 = strchr(spec, ','), *c2 = c1 ? strchr(c1 + 1, ',') : NULL;
  if (slash && c1 && slash < c1 && slash - spec < (long)sizeof addr && (c2 ? c2 - c1 - 1 : (long)strlen(c1 + 1)) < (long)sizeof gw && (!c2 || strlen(c2 + 1) < sizeof dns)) {
    snprintf(addr, sizeof addr, "%.*s", (int)(slash - spec), spec);
    prefix = atoi(slash + 1);
    snprintf(gw, sizeof gw, "%.*s", (int)(c2 ? c2 - c1 - 1 : (long)strlen(c1 + 1)), c1 + 1);
    if (c2) snprintf(dns, sizeof dns, "%s", c2 + 1);
  }
  struct in_addr a, g, d;
  if (prefix < 1 || prefix > 32 || !inet_aton(addr, &a) || !inet_aton(gw, &g) || (dns[0] && !inet_aton(dns, &d))) {
    *why = "ADDRESS/PREFIX,GATEWAY[,DNS]";
    return EINVAL;
  }
  int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (s < 0) {
    *why = "socket";
    return errno;
  }
  /* virtio-net is built in and probes before init; wait a little all the same */
  struct ifreq probe = {0};
  snprintf(probe.ifr_name, sizeof probe.ifr_name, "%s", NET_IFACE);
  for (int i = 0; i < 200 && ioctl(s, SIOCGIFFLAGS, &probe); i++) nanosleep(&(struct timespec){.tv_nsec = 10 * 1000 * 1000}, NULL);
  if (reconfigure) {
    /* Down drops every route and neighbour through eth0: the snapshot's gateway is not the clone's. */
    probe.ifr_flags &= ~IFF_UP;
    if (ioctl(s, SIOCSIFFLAGS, &probe)) {
      int e = errno;
      close(s);
      *why = "eth0 down";
      return e;
    }
  }
  in_addr_t mask = htonl(prefix == 32 ? 0xffffffffu : ~(0xffffffffu >> prefix));
  if (net_set_addr(s, NET_IFACE, SIOCSIFADDR, a.s_addr) || net_set_addr(s, NET_IFACE, SIOCSIFNETMASK, mask) || net_ifflags_up(s, NET_IFACE)) {
    int e = errno;
    close(s);
    *why = "configure eth0";
    return e;
  }
  struct rtentry rt = {0};
  struct sockaddr_in *dst = (struct sockaddr_in *)&rt.rt_dst, *gate = (struct sockaddr_in *)&rt.rt_gateway, *gmask = (struct sockaddr_in *)&rt.rt_genmask;
  dst->sin_family = gate->sin_family = gmask->sin_family = AF_INET;
  gate->sin_addr = g;
  rt.rt_flags = RTF_UP | RTF_GATEWAY;
  rt.rt_dev = (char *)NET_IFACE;
  if (ioctl(s, SIOCADDRT, &rt) && errno != EEXIST) {
    int e = errno;
    close(s);
    *why = "default route";
    return e;
  }
  close(s);
  if (dns[0]) net_write_resolv(dns);
  logmsg("net: %s %s/%d via %s%s%s", NET_IFACE, addr, prefix, gw, dns[0] ? " dns " : "", dns);
  return 0;
}

/* Applies pvisor.net= (see the header comment); the caller has mounted /proc and /run. */
static void setup_network(void) {
  int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (s < 0) {
    logmsg("net: socket: %s", strerror(errno)); /* a kernel without INET: nothing to do */
    return;
  }
  if (net_ifflags_up(s, "lo")) logmsg("net: lo up: %s", strerror(errno));
  close(s);
  char spec[128];
  if (!cmdline_param("pvisor.net", spec, sizeof spec)) return;
  const char *why = "";
  int e = net_apply(spec, 0, &why);
  if (e == EINVAL && !strcmp(why, "ADDRESS/PREFIX,GATEWAY[,DNS]")) logmsg("net: cannot parse pvisor.net=%s (ADDRESS/PREFIX,GATEWAY[,DNS])", spec);
  else if (e) logmsg("net: %s: %s", why, strerror(e));
}
