/* CRC32C of [p, p+len), from crc32c.c. */
#ifndef PV_CRC32C_H
#define PV_CRC32C_H

#include <stdint.h>

/* The SSE4.2 instruction when the CPU has it, else the portable path. Callable from any thread. */
uint32_t pv_crc32c(const uint8_t *p, uint64_t len);

/* The portable path alone (slicing by 8). */
uint32_t pv_crc32c_sw(const uint8_t *p, uint64_t len);

/*
 * For each of `pages` 4 KiB pages from p: the CRC32C of its first half in the low 32 bits of
 * out[i], of its second half in the high 32 bits. A key for finding pages of equal content (the
 * page pool); equal keys are then compared byte for byte. One call for a whole run of pages,
 * because a call per page from Node costs more than the checksum.
 */
void pv_page_hashes(const uint8_t *p, uint64_t pages, uint64_t *out);

#endif
