/*
 * The one record every pvisor helper thread sends to Node, and the socket it travels on.
 *
 * Helper threads never call into JavaScript: Node cannot be entered from a foreign thread without
 * a worker (about 8 MiB of PSS each), and libuv can watch a socket but not an eventfd or a
 * userfaultfd. So each helper owns one end of a Unix socketpair and Node reads the other end on
 * its event loop (src/native/record-channel.ts), as a stream of these fixed 16-byte records.
 *
 * Layout (little-endian, no padding; mirrored by RecordChannel):
 *   kind  u16  what happened, in the helper's own enum (each helper has its own socket)
 *   tag   u16  which of the helper's things it is about (a vCPU, a queue, a source)
 *   err   i32  0, a positive errno, or a negative reason of the helper's own
 *   value u64  one number that goes with it (a return value, an offset, a count)
 */
#ifndef PV_RECORD_H
#define PV_RECORD_H

#include <errno.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/types.h>

struct pv_record {
  uint16_t kind;
  uint16_t tag;
  int32_t err;
  uint64_t value;
};

_Static_assert(sizeof(struct pv_record) == 16, "Node reads 16-byte records");

/*
 * Sends one record on the helper's end. Blocks while the socket is full (Node is busy: the
 * thread waits rather than dropping a record). Gives up silently when Node has closed its end or
 * the helper shut its own end for teardown: nobody is left to read the record.
 */
static inline void pv_record_send(int fd, uint16_t kind, uint16_t tag, int32_t err, uint64_t value) {
  struct pv_record rec = {kind, tag, err, value};
  const char *p = (const char *)&rec;
  size_t left = sizeof rec;
  while (left > 0) {
    /* MSG_NOSIGNAL: a closed peer must not raise SIGPIPE in Node's process. */
    ssize_t n = send(fd, p, left, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      return;
    }
    p += n;
    left -= (size_t)n;
  }
}

/*
 * Creates the record socket: *ours for the helper, *node for Node (which owns and closes it once
 * it has it). Close-on-exec, so a child process (a guest's QEMU, a shell) never holds it open.
 * Returns 0 or -errno.
 */
static inline int pv_record_socketpair(int *ours, int *node) {
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) return -errno;
  *ours = sv[0];
  *node = sv[1];
  return 0;
}

#endif
