/* CRC32C of [p, p+len), from crc32c.c. */
#ifndef PV_CRC32C_H
#define PV_CRC32C_H

#include <stdint.h>

/* The SSE4.2 instruction when the CPU has it, else the portable path. Callable from any thread. */
uint32_t pv_crc32c(const uint8_t *p, uint64_t len);

/* The portable path alone (slicing by 8). */
uint32_t pv_crc32c_sw(const uint8_t *p, uint64_t len);

#endif
