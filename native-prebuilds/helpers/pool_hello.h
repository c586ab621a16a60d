/* The page pool's Hello payload (pool_hello.c). */
#ifndef PV_POOL_HELLO_H
#define PV_POOL_HELLO_H

#include <stddef.h>
#include <stdint.h>

/*
 * The pool protocol's version (POOL_PROTOCOL_VERSION of pool-protocol.ts): a client says it in its
 * Hello, the daemon says it in its answer. It is not the frame header's version byte, which is
 * the frame layout's (../include/pv_frame.h): either can change without the other.
 */
#define POOL_PROTOCOL_VERSION 1

/* The longest Hello payload, and the longest scope or VM name (MAX_NAME_BYTES of pool-protocol.ts). */
#define HELLO_MAX_BYTES 4096u
#define HELLO_MAX_NAME_BYTES 256u

/*
 * Reads a Hello: a JSON object whose "version" is the number POOL_PROTOCOL_VERSION, and whose "scope" and "name" are
 * strings of 1 to 256 bytes of UTF-8 without control characters (the last of a repeated member
 * counts, as with JSON.parse; other members are checked as JSON and ignored). Fills scope and
 * name (NUL-terminated) and returns 0; or returns -1 with why (NUL-terminated, at most why_bytes)
 * saying what is wrong. Reads nothing past p + len, whatever the bytes.
 */
int hello_parse(const uint8_t *p, size_t len, char scope[HELLO_MAX_NAME_BYTES + 1], char name[HELLO_MAX_NAME_BYTES + 1], char *why, size_t why_bytes);

/*
 * What a Hello's scope (as hello_parse read it) names. "gid:GID:NAME" is scope NAME of group GID
 * (decimal, no leading zero, below 4294967295; NAME at least one byte): *group = 1, *gid = GID.
 * Anything else is a scope of the peer's own uid: *group = 0, *name = scope. Returns 0 with *name
 * pointing into scope, or -1 with why (NUL-terminated, at most why_bytes) for a "gid:" scope of
 * another form.
 */
int hello_scope(const char *scope, int *group, uint32_t *gid, const char **name, char *why, size_t why_bytes);

#endif
